"""Dynamo + AOTAutograd (backend aot_eager) on tr_hydra's bound ResNet-50 on the CPU: with the batch marked dynamic (argv[1] = dyn) one compile serves batches 4, 6 and 3; static compiles each."""
import sys, time, torch
import torch._dynamo as dynamo
from torch._dynamo.testing import CompileCounterWithBackend
from tests.helpers import small_config
from tr_hydra.runtime.runner import Trainer
pc = small_config(model="resnet50", num_classes=1000, batch=2, val_batch=2, res=64, lowres_res=64, val_res=64, train_size=8, val_size=4)
tr = Trainer(pc, "/tmp/acost", log=lambda *_: None)
mode = sys.argv[1]
cnt = CompileCounterWithBackend("aot_eager")
f = torch.compile(tr.model, backend=cnt, dynamic=False)
for b in (4, 6, 3, 4):
    x = torch.randn(b, 3, 64, 64).contiguous(memory_format=torch.channels_last)
    if mode == "dyn":
        dynamo.mark_dynamic(x, 0)
    t = time.perf_counter(); f(x).sum().backward(); print(mode, b, round(time.perf_counter() - t, 2), "s, compiles", cnt.frame_count)
