"""Time the stem convolution: PyTorch's conv over 3 channels (and over the image padded to 4 or 8
channels), the same with the padding done in the step (``runtime.stem_channels=8``), and for a
stride-2 stem the space-to-depth form (``tr_hydra.models.stem``), its 12 folded channels as they
are and padded to 16 (``runtime.stem_channels=16``); forward plus weight gradient (the image
needs no gradient), eager and compiled, and the folded convolution's forward and weight gradient
alone.

On CUDA each form starts from the 16-bit image as the step gets it (fp16, DALI's output) and
casts it to bf16 as autocast does in the step, so the zero channels ride in that copy as they do
in the trainer; each call is timed inside a CUDA graph, as it runs in the captured step, so a
compiled function's host work (guards, autograd) is not counted. ``"timed_in_graph"`` says, per
case, which timings could not be captured and were timed as eager calls instead.

    python3 -m tr_hydra.models.stem_bench [--out stem.json] [--device cuda|cpu] [--quick] [--cases r50_b256,cifar_b512]

Each case also checks that every form's output equals the plain conv's (fp32 reference).
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch
import torch.nn.functional as F

from tr_hydra.models.stem import extra_channels, fold_input, fold_weight, pad_channels

# (name, batch, resolution, kernel, stride, padding)
CASES = [("r50_b32", 32, 224, 7, 2, 3), ("r50_b256", 256, 224, 7, 2, 3), ("r50_b256_160", 256, 160, 7, 2, 3),
         ("r50_b104", 104, 224, 7, 2, 3), ("cifar_b512", 512, 32, 3, 1, 1)]
QUICK = [("tiny", 4, 32, 7, 2, 3), ("tiny_s1", 4, 16, 3, 1, 1)]


def _timer(device: torch.device, n: int, uncaptured: list | None = None):
    def bench(fn) -> float:
        for _ in range(3):
            fn()
        if device.type == "cuda":
            ms = _graph_ms(fn, n)
            if ms is not None:
                return ms
            if uncaptured is not None:
                uncaptured.append(True)
            torch.cuda.synchronize(device)
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            for _ in range(n):
                fn()
            e.record()
            torch.cuda.synchronize(device)
            return s.elapsed_time(e) / n
        t = time.perf_counter()
        for _ in range(n):
            fn()
        return (time.perf_counter() - t) * 1e3 / n
    return bench


def _graph_ms(fn, n: int) -> float | None:
    """Milliseconds per call of ``fn``, ``n`` calls captured in one CUDA graph and replayed
    between CUDA events (median of 5 replays); None if ``fn`` cannot be captured."""
    import statistics
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # the warm-up a capture wants, on a side stream
            fn()
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(n):
                fn()
    except Exception:  # noqa: BLE001 - not capturable: the caller times it eagerly
        torch.cuda.synchronize()
        return None
    g.replay()
    torch.cuda.synchronize()
    out = []
    for _ in range(5):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        g.replay()
        e.record()
        e.synchronize()
        out.append(s.elapsed_time(e) / n)
    del g
    return statistics.median(out)


def run(device: torch.device, cases, n: int = 40, compiled: bool = True) -> dict:
    torch.backends.cudnn.benchmark = True
    dt = torch.bfloat16 if device.type == "cuda" else torch.float32
    fmt = torch.channels_last if device.type == "cuda" else torch.contiguous_format
    src = torch.float16 if device.type == "cuda" else dt  # the input buffer's dtype under bf16 autocast
    out: dict = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                 "torch": torch.__version__, "cases": {}}
    for name, b, r, k, s, p in cases:
        res: dict = {}
        uncaptured: dict[str, list] = {}

        def bench(fn, key):
            miss = uncaptured.setdefault(key, [])
            ms = _timer(device, n, miss)(fn)
            if not miss:
                del uncaptured[key]
            return ms
        for c in (3, 4, 8):  # the image padded with zero channels
            x = torch.randn(b, c, r, r, device=device, dtype=dt).contiguous(memory_format=fmt)
            w = torch.randn(64, c, k, k, device=device, dtype=dt).contiguous(memory_format=fmt)
            go = torch.randn_like(F.conv2d(x, w, None, s, p))
            res[f"conv_c{c}_fwd_ms"] = bench(lambda: F.conv2d(x, w, None, s, p), f"conv_c{c}_fwd_ms")
            res[f"conv_c{c}_wgrad_ms"] = bench(lambda: torch.ops.aten.convolution_backward(
                go, x, w, None, [s, s], [p, p], [1, 1], False, [0, 0], 1, [False, True, False]), f"conv_c{c}_wgrad_ms")
        x = torch.randn(b, 3, r, r, device=device, dtype=src).contiguous(memory_format=fmt)
        w32 = torch.randn(64, 3, k, k, device=device) * 0.1
        w = w32.to(dt).contiguous(memory_format=fmt).requires_grad_()

        def plain(x, w):  # the image cast to the compute dtype, as autocast does in the step
            return F.conv2d(x.to(dt), w, None, s, p)

        def padded(c):  # runtime.stem_channels=c: the image and kernel padded with zero channels
            e = extra_channels(3, c)
            return lambda x, w: F.conv2d(pad_channels(x.to(dt), e).contiguous(memory_format=fmt),
                                         pad_channels(w, e).contiguous(memory_format=fmt), None, s, p)

        def folded(c):  # the space-to-depth form, its 12 channels padded to a multiple of c
            e = extra_channels(12, c)
            return lambda x, w: F.conv2d(pad_channels(fold_input(x.to(dt), k, p), e).contiguous(memory_format=fmt),
                                         pad_channels(fold_weight(w, p), e).contiguous(memory_format=fmt),
                                         None, 1, 0)
        forms = {"plain": plain, "plain_c8": padded(8)}
        if s == 2:
            forms |= {"s2d": folded(None), "s2d_c16": folded(16)}
        ref = F.conv2d(x.float(), w32, None, s, p)
        for tag, f in forms.items():
            res[f"max_abs_err_{tag}"] = (f(x, w).float() - ref).abs().max().item()
        go = torch.randn_like(ref, dtype=dt)
        for tag, f in forms.items():
            key = f"{tag}_eager_fwd_wgrad_ms"
            res[key] = bench(lambda: torch.autograd.grad(f(x, w), w, go), key)
            if compiled:
                cf = torch.compile(f, dynamic=False)
                key = f"{tag}_compiled_fwd_wgrad_ms"
                res[key] = bench(lambda: torch.autograd.grad(cf(x, w), w, go), key)
        if s == 2:
            for tag, c in (("s2d", None), ("s2d_c16", 16)):  # the convolution alone, on its folded operands
                e = extra_channels(12, c)
                xs = pad_channels(fold_input(x.to(dt), k, p), e).contiguous(memory_format=fmt)
                ws = pad_channels(fold_weight(w.detach(), p), e).contiguous(memory_format=fmt).requires_grad_()
                key = f"{tag}_conv_only_fwd_wgrad_ms"
                res[key] = bench(lambda: torch.autograd.grad(F.conv2d(xs, ws, None, 1, 0), ws, go), key)
                key = f"{tag}_conv_only_fwd_ms"
                res[key] = bench(lambda: F.conv2d(xs, ws, None, 1, 0), key)
                key = f"{tag}_conv_only_wgrad_ms"
                res[key] = bench(lambda: torch.ops.aten.convolution_backward(
                    go, xs, ws, None, [1, 1], [0, 0], [1, 1], False, [0, 0], 1, [False, True, False]), key)
            res["s2d_fold_input_ms"] = bench(lambda: fold_input(x.to(dt), k, p).contiguous(memory_format=fmt),
                                             "s2d_fold_input_ms")
        out["cases"][name] = res
        if device.type == "cuda":
            out.setdefault("timed_in_graph", {})[name] = {"all": not uncaptured, "not": sorted(uncaptured)}
        print(name, " ".join(f"{key}={v:.4f}" for key, v in res.items()), flush=True)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m tr_hydra.models.stem_bench", description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="stem_bench.json")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true", help="tiny cases, eager only (a check of the logic)")
    ap.add_argument("--cases", default=None,
                    help="comma-separated case names (default: all): " + ",".join(c[0] for c in CASES))
    a = ap.parse_args(argv)
    cases = QUICK if a.quick else CASES
    if a.cases:
        known = {c[0]: c for c in cases}
        wanted = [n for n in a.cases.split(",") if n]
        unknown = [n for n in wanted if n not in known]
        if unknown:
            print(f"stem_bench: error: unknown case {', '.join(unknown)}; known: {', '.join(known)}", file=sys.stderr)
            return 2
        cases = [known[n] for n in wanted]
    device = torch.device(a.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("stem_bench: error: --device cuda, but CUDA is not available", file=sys.stderr)
        return 2
    out = run(device, cases, n=3 if a.quick else 40, compiled=not a.quick)
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"results in {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
