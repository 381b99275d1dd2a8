"""The fusion pass: the StepProgram as the fused kernels run it.

With the fused kernels (``runtime.kernels``: Triton), a weight update takes in the casts on either
side of it. The 16-bit -> fp32 cast of the matrix gradients (with the fp16 unscale) before it: the
update reads the 16-bit span and unscales in the same pass, so the fp32 matrix gradients are never
written (the plan leaves them out: ``compile.fused_update_reads_16bit``). The fp32 -> 16-bit cast
of the same W span after it: the update writes the 16-bit copy as well. The pass removes both cast
nodes and records on the update what its kernel also reads and writes (``Node.fused``); the
non-finite check, which looked at the gradients the cast wrote, looks at the 16-bit ones the
update reads instead. ``tr-plan`` prints the program after this pass, the one the executor binds.
"""
from __future__ import annotations

import dataclasses

from tr_hydra.compiler.program import Node, RangeOp, Span, StepProgram

_CAST_DOWN = RangeOp.RANGE_CAST_FP32_TO_FP16.value
_CAST_UP = RangeOp.RANGE_CAST_FP16_TO_FP32.value
_CHECK = RangeOp.RANGE_CHECK_NAN.value

# the keys of ``Node.fused`` this pass writes
HALF = "half"            # an update: the 16-bit span it also writes, its W span cast
GRAD16 = "grad16"        # an update: the 16-bit span it reads its gradients from (arg "g_scale": times
                         # that scalar); the check: a 16-bit gradient span it covers
UNWRITTEN = "unwritten"  # the check: an fp32 gradient span no node writes, which it leaves out


def _fuses(n: Node) -> bool:
    """A weight update: the fused kernels run every one of them with its casts in one pass."""
    return n.op.startswith("RANGE_UPDATE_WEIGHT_")


def _update_cast_pairs(nodes) -> tuple[dict[int, Span], set[int]]:
    """A weight update followed (later in the step) by the cast of the same W span into its
    16-bit copy: {index of the update: 16-bit span}, and the indices of those casts."""
    half, away = {}, set()
    for i, n in enumerate(nodes):
        if not _fuses(n):
            continue
        for j in range(i + 1, len(nodes)):
            c = nodes[j]
            if c.op == _CAST_DOWN and c.spans[1] == n.spans[0] and not c.arg("scale"):
                half[i] = c.spans[0]
                away.add(j)
                break
    return half, away


def _grad_cast_pairs(nodes) -> tuple[dict[int, tuple[Span, str]], set[int]]:
    """The 16-bit -> fp32 cast of gradients that a later weight update reads: {index of the
    update: (16-bit span, scale scalar name or "")}, in the order of the casts, and the indices
    of those casts."""
    into, away = {}, set()
    for i, c in enumerate(nodes):
        if c.op != _CAST_UP:
            continue
        for j in range(i + 1, len(nodes)):
            n = nodes[j]
            if _fuses(n) and n.spans[1] == c.spans[0]:
                into[j] = (c.spans[1], c.arg("scale") or "")
                away.add(i)
                break
    return into, away


def _fused_update(n: Node, half: Span | None, grad16: tuple[Span, str] | None) -> Node:
    fused, args, said = n.fused, n.args, []
    if grad16 is not None:
        span16, scale = grad16
        fused += ((GRAD16, span16),)
        if scale:
            args += (("g_scale", scale),)
        said.append(f"gradients read in 16 bits ({GRAD16})" + (f" times {scale}" if scale else ""))
    if half is not None:
        fused += ((HALF, half),)
        said.append(f"the 16-bit copy ({HALF}) written in the same pass")
    return dataclasses.replace(n, fused=fused, args=args, note="; ".join(([n.note] if n.note else []) + said))


def _checked_16bit(n: Node, read16: list[tuple[Span, Span]]) -> Node:
    fused = n.fused
    for span32, span16 in read16:
        fused += ((GRAD16, span16), (UNWRITTEN, span32))
    said = f"covers the 16-bit gradients the update reads ({GRAD16}), not their {UNWRITTEN} fp32 twins"
    return dataclasses.replace(n, fused=fused, note="; ".join(([n.note] if n.note else []) + [said]))


def fuse_updates(program: StepProgram) -> StepProgram:
    """``program`` with each weight update fused with the casts around it (see the module's
    text); the validation step and its prologue have none and are left as they are."""
    nodes = program.train
    half, away = _update_cast_pairs(nodes)
    grad16, away16 = _grad_cast_pairs(nodes)
    away |= away16
    read16 = [(nodes[j].spans[1], span16) for j, (span16, _) in grad16.items()]
    out = []
    for i, n in enumerate(nodes):
        if i in away:
            continue
        if i in half or i in grad16:
            n = _fused_update(n, half.get(i), grad16.get(i))
        elif n.op == _CHECK and read16:
            n = _checked_16bit(n, read16)
        out.append(n)
    return dataclasses.replace(program, train=tuple(out))


def grads_read_16bit(program: StepProgram) -> list[tuple[Span, Span]]:
    """(fp32 gradient span left unwritten, the 16-bit span the update reads instead), for each
    weight update of ``program`` that reads its gradients in 16 bits."""
    return [(n.spans[1], s) for n in program.train for k, s in n.fused if k == GRAD16 and _fuses(n)]
