# BatchNorm(train)+ReLU forward and backward at CIFAR ResNet-18's shapes (batch 512, bf16, channels_last):
# Inductor's kernels (as in the compiled step) against PyTorch's eager kernels (cuDNN or native NHWC) and
# torch.ops.aten.cudnn_batch_norm, each timed inside a CUDA graph; the kernels each one ran are listed.
import json, os
import torch, torch.nn.functional as F
from torch.profiler import profile, ProfilerActivity

OUT = os.environ.get("OUT", "/tmp")
dev = "cuda"
torch.backends.cudnn.benchmark = True
shapes = [(512, 64, 32, 32), (512, 128, 16, 16), (512, 256, 8, 8), (512, 512, 4, 4)]


def native(y, w, b, rm, rv):
    return torch.relu(F.batch_norm(y, rm, rv, w, b, True, 0.1, 1e-5))


def cudnn(y, w, b, rm, rv):
    out = torch.ops.aten.cudnn_batch_norm(y, w, b, rm, rv, True, 0.1, 1e-5)[0]
    return torch.relu(out)


res = {}
for shp in shapes:
    n, c, h, wd = shp
    y = torch.randn(shp, device=dev).to(torch.bfloat16).to(memory_format=torch.channels_last).requires_grad_()
    w = torch.rand(c, device=dev).add_(0.5).requires_grad_()
    b = (torch.rand(c, device=dev) - 0.5).requires_grad_()
    rm, rv = torch.zeros(c, device=dev), torch.ones(c, device=dev)
    dz = torch.randn(shp, device=dev).to(torch.bfloat16).to(memory_format=torch.channels_last)
    row = {}
    torch._dynamo.reset()
    compiled = torch.compile(native, dynamic=False)
    for name, fn in (("inductor", compiled), ("eager", native)):
        try:
            def step():
                z = fn(y, w, b, rm, rv)
                gy, gw, gb = torch.autograd.grad(z, (y, w, b), dz)
                return z, gy, gw, gb
            s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                for _ in range(3):
                    ref = step()
            torch.cuda.current_stream().wait_stream(s)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                outs = step()
            for _ in range(5):
                g.replay()
            torch.cuda.synchronize()
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            ts = []
            for _ in range(5):
                e0.record()
                for _ in range(50):
                    g.replay()
                e1.record(); torch.cuda.synchronize()
                ts.append(e0.elapsed_time(e1) / 50)
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(10):
                    g.replay()
                torch.cuda.synchronize()
            ks = sorted(((ev.key[:90], round(ev.self_device_time_total / 10 / 1000, 4)) for ev in prof.key_averages()
                         if ev.self_device_time_total > 0), key=lambda r: -r[1])
            row[name] = {"ms": sorted(ts)[2], "kernels": ks[:8]}
            print(shp, name, f"{sorted(ts)[2]:.4f} ms", ks[:4], flush=True)
        except Exception as e:
            row[name] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
            print(shp, name, "failed", row[name]["error"], flush=True)
    res[str(shp)] = row
json.dump(res, open(f"{OUT}/bn_kernels_probe.json", "w"), indent=1)
for k, row in res.items():
    print(k, {n: round(v.get("ms", float("nan")), 4) for n, v in row.items()})
