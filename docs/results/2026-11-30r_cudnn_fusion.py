"""Does cuDNN's graph API fuse BatchNorm into the convolutions on this GPU, and what would it save?

For each convolution shape of CIFAR ResNet-18 (batch 512) and ResNet-50 (batch 256), in bf16
NHWC, three pieces of a training step are timed two ways:

  forward   unfused: relu(x*scale+bias) written out, cuDNN's convolution, then the batch
            statistics of its output (sum, sum of squares) -- the pointwise and the reduction
            compiled by Inductor, as in the step tr_hydra and torch.compile run today.
            fused: one cuDNN graph, scale -> bias -> relu -> conv_fprop -> genstats.
  wgrad     unfused: the weight gradient from the saved relu output.
            fused: one cuDNN graph, relu(x*scale+bias) recomputed in the wgrad's prologue.
  dgrad     unfused: the data gradient, then relu's backward and BatchNorm's two sums
            (sum of dy, sum of dy*x) compiled by Inductor.
            fused: one cuDNN graph, conv_dgrad -> relu_backward -> two ADD reductions.

Every fused result is checked against the unfused one before it is timed. Each timing is a CUDA
graph of 20 calls, replayed 5 times; the median per call is reported, for the fastest of up to
8 of cuDNN's plans. Output: JSON on stdout's last line, a table above it.

    python3 docs/results/2026-11-30r_cudnn_fusion.py [--quick] [--1x1]
"""
import json
import statistics
import sys

import torch
import torch.nn.functional as F

import cudnn

BF16 = torch.bfloat16
DEV = "cuda"
CIFAR = [  # (N, C, H, W, K, R, stride)
    (512, 64, 32, 32, 64, 3, 1),
    (512, 128, 16, 16, 128, 3, 1),
    (512, 256, 8, 8, 256, 3, 1),
    (512, 512, 4, 4, 512, 3, 1),
]
R50 = [
    (256, 64, 56, 56, 64, 3, 1),
    (256, 128, 28, 28, 128, 3, 1),
    (256, 256, 14, 14, 256, 3, 1),
    (256, 512, 7, 7, 512, 3, 1),
    (256, 256, 56, 56, 64, 1, 1),
    (256, 64, 56, 56, 256, 1, 1),
    (256, 1024, 14, 14, 256, 1, 1),
]


def cl(t):
    return t.contiguous(memory_format=torch.channels_last)


def time_ms(fn, calls=20, reps=5):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    g.replay()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) / calls)
    return statistics.median(out)


HANDLE = None


def handle():
    global HANDLE
    if HANDLE is None:
        HANDLE = cudnn.create_handle()
    return HANDLE


def new_graph():
    return cudnn.pygraph(io_data_type=cudnn.data_type.BFLOAT16,
                         intermediate_data_type=cudnn.data_type.FLOAT,
                         compute_data_type=cudnn.data_type.FLOAT, handle=handle())


def gtensor(g, name, t):
    return g.tensor(name=name, dim=list(t.size()), stride=list(t.stride()), data_type=t.dtype)


def build(g):
    g.validate()
    g.build_operation_graph()
    g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    g.check_support()
    g.build_plans(cudnn.build_plan_policy.ALL)


def runner(g, pack, index):
    ws = torch.empty(max(1, g.get_workspace_size_plan_at_index(index)), device=DEV, dtype=torch.uint8)

    def fn():
        cudnn.set_stream(handle=handle(), stream=torch.cuda.current_stream().cuda_stream)
        g.execute_plan_at_index(pack, ws, index=index, handle=handle())
    return fn


def best_plan(g, pack, check):
    """Time up to 8 built plans; return (ms, index, plan count); `check` runs after the first."""
    n = g.get_execution_plan_count()
    best = None
    checked = False
    for i in range(min(n, 8)):
        try:
            fn = runner(g, pack, i)
            fn()
            torch.cuda.synchronize()
        except Exception:  # a plan that did not build or run
            continue
        if not checked:
            check()
            checked = True
        ms = time_ms(fn)
        if best is None or ms < best[0]:
            best = (ms, i)
    if best is None:
        raise RuntimeError("no plan ran")
    return best[0], best[1], n


def close(a, b, what, rtol=2e-2):
    a, b = a.float(), b.float()
    err = ((a - b).abs().max() / b.abs().max().clamp_min(1e-6)).item()
    if err > rtol:
        raise AssertionError(f"{what}: max error {err:.3g} of the largest value")
    return err


def case(shape):
    N, C, H, W, K, R, s = shape
    pad = R // 2
    Ho, Wo = (H + 2 * pad - R) // s + 1, (W + 2 * pad - R) // s + 1
    torch.manual_seed(0)
    x = cl(torch.randn(N, C, H, W, device=DEV, dtype=BF16))
    w = cl(torch.randn(K, C, R, R, device=DEV, dtype=BF16) / (C * R * R) ** 0.5)
    scale = cl(torch.rand(1, C, 1, 1, device=DEV) + 0.5)
    bias = cl(torch.randn(1, C, 1, 1, device=DEV) * 0.1)
    dy = cl(torch.randn(N, K, Ho, Wo, device=DEV, dtype=BF16))
    res = {"shape": dict(N=N, C=C, H=H, W=W, K=K, R=R, stride=s)}

    # ---- forward
    def fwd_ref(x, scale, bias, w):
        a = torch.relu(x.float() * scale + bias).to(BF16)
        y = F.conv2d(a, w, padding=pad, stride=s)
        yf = y.float()
        return a, y, yf.sum((0, 2, 3)), (yf * yf).sum((0, 2, 3))

    fwd_c = torch.compile(fwd_ref, dynamic=False)
    a_ref, y_ref, s1_ref, s2_ref = fwd_c(x, scale, bias, w)
    res["fwd_unfused_ms"] = time_ms(lambda: fwd_c(x, scale, bias, w))
    res["conv_alone_ms"] = time_ms(lambda: F.conv2d(a_ref, w, padding=pad, stride=s))
    try:
        g = new_graph()
        X, Wt, S, B = gtensor(g, "X", x), gtensor(g, "W", w), gtensor(g, "S", scale), gtensor(g, "B", bias)
        act = g.relu(input=g.bias(input=g.scale(input=X, scale=S), bias=B))
        Y = g.conv_fprop(image=act, weight=Wt, padding=[pad, pad], stride=[s, s], dilation=[1, 1])
        Y.set_output(True).set_data_type(cudnn.data_type.BFLOAT16)
        SUM, SQ = g.genstats(input=Y)
        SUM.set_output(True).set_data_type(cudnn.data_type.FLOAT)
        SQ.set_output(True).set_data_type(cudnn.data_type.FLOAT)
        build(g)
        y_out = torch.empty_like(y_ref)
        s1 = torch.empty(1, K, 1, 1, device=DEV)
        s2 = torch.empty(1, K, 1, 1, device=DEV)
        pack = {X: x, Wt: w, S: scale, B: bias, Y: y_out, SUM: s1, SQ: s2}

        def check():
            res["fwd_err"] = [close(y_out, y_ref, "fprop y"), close(s1.flatten(), s1_ref, "sum"),
                              close(s2.flatten(), s2_ref, "sq sum")]
        res["fwd_fused_ms"], res["fwd_plan"], res["fwd_plans"] = best_plan(g, pack, check)
    except Exception as e:  # not supported here: say why
        res["fwd_fused_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"

    # ---- weight gradient
    def wgrad_ref(a, dy):
        return torch.ops.aten.convolution_backward(dy, a, w, None, [s, s], [pad, pad], [1, 1], False,
                                                   [0, 0], 1, [False, True, False])[1]
    dw_ref = wgrad_ref(a_ref, dy)
    res["wgrad_unfused_ms"] = time_ms(lambda: wgrad_ref(a_ref, dy))
    try:
        g = new_graph()
        X, DY, S, B = gtensor(g, "X", x), gtensor(g, "DY", dy), gtensor(g, "S", scale), gtensor(g, "B", bias)
        act = g.relu(input=g.bias(input=g.scale(input=X, scale=S), bias=B))
        DW = g.conv_wgrad(image=act, loss=DY, padding=[pad, pad], stride=[s, s], dilation=[1, 1])
        DW.set_output(True).set_dim(list(w.size())).set_stride(list(w.stride())).set_data_type(cudnn.data_type.BFLOAT16)
        build(g)
        dw = torch.empty_like(w)
        pack = {X: x, DY: dy, S: scale, B: bias, DW: dw}

        def check():
            res["wgrad_err"] = close(dw, dw_ref, "wgrad")
        res["wgrad_fused_ms"], res["wgrad_plan"], res["wgrad_plans"] = best_plan(g, pack, check)
    except Exception as e:
        res["wgrad_fused_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"

    # ---- data gradient with relu's backward and BatchNorm's two sums
    def dgrad_ref(dy, x, scale, bias):
        da = torch.ops.aten.convolution_backward(dy, a_ref, w, None, [s, s], [pad, pad], [1, 1], False,
                                                 [0, 0], 1, [True, False, False])[0]
        pre = x.float() * scale + bias
        dz = torch.where(pre > 0, da.float(), 0.0)
        return dz.to(BF16), dz.sum((0, 2, 3)), (dz * x.float()).sum((0, 2, 3))
    dgrad_c = torch.compile(dgrad_ref, dynamic=False)
    dz_ref, r1_ref, r2_ref = dgrad_c(dy, x, scale, bias)
    res["dgrad_unfused_ms"] = time_ms(lambda: dgrad_c(dy, x, scale, bias))
    res["dgrad_alone_ms"] = time_ms(lambda: torch.ops.aten.convolution_backward(
        dy, a_ref, w, None, [s, s], [pad, pad], [1, 1], False, [0, 0], 1, [True, False, False]))
    try:
        g = new_graph()
        X, DY, Wt = gtensor(g, "X", x), gtensor(g, "DY", dy), gtensor(g, "W", w)
        S, B = gtensor(g, "S", scale), gtensor(g, "B", bias)
        DA = g.conv_dgrad(loss=DY, filter=Wt, padding=[pad, pad], stride=[s, s], dilation=[1, 1])
        DA.set_dim(list(x.size())).set_stride(list(x.stride()))
        pre = g.bias(input=g.scale(input=X, scale=S), bias=B)
        DZ = g.relu_backward(loss=DA, input=pre)
        DZ.set_output(True).set_data_type(cudnn.data_type.BFLOAT16)
        R1 = g.reduction(input=DZ, mode=cudnn.reduction_mode.ADD)
        R1.set_output(True).set_dim([1, C, 1, 1]).set_data_type(cudnn.data_type.FLOAT)
        R2 = g.reduction(input=g.mul(a=DZ, b=X), mode=cudnn.reduction_mode.ADD)
        R2.set_output(True).set_dim([1, C, 1, 1]).set_data_type(cudnn.data_type.FLOAT)
        build(g)
        dz = torch.empty_like(x)
        r1 = torch.empty(1, C, 1, 1, device=DEV)
        r2 = torch.empty(1, C, 1, 1, device=DEV)
        pack = {X: x, DY: dy, Wt: w, S: scale, B: bias, DZ: dz, R1: r1, R2: r2}

        def check():
            res["dgrad_err"] = [close(dz, dz_ref, "dz"), close(r1.flatten(), r1_ref, "sum dz"),
                                close(r2.flatten(), r2_ref, "sum dz*x")]
        res["dgrad_fused_ms"], res["dgrad_plan"], res["dgrad_plans"] = best_plan(g, pack, check)
    except Exception as e:
        res["dgrad_fused_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
    return res


def main():
    torch.backends.cudnn.benchmark = True
    from torch import _dynamo
    # every shape is a recompile of the two references: without this they fall back to eager
    # after 8 (the first run of this script lost its 1x1 references that way)
    for knob in ("cache_size_limit", "recompile_limit"):
        if hasattr(_dynamo.config, knob):
            setattr(_dynamo.config, knob, 64)
    quick = "--quick" in sys.argv
    print(f"torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}, frontend backend "
          f"{cudnn.backend_version_string()}, {torch.cuda.get_device_name()}", flush=True)
    out = {"torch": torch.__version__, "cudnn": torch.backends.cudnn.version(),
           "frontend_backend": cudnn.backend_version_string(), "cases": []}
    shapes = [("cifar", s) for s in CIFAR] + [("r50", s) for s in R50]
    if quick:
        shapes = shapes[:1]
    if "--1x1" in sys.argv:
        shapes = [(m, sh) for m, sh in shapes if sh[5] == 1]
    hdr = "model shape                 fwd unf  fused   wgrad unf fused   dgrad unf fused   (ms; conv alone, dgrad alone)"
    print(hdr, flush=True)
    for model, shape in shapes:
        r = case(shape)
        r["model"] = model
        out["cases"].append(r)

        def f(k):
            v = r.get(k)
            return f"{v:7.3f}" if isinstance(v, float) else "    n/a"
        print(f"{model:5} {str(shape[:6]):22} {f('fwd_unfused_ms')} {f('fwd_fused_ms')}   {f('wgrad_unfused_ms')} "
              f"{f('wgrad_fused_ms')}   {f('dgrad_unfused_ms')} {f('dgrad_fused_ms')}   ({f('conv_alone_ms')}, {f('dgrad_alone_ms')})",
              flush=True)
        for k in ("fwd_fused_error", "wgrad_fused_error", "dgrad_fused_error"):
            if k in r:
                print(f"      {k}: {r[k]}", flush=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
