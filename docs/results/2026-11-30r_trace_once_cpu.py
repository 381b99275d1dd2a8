# Trace once, compile per shape (CPU probe, torch 2.14): Dynamo traces ResNet-50 at batch 4; the
# batch-2 step is then compiled from that FX graph with Inductor's compile_fx, without Dynamo.
# Run twice with the same TORCHINDUCTOR_CACHE_DIR; the second run's counters show whether
# AOTAutograd's cache served the batch-2 compile (it bypassed it: see docs/benchmarks.md, session r).
#     TORCHINDUCTOR_CACHE_DIR=/tmp/ic_once python3 docs/results/2026-11-30r_trace_once_cpu.py
import sys, time
import torch, torchvision
from torch._inductor.compile_fx import compile_fx
torch.manual_seed(0)
m = torchvision.models.resnet50(num_classes=1000).to(memory_format=torch.channels_last)
cap = {}
def backend(gm, example_inputs):
    cap["gm"], cap["ex"] = gm, list(example_inputs)
    return compile_fx(gm, example_inputs)
f = torch.compile(m, backend=backend, dynamic=False)
def inp(b):
    torch.manual_seed(b)
    return torch.randn(b, 3, 64, 64).to(memory_format=torch.channels_last)
t = time.perf_counter()
with torch.autocast("cpu", dtype=torch.bfloat16):
    y4 = f(inp(4))
y4.float().sum().backward()
t1 = time.perf_counter() - t
gm, ex = cap["gm"], cap["ex"]
x2 = inp(2)
idx = [i for i, e in enumerate(ex) if tuple(e.shape) == (4, 3, 64, 64)]
t = time.perf_counter()
new = list(ex); new[idx[0]] = x2
with torch.autocast("cpu", dtype=torch.bfloat16):
    c2 = compile_fx(gm, list(new))
    out = c2(*new)
t2 = time.perf_counter() - t
y2 = out[0] if isinstance(out, (list, tuple)) else out
grads_once = None
for p in m.parameters(): p.grad = None
y2.float().sum().backward()
g_once = [p.grad.clone() for p in m.parameters()]
# reference: the same shape through the plain model, eager
for p in m.parameters(): p.grad = None
with torch.autocast("cpu", dtype=torch.bfloat16):
    r = m(x2)
r.float().sum().backward()
g_ref = [p.grad.clone() for p in m.parameters()]
err = max(((a - b).abs().max() / (b.abs().max() + 1e-6)).item() for a, b in zip(g_once, g_ref))
from torch._dynamo.utils import counters
print(f"idx {idx} boxed {getattr(c2, '_boxed_call', False)} first {t1:.1f}s second(trace-once) {t2:.1f}s out {(y2.float()-r.float()).abs().max().item():.3g} grad err {err:.3g}", dict(counters["aot_autograd"]))
