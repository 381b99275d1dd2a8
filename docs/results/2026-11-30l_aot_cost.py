"""Dynamo + AOTAutograd (backend aot_eager: no Inductor) on tr_hydra's bound ResNet-50, forward and backward."""
import sys, time, torch
import torch._dynamo as dynamo
from tr_hydra.memory.arena import ArenaKeeper
if sys.argv[1] == "views":  # the previous binding
    ArenaKeeper._standalone = lambda self, v: v
from tests.helpers import small_config
from tr_hydra.runtime.runner import Trainer
pc = small_config(model="resnet50", num_classes=1000, batch=2, val_batch=2, res=64, lowres_res=64, val_res=64, train_size=8, val_size=4)
tr = Trainer(pc, "/tmp/acost", log=lambda *_: None)
for res in (64, 48):
    dynamo.reset()
    f = torch.compile(tr.model, backend="aot_eager", dynamic=False)
    x = torch.randn(2, 3, res, res)
    t = time.perf_counter(); f(x).sum().backward(); print(sys.argv[1], res, round(time.perf_counter() - t, 2), "s")
