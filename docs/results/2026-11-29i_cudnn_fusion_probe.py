"""Probe: cuDNN's fused graph (BN apply + ReLU on the conv's input, conv, batch statistics of its
output) against PyTorch (eager cuDNN conv, and Inductor around the cuDNN conv) for CIFAR
ResNet-18's convolution shapes at batch 512, bf16, on the GPU. Forward only."""
import json, os, sys, time, torch, torch.nn.functional as F
out = {"torch": torch.__version__}
try:
    import cudnn
    out["cudnn_backend"] = cudnn.backend_version_string()
except Exception as e:  # noqa
    print("no cudnn frontend:", repr(e)); out["error"] = repr(e)
    json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "cudnn_fe_probe.json"), "w"), indent=1); sys.exit(0)
print("cudnn backend", out["cudnn_backend"], "torch cudnn", torch.backends.cudnn.version(), flush=True)
torch.backends.cudnn.benchmark = True
dt = torch.float16 if os.environ.get("DT") == "fp16" else torch.bfloat16
IO = cudnn.data_type.HALF if dt == torch.float16 else cudnn.data_type.BFLOAT16
out["dtype"] = str(dt)
handle = cudnn.create_handle()
cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream().cuda_stream)

def timeit(fn, n=50):
    for _ in range(5): fn()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = []
    for _ in range(3):
        e0.record()
        for _ in range(n): fn()
        e1.record(); torch.cuda.synchronize(); best.append(e0.elapsed_time(e1) / n)
    return min(best)

def ref(x, s, b, w):
    y = F.conv2d(torch.relu(x * s + b), w, padding=1)
    return y, y.float().sum((0, 2, 3)), y.float().square().sum((0, 2, 3))
cref = torch.compile(ref, dynamic=False)

def build(x, s, b, w, fused, stats=None):
    stats = fused if stats is None else stats
    g = cudnn.pygraph(io_data_type=IO, intermediate_data_type=cudnn.data_type.FLOAT if os.environ.get("MID") != "half" else IO,
                      compute_data_type=cudnn.data_type.FLOAT, handle=handle)
    X = g.tensor(name="X", dim=x.size(), stride=x.stride(), data_type=x.dtype)
    W = g.tensor(name="W", dim=w.size(), stride=w.stride(), data_type=w.dtype)
    S = B = None
    if fused:
        S = g.tensor(name="S", dim=s.size(), stride=s.stride(), data_type=s.dtype)
        B = g.tensor(name="B", dim=b.size(), stride=b.stride(), data_type=b.dtype)
        inp = g.relu(name="relu", input=g.bias(name="bias", input=g.scale(name="scale", input=X, scale=S), bias=B))
    else:
        inp = X
    Y = g.conv_fprop(image=inp, weight=W, padding=[1, 1], stride=[1, 1], dilation=[1, 1])
    Y.set_output(True).set_data_type(IO)
    outs = {"Y": Y}
    if stats:
        SUM, SQ = g.genstats(name="genstats", input=Y)
        SUM.set_output(True).set_data_type(cudnn.data_type.FLOAT)
        SQ.set_output(True).set_data_type(cudnn.data_type.FLOAT)
        outs.update(SUM=SUM, SQ=SQ)
    g.validate(); g.build_operation_graph()
    g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    g.check_support(); g.build_plans()
    ws = torch.empty(g.get_workspace_size(), device="cuda", dtype=torch.uint8)
    return g, (X, W, S, B), outs, ws

LAYERS = (("layer1", 64, 32), ("layer2", 128, 16), ("layer3", 256, 8), ("layer4", 512, 4))
for name, c, hw in LAYERS[:int(os.environ.get("NL", "4"))]:
    res = {}
    x = torch.randn(512, c, hw, hw, device="cuda", dtype=dt).to(memory_format=torch.channels_last)
    w = (torch.randn(c, c, 3, 3, device="cuda", dtype=dt) * 0.05).to(memory_format=torch.channels_last)
    s = (torch.rand(1, c, 1, 1, device="cuda", dtype=dt) + 0.5).to(memory_format=torch.channels_last)
    b = (torch.randn(1, c, 1, 1, device="cuda", dtype=dt) * 0.1).to(memory_format=torch.channels_last)
    y_ref, s_ref, q_ref = ref(x, s, b, w)
    res["torch_conv_only_ms"] = timeit(lambda: F.conv2d(x, w, padding=1))
    res["torch_eager_chain_ms"] = timeit(lambda: ref(x, s, b, w))
    res["inductor_chain_ms"] = timeit(lambda: cref(x, s, b, w))
    for fused, stats in ((False, False), (True, True), (True, False), (False, True)):
        tag = {(False, False): "cudnn_conv_only", (True, True): "cudnn_fused", (True, False): "cudnn_prologue_only",
               (False, True): "cudnn_genstats_only"}[(fused, stats)]
        try:
            t0 = time.perf_counter()
            g, (X, W, S, B), outs, ws = build(x, s, b, w, fused, stats)
            res[tag + "_build_s"] = time.perf_counter() - t0
            y = torch.empty_like(y_ref); sm = torch.zeros(1, c, 1, 1, device="cuda"); sq = torch.zeros(1, c, 1, 1, device="cuda")
            pack = {X: x, W: w, outs["Y"]: y}
            if fused: pack.update({S: s, B: b})
            if stats: pack.update({outs["SUM"]: sm, outs["SQ"]: sq})
            run = lambda: g.execute(pack, ws, handle=handle)
            res[tag + "_ms"] = timeit(run)
            run(); torch.cuda.synchronize()
            want = y_ref if fused else F.conv2d(x, w, padding=1)
            res[tag + "_y_err"] = ((y.float() - want.float()).abs().max() / want.float().abs().max()).item()
            if stats:
                sr = want.float().sum((0, 2, 3)); qr = want.float().square().sum((0, 2, 3))
                res[tag + "_sum_err"] = ((sm.view(-1) - sr).abs().max() / sr.abs().max()).item()
                res[tag + "_sq_err"] = ((sq.view(-1) - qr).abs().max() / qr.abs().max()).item()
        except Exception as e:  # noqa
            res[tag + "_error"] = repr(e)[:300]
    out[name] = res
    print(name, json.dumps(res), flush=True)
json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "cudnn_fe_probe_%s_%s.json" % (os.environ.get("DT", "bf16"), os.environ.get("MID", "float"))), "w"), indent=1)
