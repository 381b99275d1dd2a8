"""Bandwidth of the fused range kernels over a model's real spans, against a device-to-device copy
measured in the same run (the practical HBM ceiling), and against torch.optim's fused
multi-tensor SGD over the same parameters.

    python -m tr_hydra.ops.kernel_bench --model resnet50

Each kernel's figure is bytes it must move (every operand read once, every result written once)
divided by its median time over CUDA-event-timed repeats.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

# bytes per element each op must move: (reads + writes) in bytes
TRAFFIC = {
    "SGD": 4 + 4 + 4,                  # w, g in; w out
    "MOMENTUM": 4 * 3 + 4 * 2,         # w, g, m in; w, m out
    "NESTEROV": 4 * 3 + 4 * 2,
    "ADAM": 4 * 4 + 4 * 3,             # w, g, m, v in; w, m, v out
    "ADAMW": 4 * 4 + 4 * 3,
    "LARS": 4 * 3 + 4 * 2,             # plus the norm pass (w, g read once more)
    "cast fp32->bf16": 4 + 2,
    "cast bf16->fp32": 2 + 4,
    "MOMENTUM + cast": 4 * 3 + 4 * 2 + 2,  # the update, and the 16-bit copy written in the same pass
    # as in the step under AMP: the 16-bit gradients read directly, the 16-bit copy written
    "MOMENTUM, bf16 grads in, bf16 copy out": 4 + 2 + 4 + 4 * 2 + 2,
    "EMA": 4 * 2 + 4,
    "NaN check": 4,
}


def _time(fn, repeats: int = 30, inner: int = 5) -> float:
    """Median seconds of one call: ``inner`` calls captured in a CUDA graph (as they run inside
    the step, with no host launch cost), the graph replayed between CUDA events; eagerly where
    a call cannot be captured."""
    fn()
    torch.cuda.synchronize()
    run = None
    try:
        g = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(g):
            for _ in range(inner):
                fn()
        run = g.replay
    except Exception:  # noqa: BLE001 - not capturable: time it eagerly
        torch.cuda.synchronize()

        def run():
            for _ in range(inner):
                fn()
    run()
    torch.cuda.synchronize()
    out = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        run()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) / 1000 / inner)
    return statistics.median(out)


def model_sizes(model_name: str, classes: int = 1000) -> list[int]:
    from tr_hydra.models.registry import build_model
    m = build_model(model_name, classes)
    return [p.numel() for p in m.parameters()]


def run(model_name: str = "resnet50", device: str = "cuda") -> dict:
    from tr_hydra.ops import range_ops as ref
    from tr_hydra.ops import triton_ops as tri
    from tr_hydra.ops.optimizers import HyperScalars
    dev = torch.device(device)
    sizes = model_sizes(model_name)
    # the spans as the arena lays them out: every tensor in a slot of whole 64-element blocks
    n = sum(-(-k // ref.BLOCK) * ref.BLOCK for k in sizes)
    res: dict = {"model": model_name, "elements": n, "tensors": len(sizes), "kernels": []}
    # the ceiling: a large device-to-device copy (read + write)
    big = torch.empty(1 << 28, dtype=torch.uint8, device=dev)
    big2 = torch.empty_like(big)
    for _ in range(200):  # let the clocks settle before anything is timed
        big2.copy_(big)
    t = _time(lambda: big2.copy_(big))
    copy_bw = 2 * big.numel() / t
    span_src = torch.empty(n * 4, dtype=torch.uint8, device=dev)
    span_dst = torch.empty_like(span_src)
    t = _time(lambda: span_dst.copy_(span_src))
    res["d2d_copy_GBps"] = copy_bw / 1e9
    res["d2d_copy_span_GBps"] = 2 * span_src.numel() / t / 1e9
    del big, big2, span_src, span_dst

    def s(x):
        return torch.tensor([x], dtype=torch.float32, device=dev)
    h = HyperScalars(lr=s(0.01), momentum=s(0.9), beta1=s(0.9), beta2=s(0.999), eps=s(1e-8), step=s(3.0),
                     trust_coefficient=s(0.001))
    w, g = torch.randn(n, device=dev), torch.randn(n, device=dev) * 1e-3
    m, v = torch.zeros(n, device=dev), torch.zeros(n, device=dev)
    gate, wd = s(0.0), s(5e-5)

    def record(name, seconds, extra=None):
        bw = TRAFFIC[name] * n / seconds
        rec = {"kernel": name, "us": seconds * 1e6, "GBps": bw / 1e9, "fraction_of_copy": bw / copy_bw}
        rec.update(extra or {})
        res["kernels"].append(rec)

    for rule, states in (("SGD", []), ("MOMENTUM", [m]), ("NESTEROV", [m]), ("ADAM", [m, v]), ("ADAMW", [m, v])):
        op = f"RANGE_UPDATE_WEIGHT_{rule}"
        record(rule, _time(lambda: tri.fused_update(op, w, g, states, h, wd, gate)))
    # LARS over the model's tensors: the segment table of 64-element slots
    slot = [-(-k // ref.BLOCK) * ref.BLOCK for k in sizes]
    nl = sum(slot)
    seg = ref.Segments.from_sizes(slot, dev)
    wl, gl, ml = torch.randn(nl, device=dev), torch.randn(nl, device=dev), torch.zeros(nl, device=dev)
    norms = torch.zeros(seg.count * 128, device=dev)
    tl = _time(lambda: tri.fused_update("RANGE_UPDATE_WEIGHT_LARS", wl, gl, [ml], h, wd, gate,
                                        segments=seg, norms=norms))
    record("LARS", tl * n / nl, {"note": "includes the per-tensor norm pass"})
    # its parts: the one-pass block sums of squares of w and g, the float64 segment reduction
    nb = nl // ref.BLOCK
    sums = torch.empty(2, nb, dtype=torch.float64, device=dev)
    rows = tri.LAUNCH["lars"][0] // ref.BLOCK
    t_norm = _time(lambda: tri._block_sumsq_kernel[(-(-nb // rows),)](wl, gl, sums[0], sums[1], nb, SEG=ref.BLOCK,
                                                                      ROWS=rows, num_warps=tri.LAUNCH["lars"][1]))
    trust = torch.empty(seg.count, device=dev)
    t_red = _time(lambda: tri._lars_trust_kernel[(seg.count,)](sums[0], sums[1], seg.ends, trust, norms, 128,
                                                               h.trust_coefficient, wd, h.eps, RB=4096, num_warps=8))
    res["lars_parts_us"] = {"block_sums_of_squares": t_norm * 1e6, "norms_and_trust": t_red * 1e6,
                            "update_pass": tl * 1e6 - t_norm * 1e6 - t_red * 1e6,
                            "block_sums_GBps": 8 * nl / t_norm / 1e9}
    # the bytes LARS moves in all: the update's, plus w and g read once more by the norm pass
    bw_all = (TRAFFIC["LARS"] + 8) * nl / tl
    res["lars_all_passes"] = {"GBps": bw_all / 1e9, "fraction_of_copy": bw_all / copy_bw}
    half = torch.empty(n, dtype=torch.bfloat16, device=dev)
    record("cast fp32->bf16", _time(lambda: tri.fused_cast(half, w)))
    record("MOMENTUM + cast", _time(lambda: tri.fused_update("RANGE_UPDATE_WEIGHT_MOMENTUM", w, g, [m], h, wd,
                                                             gate, half=half)))
    g16 = g.to(torch.bfloat16)
    record("MOMENTUM, bf16 grads in, bf16 copy out", _time(lambda: tri.fused_update(
        "RANGE_UPDATE_WEIGHT_MOMENTUM", w, g16, [m], h, wd, gate, half=half)))
    del g16
    record("cast bf16->fp32", _time(lambda: tri.fused_cast(g, half)))
    e = w.clone()
    decay = s(0.9999)
    record("EMA", _time(lambda: tri.fused_ema(e, w, decay, h.step, True)))
    starts = torch.tensor([0, n // 3, n // 2], dtype=torch.int32, device=dev)
    flags, mask = torch.zeros(3, dtype=torch.int8, device=dev), torch.zeros(3, dtype=torch.int8, device=dev)
    found, count, first = s(0.0), s(0.0), s(0.0)
    record("NaN check", _time(lambda: tri.nonfinite_check([(g, starts, 0)], flags, mask, found, count, first, h.step)))
    # launch configurations: elements per program and warps, for each kernel
    kinds = {
        "update": (TRAFFIC["MOMENTUM"], lambda blk, nw: tri._update_kernel[(-(-n // blk),)](
            w, g, m, v, n, h.lr, h.momentum, h.beta1, h.beta2, h.eps, h.step, wd, gate, w,
            RULE=tri.MOMENTUM, HAS_GATE=True, BLOCK=blk, num_warps=nw)),
        "cast": (TRAFFIC["cast fp32->bf16"], lambda blk, nw: tri._cast_kernel[(-(-n // blk),)](
            half, w, w, n, HAS_SCALE=False, BLOCK=blk, num_warps=nw)),
        "ema": (TRAFFIC["EMA"], lambda blk, nw: tri._ema_kernel[(-(-n // blk),)](
            e, w, h.momentum, h.step, n, WARMUP=True, BLOCK=blk, num_warps=nw)),
        "nonfinite": (TRAFFIC["NaN check"], lambda blk, nw: tri._nonfinite_kernel[(-(-n // blk),)](
            g, starts, flags, n, NREG=3, BLOCK=blk, num_warps=nw)),
        # LARS's update pass (the trust ratios already known): rows of 64 elements per program
        "lars": (TRAFFIC["LARS"] * nl / n, lambda blk, nw: tri._lars_kernel[(-(-nb // (blk // ref.BLOCK)),)](
            wl, gl, ml, trust, seg.block_ids, nb, h.lr, h.momentum, wd, gate, wl, SEG=ref.BLOCK,
            ROWS=blk // ref.BLOCK, HAS_GATE=True, num_warps=nw)),
    }
    sweep = []
    for kind, (traffic, launch) in kinds.items():
        for blk in (1024, 2048, 4096, 8192):
            for nw in (4, 8, 16):
                t = _time(lambda: launch(blk, nw), repeats=10)
                sweep.append({"kernel": kind, "block": blk, "num_warps": nw, "us": t * 1e6,
                              "fraction_of_copy": traffic * n / t / copy_bw})
    del wl, gl, ml
    res["launch_sweep"] = sweep
    res["launch_in_use"] = dict(tri.LAUNCH)
    # reference: torch.optim's fused SGD (multi-tensor apply) over the model's own tensors
    params = [torch.randn(k, device=dev) for k in sizes]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    opt = torch.optim.SGD(params, lr=0.01, momentum=0.9, weight_decay=5e-5, fused=True)
    opt.step()
    t_opt = _time(opt.step)
    bw = TRAFFIC["MOMENTUM"] * n / t_opt
    res["torch_fused_sgd_momentum"] = {"us": t_opt * 1e6, "GBps": bw / 1e9, "fraction_of_copy": bw / copy_bw}
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="resnet50")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("kernel_bench: needs a CUDA device", file=sys.stderr)
        return 2
    r = run(a.model)
    print(f"{a.model}: {r['elements']:,} elements in {r['tensors']} tensors; device-to-device copy "
          f"{r['d2d_copy_GBps']:,.0f} GB/s ({r['d2d_copy_span_GBps']:,.0f} GB/s at the span's size)")
    for k in r["kernels"]:
        print(f"  {k['kernel']:<38} {k['us']:8.1f} us  {k['GBps']:7,.0f} GB/s  {100 * k['fraction_of_copy']:5.1f}% of copy")
    if "lars_parts_us" in r:
        lp = r["lars_parts_us"]
        print(f"  LARS parts: block sums of squares {lp['block_sums_of_squares']:.1f} us "
              f"({lp['block_sums_GBps']:,.0f} GB/s), norms and trust ratios {lp['norms_and_trust']:.1f} us, "
              f"update pass {lp['update_pass']:.1f} us")
        la = r["lars_all_passes"]
        print(f"  LARS counting every byte of both passes: {la['GBps']:,.0f} GB/s, "
              f"{100 * la['fraction_of_copy']:.1f}% of copy")
    t = r["torch_fused_sgd_momentum"]
    print(f"  {'torch fused SGD':<16} {t['us']:8.1f} us  {t['GBps']:7,.0f} GB/s  {100 * t['fraction_of_copy']:5.1f}% of copy"
          f"  (momentum, {r['tensors']} tensors)")
    best: dict = {}
    for c in r["launch_sweep"]:
        if c["kernel"] not in best or c["us"] < best[c["kernel"]]["us"]:
            best[c["kernel"]] = c
    for kind, c in best.items():
        print(f"  best launch for {kind:<10} BLOCK={c['block']:<5} warps={c['num_warps']:<2} {c['us']:7.1f} us  "
              f"{100 * c['fraction_of_copy']:5.1f}% of copy  (in use: {r['launch_in_use'][kind]})")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(r, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
