"""Run by test_triton_ops.py in a subprocess with TRITON_INTERPRET=1 (or directly on a GPU):
the fused kernels against the plain-torch reference."""
from __future__ import annotations

import math
import sys

import torch

from tr_hydra.ops import range_ops as ref
from tr_hydra.ops import triton_ops as tri
from tr_hydra.ops.optimizers import HyperScalars, apply_update


def main(device: str) -> int:
    torch.manual_seed(0)
    dev = torch.device(device)
    n = 3000  # not a multiple of the block: the masked tail is exercised
    def s(x):
        return torch.tensor([x], dtype=torch.float32, device=dev)
    h = HyperScalars(lr=s(0.05), momentum=s(0.9), beta1_complement=s(0.1), beta2_complement=s(0.001), eps=s(1e-8), step=s(3.0),
                     trust_coefficient=s(0.001))
    failures = []
    for op, n_state in (("RANGE_UPDATE_WEIGHT_SGD", 0), ("RANGE_UPDATE_WEIGHT_MOMENTUM", 1),
                        ("RANGE_UPDATE_WEIGHT_NESTEROV", 1), ("RANGE_UPDATE_WEIGHT_ADAM", 2),
                        ("RANGE_UPDATE_WEIGHT_ADAMW", 2), ("RANGE_UPDATE_BIAS_MOMENTUM", 1)):
        for gate in (None, 0.0, 1.0):
            w = torch.randn(n, device=dev)
            g = torch.randn(n, device=dev)
            st = [torch.randn(n, device=dev).abs() for _ in range(n_state)]
            wd = s(5e-4)
            gt = None if gate is None else s(gate)
            a = [w.clone(), g.clone()] + [x.clone() for x in st]
            b = [w.clone(), g.clone()] + [x.clone() for x in st]
            apply_update(op, a[0], a[1], a[2:], h, wd, gt)
            tri.fused_update(op, b[0], b[1], b[2:], h, wd, gt)
            for name, x, y in zip(("w", "g", "m", "v"), a, b):
                err = ((x - y).norm() / x.norm()).item()
                if err > 1e-6:
                    failures.append(f"{op} gate={gate} {name}: {err:.2e}")
            if gate == 1.0 and not torch.equal(b[0], w):
                failures.append(f"{op}: a skipped step changed w")
            # the same update writing the 16-bit copy in the same pass equals update, then cast
            if op.startswith("RANGE_UPDATE_WEIGHT_"):
                c = [w.clone(), g.clone()] + [x.clone() for x in st]
                # bf16 on the GPU; fp16 in the interpreter, whose bf16 conversion truncates
                hd = torch.bfloat16 if dev.type == "cuda" else torch.float16
                half = torch.full((n,), 7.0, dtype=hd, device=dev)
                tri.fused_update(op, c[0], c[1], c[2:], h, wd, gt, half=half)
                if not (torch.equal(c[0], b[0]) and torch.equal(half, b[0].to(hd))):
                    failures.append(f"{op} gate={gate}: update + 16-bit copy differs from update, then cast")
            # reading the 16-bit gradients directly (and unscaling them) equals cast, then update
            failures += _check_grad16(op, w, g, st, h, wd, gt, dev)
    from tr_hydra.ops.range_ops import Segments
    sizes = [64 * k for k in (3, 1, 17, 5)]  # slots of four tensors, 64-element blocks
    seg = Segments.from_sizes(sizes, dev)
    lars = _loaded_bounds_run(dev)
    if not lars:
        print("unchecked: LARS (this Triton's interpreter cannot run a loop bounded by a loaded value, "
              "as LARS's norm kernel does)")
    for gate in ((None, 0.0, 1.0) if lars else ()):
        total = sum(sizes)
        w, g, m = torch.randn(total, device=dev), torch.randn(total, device=dev), torch.randn(total, device=dev)
        gt = None if gate is None else s(gate)
        a, b = [w.clone(), g.clone(), m.clone()], [w.clone(), g.clone(), m.clone()]
        na, nb = torch.zeros(4 * 128, device=dev), torch.zeros(4 * 128, device=dev)
        apply_update("RANGE_UPDATE_WEIGHT_LARS", a[0], a[1], [a[2]], h, s(5e-4), gt, segments=seg, norms=na)
        tri.fused_update("RANGE_UPDATE_WEIGHT_LARS", b[0], b[1], [b[2]], h, s(5e-4), gt, segments=seg, norms=nb)
        for name, x, y in zip(("w", "g", "m"), a, b):
            err = ((x - y).norm() / x.norm()).item()
            if err > 1e-6:
                failures.append(f"LARS gate={gate} {name}: {err:.2e}")
        if not torch.allclose(na, nb):
            failures.append(f"LARS gate={gate}: norm records differ")
        failures += _check_grad16("RANGE_UPDATE_WEIGHT_LARS", w, g, [m], h, s(5e-4), gt, dev, segments=seg)
        c = [w.clone(), g.clone(), m.clone()]
        half = torch.zeros(total, dtype=torch.float16, device=dev)
        tri.fused_update("RANGE_UPDATE_WEIGHT_LARS", c[0], c[1], [c[2]], h, s(5e-4), gt, segments=seg,
                         norms=torch.zeros_like(nb), half=half)
        if not (torch.equal(c[0], b[0]) and torch.equal(half, b[0].half())):
            failures.append(f"LARS gate={gate}: update + 16-bit copy differs from update, then cast")
    for src_dt, dst_dt, scale in ((torch.float32, torch.float16, None), (torch.float16, torch.float32, 0.25),
                                  (torch.float32, torch.float32, 2.0)):
        x = torch.randn(n, device=dev).to(src_dt)
        a = torch.empty(n, dtype=dst_dt, device=dev)
        b = torch.empty(n, dtype=dst_dt, device=dev)
        sc = None if scale is None else s(scale)
        ref.cast(a, x, sc)
        tri.fused_cast(b, x, sc)
        if not torch.equal(a, b):
            failures.append(f"cast {src_dt}->{dst_dt} scale={scale}")
    for warm in (True, False):
        e, w = torch.randn(n, device=dev), torch.randn(n, device=dev)
        a, b = e.clone(), e.clone()
        ref.ema_update(a, w, ref.ema_decay_at(s(0.999), s(5.0), warm))
        tri.fused_ema(b, w, s(0.999), s(5.0), warm)
        # a few ulps: on the GPU Triton contracts the multiply-add into an FMA (seen: 3.6e-7 on
        # values of order 1), which torch.lerp's kernel rounds in two steps
        if not torch.allclose(a, b, rtol=1e-6, atol=1e-6):
            failures.append(f"ema warmup={warm}: max abs diff {(a - b).abs().max().item():.2e}")
        for gate in (0.0, 1.0):  # a taken step, and a skipped one: the EMA keeps its values exactly
            a, b = e.clone(), e.clone()
            ref.ema_update(a, w, ref.ema_decay_at(s(0.999), s(5.0), warm), s(gate))
            tri.fused_ema(b, w, s(0.999), s(5.0), warm, s(gate))
            if not torch.allclose(a, b, rtol=1e-6, atol=1e-6) or (gate and not torch.equal(b, e)):
                failures.append(f"ema warmup={warm} gate={gate}: max abs diff {(a - b).abs().max().item():.2e}")
    failures += check_nonfinite_limit(dev)
    failures += check_nonfinite(dev)
    failures += check_executor_fuses_update_and_cast(dev)
    print("\n".join(failures) or "ok")
    return 1 if failures else 0


def _loaded_bounds_run(dev) -> bool:
    """Whether Triton runs a loop whose bounds are loaded values (LARS's norm kernel has one):
    the interpreter of Triton 3.6 (PyTorch 2.11's) cannot; a GPU can."""
    import triton
    import triton.language as tl

    @triton.jit
    def count(ends_ptr, out_ptr):
        n = 0
        for _ in range(0, tl.load(ends_ptr), 1):
            n += 1
        tl.store(out_ptr, n)
    out = torch.zeros(1, dtype=torch.int32, device=dev)
    try:
        count[(1,)](torch.tensor([3], dtype=torch.int32, device=dev), out)
    except Exception:  # noqa: BLE001 - triton.runtime.errors.InterpreterError
        return False
    return out.item() == 3


def _check_grad16(op, w, g, st, h, wd, gt, dev, segments=None) -> list[str]:
    """The update fed the 16-bit gradients (times an unscale factor, or not) must be bit-equal
    to the 16-bit -> fp32 cast followed by the update on the fp32 gradients."""
    failures = []
    for dt in ((torch.bfloat16, torch.float16) if dev.type == "cuda" else (torch.float16,)):
        for scale in (None, 0.25):
            sc = None if scale is None else torch.tensor([scale], device=dev)
            g16 = (g * 64).to(dt)
            g32 = torch.empty(g.numel(), device=dev)
            ref.cast(g32, g16, sc)
            extra = {} if segments is None else {"segments": segments}
            a = [w.clone()] + [x.clone() for x in st]
            b = [w.clone()] + [x.clone() for x in st]
            na, nb = (torch.zeros(segments.count * 128, device=dev), torch.zeros(segments.count * 128, device=dev)) \
                if segments is not None else (None, None)
            tri.fused_update(op, a[0], g32, a[1:], h, wd, gt, **extra, **({"norms": na} if na is not None else {}))
            tri.fused_update(op, b[0], g16, b[1:], h, wd, gt, g_scale=sc, **extra,
                             **({"norms": nb} if nb is not None else {}))
            if not all(torch.equal(x, y) for x, y in zip(a, b)) or (na is not None and not torch.equal(na, nb)):
                failures.append(f"{op} gate={gt is not None and gt.item()} {dt} scale={scale}: "
                                f"reading the 16-bit gradients differs from cast, then update")
            # plan.share_grad16: the 16-bit copy is written over the gradients it was computed
            # from (one buffer): the same update, and the buffer ends as the new weights' cast
            c = [w.clone()] + [x.clone() for x in st]
            one = g16.clone()
            nc = torch.zeros_like(nb) if nb is not None else None
            tri.fused_update(op, c[0], one, c[1:], h, wd, gt, g_scale=sc, half=one, **extra,
                             **({"norms": nc} if nc is not None else {}))
            if not all(torch.equal(x, y) for x, y in zip(b, c)) or not torch.equal(one, c[0].to(dt)):
                failures.append(f"{op} gate={gt is not None and gt.item()} {dt} scale={scale}: "
                                f"the 16-bit copy written over the gradients changes the update")
    return failures


def _check_fused_skip(tr) -> list[str]:
    """An inf in one 16-bit matrix gradient (the fp32 twins are not written any more) is
    caught by the check: the update is skipped, fp16's loss scale backs off, the region is
    named. The gradient regions' norm in telemetry is that of the gradients the update read."""
    from tr_hydra.memory.regions import BIAS_KINDS, MATRIX_KINDS, series_span
    from tr_hydra.telemetry.tensorboard import SpanNorms
    failures = []
    ex, a = tr.ex, tr.arena
    g16 = a.span(*series_span("G16", MATRIX_KINDS))
    gb = a.span(*series_span("G", BIAS_KINDS))
    if tr.compiled.plan.shared:
        # the 16-bit gradients are the new 16-bit weights by the end of the step: recompute them
        # with the step's own ops up to the check, and take the norm there
        from tr_hydra.runtime.executor import StepContext
        names = [n.op for n in tr.compiled.program.train]
        ctx = StepContext(variant="train_base", buffer="A")
        for op in ex.train_ops[:names.index("RANGE_CHECK_NAN")]:
            op(ctx)
        want = (g16.float().norm() ** 2 + gb.norm() ** 2).sqrt().item()
        for op in ex.train_ops[names.index("RANGE_CHECK_NAN"):]:
            op(ctx)
        if ex.grad16_sumsq is None:
            failures.append("executor: the shared 16-bit gradients' sum of squares is not taken")
        norms = SpanNorms(a, ex.grads_read_16bit, ex.grad16_sumsq).read()
        loose = SpanNorms(a, ex.grads_read_16bit).read()
        if "G" in loose or abs(loose.get("G_fp32", -1.0) - gb.norm().item()) > 1e-5 * gb.norm().item():
            failures.append("telemetry: without the step's sum of squares the gradient norm is not G_fp32")
    else:
        ex.train_step("train_base", "A")
        want = (g16.float().norm() ** 2 + gb.norm() ** 2).sqrt().item()
        norms = SpanNorms(a, ex.grads_read_16bit).read()
    got = norms["G"]
    if abs(got - want) > 1e-5 * want:
        failures.append(f"telemetry: gradient norm {got} is not that of the gradients the update read ({want})")
    scale = ex.scalar("loss_scale")
    # a backward-free way to poison exactly one 16-bit gradient: run the ops after the backward
    ex.train_step("train_base", "A")
    w_before = a.span(*series_span("W", MATRIX_KINDS)).clone()
    m_before = a.span(*series_span("M", MATRIX_KINDS)).clone()
    g16[7] = float("inf")
    names = [n.op for n in tr.compiled.program.train]
    start = names.index("RANGE_MEAN_ALLREDUCE")
    from tr_hydra.runtime.executor import StepContext
    ctx = StepContext(variant="train_base", buffer="A")
    for op in ex.train_ops[start:]:
        op(ctx)
    if ex.scalar("found_inf") != 1.0:
        failures.append("executor: an inf in a 16-bit gradient was not found")
    if not (torch.equal(a.span(*series_span("W", MATRIX_KINDS)), w_before)
            and torch.equal(a.span(*series_span("M", MATRIX_KINDS)), m_before)):
        failures.append("executor: the update ran on a step with an inf gradient")
    w16 = a.span(*series_span("A", MATRIX_KINDS))
    if not torch.equal(w16, w_before.to(w16.dtype)):  # over the poisoned gradient when shared
        failures.append("executor: after a skipped step the 16-bit weights are not the masters' cast")
    if ex.scalar("loss_scale") >= scale:
        failures.append("executor: the fp16 loss scale did not back off")
    return failures


def check_nonfinite_limit(dev) -> list[str]:
    """trainer.max_nonfinite's device state over a run of steps (flags 0/1 as the check writes
    them), the fused kernel against the reference, step by step."""
    failures = []
    flags = [0, 1, 0, 1, 0, 0, 1, 0]
    for limit in (1.0, 2.0, 5.0):
        st = {k: (torch.zeros(1, device=dev), torch.zeros(1, device=dev),
                  torch.tensor([limit, 0.0, 0.0, 0.0], device=dev)) for k in ("ref", "tri")}
        for t, f in enumerate(flags):
            for k, fn in (("ref", ref.nonfinite_limit), ("tri", tri.nonfinite_limit)):
                flag, count, state = st[k]
                flag.fill_(float(f))
                count.add_(flag)  # as the check counts it
                fn(flag, count, state)
            got = [torch.cat(st["tri"]).tolist()]
            want = [torch.cat(st["ref"]).tolist()]
            if got != want:
                failures.append(f"nonfinite limit {limit} step {t}: got {got}, want {want}")
    return failures


def check_nonfinite(dev) -> list[str]:
    """Per-region flags against torch.isfinite per region, over a sequence of steps: clean, bad
    (the first bad step's regions and step number kept), bad again (kept, not overwritten).
    Regions 0-2 are one fp32 span, regions 3-4 one 16-bit span: two kernels, one set of flags."""
    failures = []
    sizes = [5, 1030, 7, 2048, 3]  # region boundaries inside blocks and across them
    hd = torch.bfloat16 if dev.type == "cuda" else torch.float16
    groups = [(0, 3, torch.float32), (3, 5, hd)]
    starts = {a: torch.tensor([sum(sizes[a:i]) for i in range(a, b)], dtype=torch.int32, device=dev)
              for a, b, _ in groups}
    flags = torch.zeros(len(sizes), dtype=torch.int8, device=dev)
    mask = torch.zeros(len(sizes), dtype=torch.int8, device=dev)
    found, count = torch.zeros(1, device=dev), torch.zeros(1, device=dev)
    first_step, step = torch.zeros(1, device=dev), torch.zeros(1, device=dev)
    expect_mask, expect_first, expect_count = [0] * len(sizes), 0.0, 0
    sq = torch.full((2,), 5.0, device=dev)  # the accumulator starts dirty once
    for t, poison in enumerate(([], [(1, float("nan"), 1029)], [], [(3, float("inf"), 0), (0, -float("inf"), 4)],
                                [(4, float("nan"), 2)])):
        parts = [torch.randn(k, device=dev) for k in sizes]
        for r, val, at in poison:
            parts[r][at] = val
        bad = [not torch.isfinite(p).all().item() for p in parts]
        spans = [(torch.cat(parts[a:b]).to(dt), starts[a], a) for a, b, dt in groups]
        step.fill_(float(t))
        if t == 0:
            sq[0] = 0.0
        tri.nonfinite_check(spans, flags, mask, found, count, first_step, step, sq=(sq[0:1], sq[1:2], 1))
        want_sq = spans[1][0].float().square().sum().item()
        got_sq = sq[1].item()
        if sq[0].item() != 0.0 or (math.isfinite(want_sq) != math.isfinite(got_sq)) or (
                math.isfinite(want_sq) and abs(got_sq - want_sq) > 1e-5 * want_sq):
            failures.append(f"nonfinite check step {t}: sum of squares {got_sq}, want {want_sq}, "
                            f"accumulator left at {sq[0].item()}")
        if any(bad):
            expect_count += 1
            if not any(expect_mask):
                expect_mask, expect_first = [int(b) for b in bad], t + 1.0
        got = (found.item(), count.item(), mask.tolist(), first_step.item(), flags.tolist())
        want = (float(any(bad)), float(expect_count), expect_mask, expect_first, [0] * len(sizes))
        if got != want:
            failures.append(f"nonfinite check step {t}: got {got}, want {want}")
    return failures


def check_executor_fuses_update_and_cast(dev) -> list[str]:
    """Training with the fused kernels (the weight update reading the 16-bit gradients and
    writing the 16-bit compute copy, both cast nodes skipped, the fp32 matrix gradient regions
    left out of the plan) ends where the plain-torch reference ends; a non-finite 16-bit
    gradient still skips the step and is named."""
    import dataclasses
    from tests.helpers import small_config
    from tr_hydra.memory.regions import MATRIX_KINDS, series_span
    from tr_hydra.train.trainer import Trainer
    failures, states = [], {}
    for kernels, share in (("torch", True), ("triton", True), ("triton", False)):
        pc = small_config(device=dev.type, amp=True, amp_dtype="fp16", max_steps=4, train_size=64, val_size=32,
                          share_grad16=share)
        # deterministic on the GPU: cuDNN's run-to-run noise would swamp the kernels' rounding
        pc = dataclasses.replace(pc, runtime=dataclasses.replace(pc.runtime, kernels=kernels,
                                                                 deterministic=dev.type == "cuda"))
        tr = Trainer(pc, f"/tmp/tr_fuse_{kernels}_{share}", log=lambda *_: None, telemetry=False)
        tr.fit()
        if kernels == "triton" and not share:  # same kernels, the gradients on their own bytes
            w2, a2 = (tr.arena.span(*series_span(s_, MATRIX_KINDS)).clone() for s_ in ("W", "A"))
            if not (torch.equal(w2, states["triton"][0]) and torch.equal(a2, states["triton"][1])):
                failures.append("executor: gradients on the 16-bit weights' bytes train differently")
            failures += _check_fused_skip(tr)
            continue
        if kernels == "triton":
            program = tr.compiled.program.train  # the fusion pass's, which the executor bound
            casts = [n.op for n in program if n.op.startswith("RANGE_CAST_")]
            into = [sorted(k for k, _ in n.fused) for n in program if n.op.startswith("RANGE_UPDATE_WEIGHT_")]
            if casts or into != [["grad16", "half"]] or len(tr.ex.train_ops) != len(program):
                failures.append(f"program: expected both casts fused into the update, got casts {casts}, "
                                f"the update fused with {into}")
            from tr_hydra.memory.regions import Region
            unused = {r.name: tr.compiled.plan.region_size[r]
                      for r in (Region.G_FC_WEIGHT, Region.G_FIRST_CONV, Region.G_DEEP_CONV)}
            if any(unused.values()):  # the update reads the 16-bit gradients: no fp32 twins
                failures.append(f"plan: fp32 matrix gradients kept under fused AMP: {unused}")
        a = tr.arena
        states[kernels] = (a.span(*series_span("W", MATRIX_KINDS)).clone(),
                           a.span(*series_span("A", MATRIX_KINDS)).clone())
        if kernels == "triton":
            failures += _check_fused_skip(tr)
    (w0, _), (w1, a1) = states["torch"], states["triton"]
    if ((w0 - w1).norm() / w0.norm()).item() > (1e-4 if dev.type == "cuda" else 1e-5):
        failures.append(f"executor: fused weights differ from the reference: {((w0 - w1).norm() / w0.norm()).item():.2e}")
    if not torch.equal(a1, w1.to(a1.dtype)):
        failures.append("executor: the 16-bit copy is not the cast of the updated weights")
    return failures


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "cpu"))
