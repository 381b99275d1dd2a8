"""RangeOps bound to the arena: each RANGE_* node of the step program becomes a closure over
fixed flat views of its region span (the plain-torch reference, or the fused Triton kernels,
which also merge a weight update with the casts around it into one pass)."""
from __future__ import annotations

from typing import Callable

import torch

from tr_hydra.compiler.program import Node
from tr_hydra.memory.regions import Region
from tr_hydra.ops import range_ops as ops
from tr_hydra.ops.optimizers import apply_update

R = Region


def _span(ex, span, dtype=None):
    return ex.arena.span(span[0], span[1], dtype)


def update_cast_pairs(nodes, fused) -> tuple[dict, set]:
    """With the fused kernels, a weight update followed (later in the step) by the cast of
    the same W span into its 16-bit copy becomes one pass: the update kernel writes both.
    Returns {id(update node): 16-bit span} and the ids of the cast nodes this makes
    redundant."""
    if fused is None:
        return {}, set()
    half, away = {}, set()
    for i, n in enumerate(nodes):
        if not (n.op.startswith("RANGE_UPDATE_WEIGHT_") and fused.supports(n.op)):
            continue
        for c in nodes[i + 1:]:
            if c.op == "RANGE_CAST_FP32_TO_FP16" and c.spans[1] == n.spans[0] and not c.arg("scale"):
                half[id(n)] = c.spans[0]  # by identity: the program's own node objects
                away.add(id(c))
                break
    return half, away


def grad_cast_pairs(nodes, fused) -> tuple[dict, set]:
    """With the fused kernels, the 16-bit -> fp32 cast of the matrix gradients (with the fp16
    unscale) folds into the weight update that reads them: the update reads the 16-bit span
    and unscales in the same pass, and the fp32 matrix gradients are not written. Returns
    {id(update node): (16-bit span, scale scalar name or "")} and the cast nodes made
    redundant."""
    if fused is None:
        return {}, set()
    into, away = {}, set()
    for i, c in enumerate(nodes):
        if c.op != "RANGE_CAST_FP16_TO_FP32":
            continue
        for n in nodes[i + 1:]:
            if n.op.startswith("RANGE_UPDATE_WEIGHT_") and fused.supports(n.op) and n.spans[1] == c.spans[0]:
                into[id(n)] = (c.spans[1], c.arg("scale") or "")
                away.add(id(c))
                break
    return into, away


def bind(ex, n: Node) -> Callable:
    """The closure that runs range node ``n`` on ``ex``'s (a StepExecutor's) arena."""
    op = n.op
    if op == "RANGE_CLEAR":
        buf = _span(ex, n.spans[0], torch.uint8)
        return lambda ctx: ops.clear(buf)
    if op == "RANGE_MEAN_ALLREDUCE":
        if not ex.dist.backend:
            return lambda ctx: None  # one process, no process group: nothing to reduce
        from tr_hydra.runtime.distributed import all_reduce_sum
        views = [_span(ex, s) for s in n.spans]
        def allreduce(ctx):
            for v in views:  # SUM: the loss gradient already carries 1/world_size
                all_reduce_sum(ex.dist, v)
        return allreduce
    if id(n) in ex._fused_away:
        return lambda ctx: None  # written by the weight update's kernel in the same pass
    if op in ("RANGE_CAST_FP16_TO_FP32", "RANGE_CAST_FP32_TO_FP16"):
        dst, src = _span(ex, n.spans[0]), _span(ex, n.spans[1])
        scale = ex.s[n.arg("scale")] if n.arg("scale") else None
        if ex.fused is not None:
            fused = ex.fused
            return lambda ctx: fused.fused_cast(dst, src, scale)
        return lambda ctx: ops.cast(dst, src, scale)
    if op == "RANGE_GRAD_SCALING":
        if n.arg("update"):
            s, inv, tr, fi = ex.s["loss_scale"], ex.s["inv_loss_scale"], ex.s["growth_tracker"], ex.s["found_inf"]
            interval = ex.pc.trainer.loss_scale_growth_interval
            return lambda ctx: ops.update_loss_scale(s, inv, tr, fi, interval)
        buf, scale = _span(ex, n.spans[0]), ex.s[n.arg("scale")]
        return lambda ctx: ops.scale_inplace(buf, scale)
    if op == "RANGE_CHECK_NAN":
        return _check(ex, n)
    if op.startswith("RANGE_UPDATE_"):
        return _update(ex, n)
    if op == "RANGE_EMA_PARAM_UPDATE":
        dst, src = _span(ex, n.spans[0]), _span(ex, n.spans[1])
        decay, step, warm = ex.s["ema_decay"], ex.s["step"], ex.pc.ema_warmup
        gate = ex.s[n.arg("gate")] if n.arg("gate") else None
        if ex.fused is not None:
            fused = ex.fused
            return lambda ctx: fused.fused_ema(dst, src, decay, step, warm, gate)
        return lambda ctx: ops.ema_update(dst, src, ops.ema_decay_at(decay, step, warm), gate)
    if op == "RANGE_D2D_COPY":  # into a plan temporary (``dst``) or a span
        src = _span(ex, n.spans[1], torch.int32)
        dst = _temp(ex, n.arg("dst"), src.numel()) if n.arg("dst") else _span(ex, n.spans[0], torch.int32)
        return lambda ctx: ops.d2d_copy(dst, src)
    if op == "RANGE_RESTORE_IF_SKIPPED":  # integer views: the bytes put back exactly
        dst = _span(ex, n.spans[0], torch.int32)
        src = _temp(ex, n.arg("src"), dst.numel()) if n.arg("src") else _span(ex, n.spans[1], torch.int32)
        flag = ex.s[n.arg("gate")]
        return lambda ctx: ops.restore_if(dst, src, flag)
    if op == "RANGE_NONFINITE_LIMIT":
        flag, count = ex.s[n.arg("flag")], ex.s[n.arg("count")]
        state = ex.arena.view(ex.plan[n.arg("state")]).view(-1)
        limit = ex.fused.nonfinite_limit if ex.fused is not None else ops.nonfinite_limit
        return lambda ctx: limit(flag, count, state)
    if op == "RANGE_ACCUM_METRICS":
        into = n.arg("into")
        res = ex.result
        def accum(ctx):
            ops.accum_metrics(ex.acc[ctx.extra.get("into", into)], res)
        return accum
    if op == "RANGE_BN_FOLD":
        eqb, eqs = ex.arena.span(R.W_EQ_BIAS), ex.arena.span(R.W_EQ_SCALE)
        bb, bw = ex.arena.span(R.W_BN_BIAS), ex.arena.span(R.W_BN_WEIGHT)
        mean, var = ex.arena.span(R.B_PREV_MEAN), ex.arena.span(R.B_PREV_VAR)
        eps = ex._bn_eps
        return lambda ctx: ops.bn_fold(eqb, eqs, bb, bw, mean, var, eps)
    raise NotImplementedError(f"no executor for node {op}")


def _temp(ex, name: str, numel: int) -> torch.Tensor:
    """The first ``numel`` 4-byte words of a plan temporary (``temp.*``), as int32."""
    t = ex.plan[name]
    view = ex.arena.view(t).view(-1).view(torch.int32)
    if view.numel() < numel:
        raise RuntimeError(f"{name} holds {view.numel()} words, the span {numel}")
    return view[:numel]


def _check(ex, n: Node):
    """One sum per region of the span (every gradient region, and the step's loss in
    R_RESULT), and a check of each region of the further spans (the BN statistics the
    forward has just updated): the step's flag, and which regions were non-finite at the
    first bad step."""
    start, end = n.spans[0]
    regions = [Region(i) for i in range(start, end + 1) if ex.plan.region_size[Region(i)]]
    # further spans (the BN statistics): checked element by element in the reference too (a
    # sum of large finite running variances could overflow)
    exact = [Region(i) for a, b in n.spans[1:] for i in range(a, b + 1) if ex.plan.region_size[Region(i)]]
    if ex.fused is not None:
        # gradients the update reads in 16 bits are checked there, not in their unwritten
        # fp32 twins
        for span32, span16 in ex.grads_read_16bit:
            skip = set(range(int(span32[0]), int(span32[1]) + 1))
            regions = [r for r in regions if int(r) not in skip]
            regions += [Region(i) for i in range(int(span16[0]), int(span16[1]) + 1)
                        if ex.plan.region_size[Region(i)]]
    regions += exact
    views = [ex.arena.span(r, r) for r in regions]
    ex.check_regions = regions
    flag, skipped, nonfinite = ex.s["found_inf"], ex.s["skipped"], ex.s["nonfinite"]
    first_step, step = ex.s["nonfinite_step"], ex.s["step"]
    mask = ex.nonfinite_mask[:len(regions)]
    fp16 = bool(n.arg("fp16"))
    count = skipped if fp16 else nonfinite
    if ex.fused is not None:  # one pass per run of adjacent same-dtype regions, one finish
        spans, groups = [], _check_groups(ex, regions)
        for first, group in groups:
            span = ex.arena.span(group[0], group[-1])  # in the regions' own dtype
            base = ex.plan.region_range(group[0], group[0])[0]
            starts = torch.tensor([(ex.plan.region_range(r, r)[0] - base) // span.element_size()
                                   for r in group], dtype=torch.int32, device=ex.device)
            spans.append((span, starts, first))
        flags = ex.arena.view(ex.plan["mask.nonfinite_flags"]).view(-1)[:len(regions)]
        fused = ex.fused
        # plan.share_grad16: the 16-bit gradients are overwritten by the new 16-bit weights
        # later in the step, so their sum of squares (telemetry's gradient norm) is taken
        # here, in the pass that reads them anyway
        sq = None
        shared = [i for i, (_, grp) in enumerate(groups) if all(r in ex.plan.shared for r in grp)]
        if shared and ex.grads_read_16bit:
            both = ex.arena.view(ex.plan["temp.grad16_sumsq"]).view(-1)
            sq = (both[0:1], both[1:2], shared[0])
            ex.grad16_sumsq = both[1:2]
        return lambda ctx: fused.nonfinite_check(spans, flags, mask, flag, count, first_step, step, sq=sq)
    whole = {id(v) for r, v in zip(regions, views) if r in exact}

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

def _check_groups(ex, regions):
    """(index of the first region, regions) for each run of regions adjacent in the arena
    and of one dtype, in order."""
    groups = []
    for i, r in enumerate(regions):
        if groups:
            first, g = groups[-1]
            prev = g[-1]
            end = ex.plan.region_base[prev] + ex.plan.region_size[prev]
            if ex.plan.region_base[r] == end and ex.arena.region_dtype(r) == ex.arena.region_dtype(prev):
                g.append(r)
                continue
        groups.append((i, [r]))
    return groups


def _update(ex, n: Node):
    w, g = _span(ex, n.spans[0]), _span(ex, n.spans[1])
    states = [_span(ex, s) for s in n.spans[2:]]
    extra = {}
    if n.op == "RANGE_UPDATE_WEIGHT_LARS":
        extra = {"segments": ex._segments, "norms": states.pop()}
    wd = ex.s[n.arg("wd")]
    gate = ex.s[n.arg("gate")] if n.arg("gate") else None
    op, h = n.op, ex.h
    if ex.fused is not None and ex.fused.supports(op):
        fused = ex.fused
        if id(n) in ex._half_out:
            extra["half"] = _span(ex, ex._half_out[id(n)])
        if id(n) in ex._grad16_in:
            span16, scale = ex._grad16_in[id(n)]
            g = _span(ex, span16)
            extra["g_scale"] = ex.s[scale] if scale else None
        return lambda ctx: fused.fused_update(op, w, g, states, h, wd, gate, **extra)
    return lambda ctx: apply_update(op, w, g, states, h, wd, gate, **extra)
