# A cache-hit load of a second shape after a first, as the trainer's warm-up does (CPU, torch 2.14):
# ResNet-50, bf16 autocast, torch.compile(dynamic=False), batch 4 then batch 2 at 64x64. Run once to
# fill TORCHINDUCTOR_CACHE_DIR, then again: the second run's "second" is one load, and
# bytecode_tracing is Dynamo's share of both.
#     TORCHINDUCTOR_CACHE_DIR=/tmp/ic_load python3 docs/results/2026-11-30r_second_shape_load_cpu.py
import time
import torch, torchvision
torch.manual_seed(0)
m = torchvision.models.resnet50(num_classes=1000).to(memory_format=torch.channels_last)
f = torch.compile(m, dynamic=False)
def go(b):
    x = torch.randn(b, 3, 64, 64).to(memory_format=torch.channels_last)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = f(x)
    y.float().sum().backward()
ts = []
for b in (4, 2):
    t = time.perf_counter(); go(b); ts.append(time.perf_counter() - t)
from torch._dynamo.utils import counters, compilation_time_metrics as cm
print(f"first {ts[0]:.1f}s second {ts[1]:.1f}s",
      {k: round(sum(v), 1) for k, v in cm.items() if k in ("bytecode_tracing", "create_aot_dispatcher_function", "compile_fx_inner")},
      dict(counters["aot_autograd"]))
