"""Fused range kernels (Triton): one launch per span, every element read and written once.

Each optimizer update reads w, g and its state and writes w and the state in one pass, with the
hyper-parameters read from the device scalars (schedules change them without re-capture) and
the skip gate (a non-finite step) applied in the same pass. They compute what the plain-torch
reference in ``optimizers.py`` computes and are tested against it (on CPU through Triton's
interpreter, on the GPU directly).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024
# (elements per program, warps) of each kernel: the best of a sweep over ResNet-50's spans
# (docs/performance.md)
LAUNCH = {"update": (1024, 8), "lars": (1024, 8), "cast": (2048, 16), "ema": (1024, 8), "nonfinite": (2048, 8)}

# rule codes shared by the kernel and the dispatcher
SGD, MOMENTUM, NESTEROV, ADAM, ADAMW = 0, 1, 2, 3, 4
CODES = {"SGD": SGD, "MOMENTUM": MOMENTUM, "NESTEROV": NESTEROV, "ADAM": ADAM, "ADAMW": ADAMW}


@triton.jit
def _one_minus_pow(c, t):
    """1 - (1 - c)**t as -expm1(t * log1p(-c)), each by its exact-rounding identity from exp and
    log alone (log1p(x) = log(u) * x / (u - 1) with u = 1 + x; expm1(y) = (e - 1) * y / log(e)
    with e = exp(y)): the plain form cancels in fp32 (see optimizers._adam)."""
    u = 1.0 - c
    l1p = tl.where(u == 1.0, -c, tl.log(u) * (-c) / (u - 1.0))
    y = t * l1p
    e = tl.exp(y)
    em1 = tl.where(e == 1.0, y, (e - 1.0) * y / tl.log(e))
    return -em1


@triton.jit
def _update_kernel(w_ptr, g_ptr, m_ptr, v_ptr, n,
                   lr_ptr, mom_ptr, c1_ptr, c2_ptr, eps_ptr, step_ptr, wd_ptr, gate_ptr, a_ptr,
                   RULE: tl.constexpr, HAS_GATE: tl.constexpr, BLOCK: tl.constexpr,
                   HAS_HALF: tl.constexpr = False, gs_ptr=None, HAS_GSCALE: tl.constexpr = False):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    lr = tl.load(lr_ptr)
    wd = tl.load(wd_ptr)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    # fp32 gradients, or the 16-bit ones read directly (RANGE_CAST_FP16_TO_FP32 fused): widened,
    # then unscaled exactly as the cast would (one fp32 multiply)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_GSCALE:
        g = g * tl.load(gs_ptr)
    keep = 1.0
    if HAS_GATE:
        keep = 1.0 - tl.load(gate_ptr)  # 0 on a skipped step
    if RULE == 0:  # SGD
        w_new = w - lr * (g + wd * w)
    elif RULE <= 2:  # MOMENTUM / NESTEROV
        mom = tl.load(mom_ptr)
        m = tl.load(m_ptr + offs, mask=mask, other=0.0)
        d = g + wd * w
        m_new = m * mom + d
        if RULE == 1:
            w_new = w - lr * m_new
        else:
            w_new = w - lr * (d + mom * m_new)
        tl.store(m_ptr + offs, tl.where(keep > 0.5, m_new, m), mask=mask)
    else:  # ADAM / ADAMW
        c1 = tl.load(c1_ptr)  # 1 - beta1 (optimizers.HyperScalars)
        c2 = tl.load(c2_ptr)
        eps = tl.load(eps_ptr)
        t = tl.load(step_ptr)
        m = tl.load(m_ptr + offs, mask=mask, other=0.0)
        v = tl.load(v_ptr + offs, mask=mask, other=0.0)
        if RULE == 4:
            w = w * (1.0 - lr * wd)
        else:
            g = g + wd * w
        m_new = m + c1 * (g - m)
        v_new = v * (1.0 - c2) + c2 * g * g
        bc1 = _one_minus_pow(c1, t)
        bc2 = _one_minus_pow(c2, t)
        denom = tl.sqrt(v_new) / tl.sqrt(bc2) + eps
        w_new = w - (lr / bc1) * (m_new / denom)
        tl.store(m_ptr + offs, tl.where(keep > 0.5, m_new, m), mask=mask)
        tl.store(v_ptr + offs, tl.where(keep > 0.5, v_new, v), mask=mask)
        w = tl.load(w_ptr + offs, mask=mask, other=0.0)  # the unmodified w for a skipped step
    w_out = tl.where(keep > 0.5, w_new, w)
    tl.store(w_ptr + offs, w_out, mask=mask)
    if HAS_HALF:  # the 16-bit compute copy (A) in the same pass: RANGE_CAST_FP32_TO_FP16 fused
        tl.store(a_ptr + offs, w_out.to(a_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _lars_kernel(w_ptr, g_ptr, m_ptr, trust_ptr, block_ids_ptr, n_blocks, lr_ptr, mom_ptr, wd_ptr, gate_ptr,
                 a_ptr, SEG: tl.constexpr, ROWS: tl.constexpr, HAS_GATE: tl.constexpr,
                 HAS_HALF: tl.constexpr = False, gs_ptr=None, HAS_GSCALE: tl.constexpr = False):
    """The LARS update once the per-tensor trust ratios are known. The span is seen as rows of
    SEG elements (slots are whole rows, so a row never straddles two tensors): each row looks
    up its tensor's ratio once through the compile-time block table."""
    pid = tl.program_id(0)
    rows = pid * ROWS + tl.arange(0, ROWS)
    rmask = rows < n_blocks
    seg = tl.load(block_ids_ptr + rows, mask=rmask, other=0)
    trust = tl.load(trust_ptr + seg, mask=rmask, other=1.0)[:, None]
    offs = rows[:, None] * SEG + tl.arange(0, SEG)[None, :]
    mask = rmask[:, None]
    lr = tl.load(lr_ptr)
    mom = tl.load(mom_ptr)
    wd = tl.load(wd_ptr)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_GSCALE:
        g = g * tl.load(gs_ptr)
    m = tl.load(m_ptr + offs, mask=mask, other=0.0)
    m_new = m * mom + (g + wd * w) * trust
    w_new = w - lr * m_new
    keep = 1.0
    if HAS_GATE:
        keep = 1.0 - tl.load(gate_ptr)
    tl.store(m_ptr + offs, tl.where(keep > 0.5, m_new, m), mask=mask)
    w_out = tl.where(keep > 0.5, w_new, w)
    tl.store(w_ptr + offs, w_out, mask=mask)
    if HAS_HALF:
        tl.store(a_ptr + offs, w_out.to(a_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _block_sumsq_kernel(w_ptr, g_ptr, ow_ptr, og_ptr, n_blocks, SEG: tl.constexpr, ROWS: tl.constexpr,
                        gs_ptr=None, HAS_GSCALE: tl.constexpr = False):
    """Sum of squares of every SEG-element block of w and of g, in one read of both."""
    pid = tl.program_id(0)
    rows = pid * ROWS + tl.arange(0, ROWS)
    offs = rows[:, None] * SEG + tl.arange(0, SEG)[None, :]
    m = rows[:, None] < n_blocks
    w = tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=m, other=0.0).to(tl.float32)
    if HAS_GSCALE:
        g = g * tl.load(gs_ptr)
    tl.store(ow_ptr + rows, tl.sum((w * w).to(tl.float64), axis=1), mask=rows < n_blocks)
    tl.store(og_ptr + rows, tl.sum((g * g).to(tl.float64), axis=1), mask=rows < n_blocks)


@triton.jit
def _lars_trust_kernel(sw_ptr, sg_ptr, ends_ptr, trust_ptr, rec_ptr, rec_stride, tc_ptr, wd_ptr, eps_ptr,
                       RB: tl.constexpr):
    """One program per tensor: its norms from the float64 block sums of squares (summed in a
    fixed order, so runs are bit-identical), its trust ratio, and its norm record."""
    i = tl.program_id(0)
    end = tl.load(ends_ptr + i) + 1
    start = tl.load(ends_ptr + i - 1, mask=i > 0, other=-1) + 1
    acc_w = tl.zeros([RB], dtype=tl.float64)
    acc_g = tl.zeros([RB], dtype=tl.float64)
    for k in range(start, end, RB):
        offs = k + tl.arange(0, RB)
        m = offs < end
        acc_w += tl.load(sw_ptr + offs, mask=m, other=0.0)
        acc_g += tl.load(sg_ptr + offs, mask=m, other=0.0)
    w_norm = tl.sqrt(tl.sum(acc_w, axis=0).to(tl.float32))
    g_norm = tl.sqrt(tl.sum(acc_g, axis=0).to(tl.float32))
    wd = tl.load(wd_ptr)
    trust = tl.load(tc_ptr) * w_norm / (g_norm + wd * w_norm + tl.load(eps_ptr))
    trust = tl.where((w_norm > 0) & (g_norm > 0), trust, 1.0)
    tl.store(trust_ptr + i, trust)
    tl.store(rec_ptr + i * rec_stride, w_norm)
    tl.store(rec_ptr + i * rec_stride + 1, g_norm)
    tl.store(rec_ptr + i * rec_stride + 2, trust)


@triton.jit
def _cast_kernel(dst_ptr, src_ptr, scale_ptr, n, HAS_SCALE: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(src_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_SCALE:
        x = x * tl.load(scale_ptr)
    tl.store(dst_ptr + offs, x.to(dst_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _ema_kernel(e_ptr, w_ptr, decay_ptr, step_ptr, gate_ptr, n, WARMUP: tl.constexpr, HAS_GATE: tl.constexpr,
                BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    d = tl.load(decay_ptr)
    if WARMUP:
        t = tl.load(step_ptr)
        d = tl.minimum(d, (1.0 + t) / (10.0 + t))
    e = tl.load(e_ptr + offs, mask=mask, other=0.0)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    wt = 1.0 - d
    if HAS_GATE:  # a skipped step: the live values' weight 0, as in the reference
        wt = wt * (1.0 - tl.load(gate_ptr))
    # torch.lerp's two-sided form, so the result rounds exactly like the reference
    out = tl.where(wt < 0.5, e + wt * (w - e), w - (w - e) * (1.0 - wt))
    tl.store(e_ptr + offs, out, mask=mask)


FLT_MAX = tl.constexpr(3.4028234663852886e38)


@triton.jit
def _nonfinite_kernel(x_ptr, starts_ptr, flags_ptr, n, NREG: tl.constexpr, BLOCK: tl.constexpr,
                      sq_ptr=None, HAS_SQ: tl.constexpr = False):
    """Per-region non-finite flags over a span in one pass: each element's region is the number
    of region starts at or below it; a block that sees a NaN/inf in region i sets flags[i].
    With ``HAS_SQ`` the span's sum of squares is added to ``sq_ptr`` in the same pass (one
    atomic per block: the order of the additions, and so the last bits, vary run to run)."""
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_SQ:
        tl.atomic_add(sq_ptr, tl.sum(x * x, axis=0))
    bad = ((x != x) | (tl.abs(x) > FLT_MAX)) & mask
    if tl.max(bad.to(tl.int32), axis=0) > 0:  # the common clean block stops here
        rid = tl.zeros([BLOCK], dtype=tl.int32)
        for i in tl.static_range(1, NREG):
            rid += (offs >= tl.load(starts_ptr + i)).to(tl.int32)
        for i in tl.static_range(NREG):
            hit = tl.max((bad & (rid == i)).to(tl.int32), axis=0)
            tl.store(flags_ptr + i, hit.to(tl.int8), mask=hit > 0)


@triton.jit
def _nonfinite_finish_kernel(flags_ptr, first_mask_ptr, found_ptr, count_ptr, first_step_ptr, step_ptr,
                             NREG: tl.constexpr, RB: tl.constexpr, sq_ptr=None, sq_out_ptr=None,
                             HAS_SQ: tl.constexpr = False):
    """The step's flag, the fault/skip count, the first bad step's regions and step number;
    then the scratch flags are cleared for the next step (and the sum of squares, once
    copied out)."""
    if HAS_SQ:
        tl.store(sq_out_ptr, tl.load(sq_ptr))
        tl.store(sq_ptr, 0.0)
    r = tl.arange(0, RB)
    m = r < NREG
    f = tl.load(flags_ptr + r, mask=m, other=0).to(tl.int32)
    any_bad = tl.max(f, axis=0)
    found = any_bad.to(tl.float32)
    tl.store(found_ptr, found)
    tl.store(count_ptr, tl.load(count_ptr) + found)
    old = tl.load(first_mask_ptr + r, mask=m, other=0).to(tl.int32)
    first = (tl.sum(old, axis=0) == 0) & (any_bad > 0)
    tl.store(first_mask_ptr + r, tl.where(first, f, old).to(tl.int8), mask=m)
    step = tl.load(step_ptr)
    prev = tl.load(first_step_ptr)
    tl.store(first_step_ptr, tl.where(first, step + 1.0, prev))
    tl.store(flags_ptr + r, tl.zeros([RB], dtype=tl.int8), mask=m)


def nonfinite_check(spans, flags, first_mask, found, count, first_step, step, sq=None) -> None:
    """Drop-in for the reference check. ``spans``: (flat view over consecutive regions of one
    dtype, the element offset of each region in it as int32 on the device, the index of its
    first region's flag), one kernel each; then one kernel combines the flags of all.
    ``sq``: (accumulator, output, index into ``spans``): that span's sum of squares is
    written to the output (fp32, one element), for telemetry of values the step overwrites
    later (``plan.share_grad16``); the accumulator is left at zero."""
    nreg = 0
    for i, (span, starts, first) in enumerate(spans):
        k, n = starts.numel(), span.numel()
        extra = {"sq_ptr": sq[0], "HAS_SQ": True} if sq is not None and sq[2] == i else {}
        _nonfinite_kernel[_grid(n, "nonfinite")](span, starts, flags[first:first + k], n, NREG=k,
                                                 **extra, **_cfg("nonfinite"))
        nreg = max(nreg, first + k)
    extra = {"sq_ptr": sq[0], "sq_out_ptr": sq[1], "HAS_SQ": True} if sq is not None else {}
    _nonfinite_finish_kernel[(1,)](flags, first_mask, found, count, first_step, step,
                                   NREG=nreg, RB=max(16, triton.next_power_of_2(nreg)), **extra)


def _grid(n: int, kind: str = "update"):
    return (triton.cdiv(n, LAUNCH[kind][0]),)


def _cfg(kind: str) -> dict:
    block, warps = LAUNCH[kind]
    return {"BLOCK": block, "num_warps": warps}


def fused_update(op: str, w, g, states, h, wd, gate=None, segments=None, norms=None, half=None,
                 g_scale=None) -> None:
    """Drop-in for ``optimizers.apply_update``: SGD, momentum, Nesterov, Adam, AdamW, LARS. With
    ``half`` (a 16-bit span parallel to ``w``) the updated weights are also written there, in
    the same pass: the update and the following fp32 -> 16-bit cast as one kernel. ``g`` may be
    the 16-bit gradient span itself, times ``g_scale`` (a device scalar) if given: the update
    then also does the preceding 16-bit -> fp32 cast (and unscale) of the gradients."""
    if op.endswith("_LARS"):
        _lars(w, g, states[0], h, wd, gate, segments, norms, half, g_scale)
        return
    rule = CODES[op.rsplit("_", 1)[1]]
    n = w.numel()
    m = states[0] if states else w
    v = states[1] if len(states) > 1 else w
    _update_kernel[_grid(n)](w, g, m, v, n, h.lr, h.momentum, h.beta1_complement,
                             h.beta2_complement, h.eps, h.step, wd,
                             gate if gate is not None else h.lr, half if half is not None else w,
                             RULE=rule, HAS_GATE=gate is not None, HAS_HALF=half is not None,
                             gs_ptr=g_scale if g_scale is not None else h.lr, HAS_GSCALE=g_scale is not None,
                             **_cfg("update"))


def _lars(w, g, m, h, wd, gate, segments, norms, half=None, g_scale=None) -> None:
    from tr_hydra.ops.range_ops import BLOCK as SEG_BLOCK
    # per-tensor norms: one pass over w and g for the per-block sums of squares (fp32 squares
    # summed in float64, as in the reference), then one program per tensor sums its blocks in a
    # fixed order and writes its trust ratio and N-region record; then the update pass
    nb = w.numel() // SEG_BLOCK
    sums = getattr(segments, "_block_sums", None)
    if sums is None or sums.shape[1] != nb:
        sums = torch.empty(2, nb, dtype=torch.float64, device=w.device)  # made once, before capture
        segments._block_sums = sums
    rows = LAUNCH["lars"][0] // SEG_BLOCK
    gs = {"gs_ptr": g_scale if g_scale is not None else h.lr, "HAS_GSCALE": g_scale is not None}
    _block_sumsq_kernel[(triton.cdiv(nb, rows),)](w, g, sums[0], sums[1], nb, SEG=SEG_BLOCK, ROWS=rows,
                                                  num_warps=LAUNCH["lars"][1], **gs)
    trust = getattr(segments, "_trust", None)
    if trust is None:
        trust = torch.empty(segments.count, dtype=torch.float32, device=w.device)
        segments._trust = trust
    rec = norms.view(segments.count, -1)
    _lars_trust_kernel[(segments.count,)](sums[0], sums[1], segments.ends, trust, rec, rec.stride(0),
                                          h.trust_coefficient, wd, h.eps, RB=4096, num_warps=8)
    _lars_kernel[(triton.cdiv(nb, rows),)](w, g, m, trust, segments.block_ids, nb, h.lr, h.momentum, wd,
                                           gate if gate is not None else h.lr, half if half is not None else w,
                                           SEG=SEG_BLOCK, ROWS=rows, HAS_GATE=gate is not None,
                                           HAS_HALF=half is not None, num_warps=LAUNCH["lars"][1], **gs)


def fused_cast(dst, src, scale=None) -> None:
    n = dst.numel()
    _cast_kernel[_grid(n, "cast")](dst, src, scale if scale is not None else dst, n,
                                   HAS_SCALE=scale is not None, **_cfg("cast"))


def fused_ema(ema, live, decay, step, warmup: bool, gate=None) -> None:
    """Drop-in for ``range_ops.ema_update`` (with ``ema_decay_at``), in one pass."""
    n = ema.numel()
    _ema_kernel[_grid(n, "ema")](ema, live, decay, step, gate if gate is not None else decay, n, WARMUP=warmup,
                                 HAS_GATE=gate is not None, **_cfg("ema"))


@triton.jit
def _nonfinite_limit_kernel(flag_ptr, count_ptr, state_ptr):
    flag = tl.load(flag_ptr)
    count = tl.load(count_ptr)
    limit = tl.load(state_ptr)
    reached = tl.load(state_ptr + 1)
    count = count - flag * reached
    flag = tl.maximum(flag, reached)
    tl.store(state_ptr + 2, tl.load(state_ptr + 2) + reached)
    tl.store(state_ptr + 1, tl.maximum(reached, tl.where(count >= limit, 1.0, 0.0) * flag))
    tl.store(count_ptr, count)
    tl.store(flag_ptr, flag)


def nonfinite_limit(flag, count, state) -> None:
    """Drop-in for ``range_ops.nonfinite_limit``: one program instead of seven small kernels."""
    _nonfinite_limit_kernel[(1,)](flag, count, state)


def supports(op: str) -> bool:
    return op.rsplit("_", 1)[1] in CODES or op.endswith("_LARS")
