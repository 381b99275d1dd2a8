"""One compile of ResNet-50's training step (batch 256, 224, bf16, channels_last), fresh Inductor
cache, alone on the host: runtime.compile_gc's two modes through tr_hydra's own context."""
import gc, json, os, sys, tempfile, time
os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="gcprobe_")
os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="gcprobe_triton_")
import torch, torchvision
from tr_hydra.runtime import compile_gc
mode = sys.argv[1]
m = torchvision.models.resnet50().cuda().to(memory_format=torch.channels_last)
x = torch.randn(256, 3, 224, 224, device="cuda").to(memory_format=torch.channels_last)
f = torch.compile(m, dynamic=False)
import resource
t = time.perf_counter()
with compile_gc.during_compiles(mode):
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = f(x)
    y.float().sum().backward()
    torch.cuda.synchronize()
total = time.perf_counter() - t
from torch._dynamo.utils import compilation_time_metrics as cm
out = dict(mode=mode, seconds=round(total, 2), gc=compile_gc.report(),
           aot=round(sum(cm.get("create_aot_dispatcher_function", [0])), 2),
           inductor=round(sum(cm.get("compile_fx_inner", [0])), 2),
           maxrss_mb=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024))
print(json.dumps(out), flush=True)
