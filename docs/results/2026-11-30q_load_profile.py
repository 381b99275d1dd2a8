# A cache-hit load of ResNet-50 (fwd+bwd, torch.compile dynamic=False) on the CPU: run "cold" once, then "warm" or "prof" (cProfile) with the same TORCHINDUCTOR_CACHE_DIR.
import cProfile, pstats, sys, time, os
t0 = time.perf_counter()
import torch, torchvision
t1 = time.perf_counter()
torch.manual_seed(0)
m = torchvision.models.resnet50(num_classes=1000).to(memory_format=torch.channels_last)
f = torch.compile(m, dynamic=False)
x = torch.randn(2, 3, 64, 64).to(memory_format=torch.channels_last)
def go():
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = f(x)
    y.float().sum().backward()
if sys.argv[1] == "prof":
    pr = cProfile.Profile(); pr.enable()
t2 = time.perf_counter(); go(); t3 = time.perf_counter()
if sys.argv[1] == "prof":
    pr.disable(); pr.dump_stats("/tmp/loadprof/load.prof")
print(f"import {t1-t0:.1f}s first call {t3-t2:.1f}s")
from torch._dynamo.utils import counters
print(dict(counters["inductor"]), dict(counters["aot_autograd"]))
