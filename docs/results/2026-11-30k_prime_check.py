"""Prime cuDNN for ResNet-50 at batch 32, then count the searches the capture still does (run from the repository root on the GPU machine)."""
import time, torch, sys
sys.path.insert(0, ".")
from tr_hydra.cli._common import compose
from tr_hydra.config.plan_config import plan_config_from
from tr_hydra.runtime.runner import Trainer
from tests.gpu.test_cuda_prime import search_allocations
ov = "model=resnet50 data=synthetic data.num_classes=1000 variants=imagenet variants.train_size=4096 variants.val_size=512 amp=true variants.batch_size=32 variants.val_batch_size=32 runtime.precompile=0".split()
pc = plan_config_from(compose(ov))
print([ (v.name, v.batch, v.res) for v in pc.variants])
tr = Trainer(pc, "/tmp/chk", log=print, telemetry=False)
t = time.perf_counter(); rep = tr.prime_cudnn(); print("prime", rep, time.perf_counter() - t)
t = time.perf_counter(); rep2 = tr.prime_cudnn(); print("prime again (cached)", rep2.seconds)
found = search_allocations(tr.capture)
print("capture s", time.perf_counter() - t, "searches in capture:", len(found))
for s, w in found[:20]: print(s, w)
