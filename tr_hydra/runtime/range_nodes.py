"""RangeOps bound to the arena: each RANGE_* node of the step program becomes a closure over
fixed flat views of its region span (the plain-torch reference, or the fused Triton kernels).
``BINDERS`` holds one binder per ``RangeOp``; a node that the fusion pass merged with others
(``compiler.fusion``) is bound to the fused kernel that runs them all in one pass."""
from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Callable

import torch

from tr_hydra.compiler.fusion import GRAD16, HALF, UNWRITTEN
from tr_hydra.compiler.program import Node, RangeOp
from tr_hydra.memory.arena import ArenaKeeper
from tr_hydra.memory.plan import MemoryPlan
from tr_hydra.memory.regions import MATRIX_KINDS, Region
from tr_hydra.ops import range_ops as ops
from tr_hydra.ops.optimizers import HyperScalars, apply_update

R = Region
Step = Callable  # called with the step's context


@dataclass(frozen=True)
class Binding:
    """What range nodes are bound over: one executor's arena, its device scalars and result
    views, and the kernels that run them (``fused``: the Triton module, or None for the
    plain-torch reference)."""
    arena: ArenaKeeper
    plan: MemoryPlan
    pc: object  # the PlanConfig
    s: dict[str, torch.Tensor]  # the device scalars, by name
    h: HyperScalars
    result: torch.Tensor  # the step's results (R_RESULT)
    acc: dict[str, torch.Tensor]  # their accumulators, by split
    nonfinite_mask: torch.Tensor  # the regions non-finite at the first bad step
    fused: ModuleType | None
    dist: object  # the DistContext
    segments: ops.Segments | None = None  # LARS: the W matrix span's segment table
    bn_eps: float = 1e-5


def lars_segments(plan: MemoryPlan, device: torch.device) -> ops.Segments:
    """The segment table of the W matrix span (one segment per tensor slot), for LARS's norms."""
    elems = [t.slot_bytes // 4 for k in MATRIX_KINDS for t in plan.tensors_in(R[f"W_{k}"])]
    return ops.Segments.from_sizes(elems, device)


def bind(b: Binding, n: Node) -> Step:
    """The closure that runs range node ``n`` over ``b``."""
    try:
        op = RangeOp(n.op)
    except ValueError:
        raise NotImplementedError(f"no executor for node {n.op}") from None
    return BINDERS[op](b, n)


def _span(b: Binding, span, dtype=None):
    return b.arena.span(span[0], span[1], dtype)


def _temp(b: Binding, name: str, numel: int) -> torch.Tensor:
    """The first ``numel`` 4-byte words of a plan temporary (``temp.*``), as int32."""
    t = b.plan[name]
    view = b.arena.view(t).view(-1).view(torch.int32)
    if view.numel() < numel:
        raise RuntimeError(f"{name} holds {view.numel()} words, the span {numel}")
    return view[:numel]


def _clear(b: Binding, n: Node) -> Step:
    buf = _span(b, n.spans[0], torch.uint8)
    return lambda ctx: ops.clear(buf)


def _mean_allreduce(b: Binding, n: Node) -> Step:
    if not b.dist.backend:
        return lambda ctx: None  # one process, no process group: nothing to reduce
    from tr_hydra.runtime.distributed import all_reduce_sum
    views = [_span(b, s) for s in n.spans]
    dist = b.dist

    def allreduce(ctx):
        for v in views:  # SUM: the loss gradient already carries 1/world_size
            all_reduce_sum(dist, v)
    return allreduce


def _cast(b: Binding, n: Node) -> Step:
    dst, src = _span(b, n.spans[0]), _span(b, n.spans[1])
    scale = b.s[n.arg("scale")] if n.arg("scale") else None
    if b.fused is not None:
        fused = b.fused
        return lambda ctx: fused.fused_cast(dst, src, scale)
    return lambda ctx: ops.cast(dst, src, scale)


def _grad_scaling(b: Binding, n: Node) -> Step:
    if n.arg("update"):
        s, inv, tr, fi = b.s["loss_scale"], b.s["inv_loss_scale"], b.s["growth_tracker"], b.s["found_inf"]
        interval = b.pc.trainer.loss_scale_growth_interval
        return lambda ctx: ops.update_loss_scale(s, inv, tr, fi, interval)
    buf, scale = _span(b, n.spans[0]), b.s[n.arg("scale")]
    return lambda ctx: ops.scale_inplace(buf, scale)


def _ema(b: Binding, n: Node) -> Step:
    dst, src = _span(b, n.spans[0]), _span(b, n.spans[1])
    decay, step, warm = b.s["ema_decay"], b.s["step"], b.pc.ema_warmup
    gate = b.s[n.arg("gate")] if n.arg("gate") else None
    if b.fused is not None:
        fused = b.fused
        return lambda ctx: fused.fused_ema(dst, src, decay, step, warm, gate)
    return lambda ctx: ops.ema_update(dst, src, ops.ema_decay_at(decay, step, warm), gate)


def _d2d_copy(b: Binding, n: Node) -> Step:
    """Into a plan temporary (``dst``) or a span."""
    src = _span(b, n.spans[1], torch.int32)
    dst = _temp(b, n.arg("dst"), src.numel()) if n.arg("dst") else _span(b, n.spans[0], torch.int32)
    return lambda ctx: ops.d2d_copy(dst, src)


def _restore_if_skipped(b: Binding, n: Node) -> Step:
    """Integer views: the bytes put back exactly."""
    dst = _span(b, n.spans[0], torch.int32)
    src = _temp(b, n.arg("src"), dst.numel()) if n.arg("src") else _span(b, n.spans[1], torch.int32)
    flag = b.s[n.arg("gate")]
    return lambda ctx: ops.restore_if(dst, src, flag)


def _nonfinite_limit(b: Binding, n: Node) -> Step:
    flag, count = b.s[n.arg("flag")], b.s[n.arg("count")]
    state = b.arena.view(b.plan[n.arg("state")]).view(-1)
    limit = b.fused.nonfinite_limit if b.fused is not None else ops.nonfinite_limit
    return lambda ctx: limit(flag, count, state)


def _accum_metrics(b: Binding, n: Node) -> Step:
    into, res, acc = n.arg("into"), b.result, b.acc

    def accum(ctx):
        ops.accum_metrics(acc[ctx.extra.get("into", into)], res)
    return accum


def _bn_fold(b: Binding, n: Node) -> Step:
    eqb, eqs = b.arena.span(R.W_EQ_BIAS), b.arena.span(R.W_EQ_SCALE)
    bb, bw = b.arena.span(R.W_BN_BIAS), b.arena.span(R.W_BN_WEIGHT)
    mean, var = b.arena.span(R.B_PREV_MEAN), b.arena.span(R.B_PREV_VAR)
    eps = b.bn_eps
    return lambda ctx: ops.bn_fold(eqb, eqs, bb, bw, mean, var, eps)


@dataclass(frozen=True)
class CheckLayout:
    """What a RANGE_CHECK_NAN node covers: ``regions``, in the order of its flags and of the
    first bad step's mask; ``exact``, those of them checked element by element; with the
    fused kernels ``groups`` ((index of the first region, regions) for each run of regions
    adjacent in the arena and of one dtype: one pass each) and ``sumsq`` ((accumulator,
    result, index of the group), or None: see ``check_layout``)."""
    regions: list[Region]
    exact: list[Region]
    groups: list[tuple[int, list[Region]]]
    sumsq: tuple[torch.Tensor, torch.Tensor, int] | None

    @property
    def grad16_sumsq(self) -> torch.Tensor | None:
        """The sum of squares of the 16-bit gradients, taken by the check, or None."""
        return self.sumsq[1] if self.sumsq is not None else None


def check_layout(b: Binding, n: Node) -> CheckLayout:
    """One sum per region of the first span (every gradient region, and the step's loss in
    R_RESULT) and a check of each region of the further spans (the BN statistics the forward
    has just updated), element by element in the reference too (a sum of large finite running
    variances could overflow). Gradients a fused update reads in 16 bits are checked there, not
    in their unwritten fp32 twins."""
    size = b.plan.region_size
    start, end = n.spans[0]
    regions = [Region(i) for i in range(start, end + 1) if size[Region(i)]]
    exact = [Region(i) for a, c in n.spans[1:] for i in range(a, c + 1) if size[Region(i)]]
    for span32, span16 in zip(n.fused_spans(UNWRITTEN), n.fused_spans(GRAD16)):
        skip = set(range(int(span32[0]), int(span32[1]) + 1))
        regions = [r for r in regions if int(r) not in skip]
        regions += [Region(i) for i in range(int(span16[0]), int(span16[1]) + 1) if size[Region(i)]]
    regions += exact
    if b.fused is None:
        return CheckLayout(regions, exact, [], None)
    groups = _check_groups(b, regions)
    # plan.share_grad16: the 16-bit gradients are overwritten by the new 16-bit weights later
    # in the step, so their sum of squares (telemetry's gradient norm) is taken here, in the
    # pass that reads them anyway
    sq = None
    shared = [i for i, (_, grp) in enumerate(groups) if all(r in b.plan.shared for r in grp)]
    if shared and n.fused_spans(GRAD16):
        both = b.arena.view(b.plan["temp.grad16_sumsq"]).view(-1)
        sq = (both[0:1], both[1:2], shared[0])
    return CheckLayout(regions, exact, groups, sq)


def _check_groups(b: Binding, regions):
    groups = []
    for i, r in enumerate(regions):
        if groups:
            first, g = groups[-1]
            prev = g[-1]
            end = b.plan.region_base[prev] + b.plan.region_size[prev]
            if b.plan.region_base[r] == end and b.arena.region_dtype(r) == b.arena.region_dtype(prev):
                g.append(r)
                continue
        groups.append((i, [r]))
    return groups


def _check(b: Binding, n: Node) -> Step:
    """The step's flag, and which regions were non-finite at the first bad step (``check_layout``)."""
    lay = check_layout(b, n)
    regions = lay.regions
    views = [b.arena.span(r, r) for r in regions]
    flag, skipped, nonfinite = b.s["found_inf"], b.s["skipped"], b.s["nonfinite"]
    first_step, step = b.s["nonfinite_step"], b.s["step"]
    mask = b.nonfinite_mask[:len(regions)]
    fp16 = bool(n.arg("fp16"))
    count = skipped if fp16 else nonfinite
    if b.fused is not None:  # one pass per run of adjacent same-dtype regions, one finish
        spans = []
        for first, group in lay.groups:
            span = b.arena.span(group[0], group[-1])  # in the regions' own dtype
            base = b.plan.region_range(group[0], group[0])[0]
            starts = torch.tensor([(b.plan.region_range(r, r)[0] - base) // span.element_size()
                                   for r in group], dtype=torch.int32, device=b.arena.device)
            spans.append((span, starts, first))
        flags = b.arena.view(b.plan["mask.nonfinite_flags"]).view(-1)[:len(regions)]
        fused, sq = b.fused, lay.sumsq
        return lambda ctx: fused.nonfinite_check(spans, flags, mask, flag, count, first_step, step, sq=sq)
    whole = {id(v) for r, v in zip(regions, views) if r in lay.exact}

    def check(ctx):
        bad = ~torch.isfinite(torch.stack([v.abs().amax() if id(v) in whole else v.sum(dtype=torch.float32)
                                           for v in views]))
        flag.copy_(bad.any().float().view(1))
        # fp16 overflow is the loss-scale search at work; anything else is a fault
        count.add_(flag)
        first = (mask.sum() == 0) & bad.any()  # keep the first bad step's regions
        mask.copy_(torch.where(first, bad.to(mask.dtype), mask))
        first_step.copy_(torch.where(first, step + 1, first_step))
    return check


def _update(b: Binding, n: Node) -> Step:
    w, g = _span(b, n.spans[0]), _span(b, n.spans[1])
    states = [_span(b, s) for s in n.spans[2:]]
    extra = {}
    if n.op == RangeOp.RANGE_UPDATE_WEIGHT_LARS.value:
        extra = {"segments": b.segments, "norms": states.pop()}
    wd = b.s[n.arg("wd")]
    gate = b.s[n.arg("gate")] if n.arg("gate") else None
    op, h = n.op, b.h
    if b.fused is not None and b.fused.supports(op):
        fused = b.fused
        for half in n.fused_spans(HALF):  # the cast of W into its 16-bit copy, in the same pass
            extra["half"] = _span(b, half)
        for span16 in n.fused_spans(GRAD16):  # the cast (and unscale) of the gradients before it
            g = _span(b, span16)
            extra["g_scale"] = b.s[n.arg("g_scale")] if n.arg("g_scale") else None
        return lambda ctx: fused.fused_update(op, w, g, states, h, wd, gate, **extra)
    if n.fused:
        raise RuntimeError(f"{op} was fused with {', '.join(k for k, _ in n.fused)} for kernels this "
                           "executor does not run; compile the plan with the executor's kernel choice")
    return lambda ctx: apply_update(op, w, g, states, h, wd, gate, **extra)


BINDERS: dict[RangeOp, Callable[[Binding, Node], Step]] = {
    RangeOp.RANGE_CLEAR: _clear,
    RangeOp.RANGE_MEAN_ALLREDUCE: _mean_allreduce,
    RangeOp.RANGE_CAST_FP16_TO_FP32: _cast,
    RangeOp.RANGE_CAST_FP32_TO_FP16: _cast,
    RangeOp.RANGE_GRAD_SCALING: _grad_scaling,
    RangeOp.RANGE_CHECK_NAN: _check,
    **{op: _update for op in RangeOp if op.value.startswith("RANGE_UPDATE_")},
    RangeOp.RANGE_EMA_PARAM_UPDATE: _ema,
    RangeOp.RANGE_D2D_COPY: _d2d_copy,
    RangeOp.RANGE_RESTORE_IF_SKIPPED: _restore_if_skipped,
    RangeOp.RANGE_NONFINITE_LIMIT: _nonfinite_limit,
    RangeOp.RANGE_ACCUM_METRICS: _accum_metrics,
    RangeOp.RANGE_BN_FOLD: _bn_fold,
}
