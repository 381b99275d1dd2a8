"""Dynamo's trace alone (backend "eager", dynamic=False) of torchvision's ResNet-50 and of tr_hydra's
arena-bound one, on the CPU. Run from the checkout: PYTHONPATH=. python docs/results/2026-11-30l_trace_cost.py
("before" was the same script at 9ec7d45, where the arena bound gradients as views)."""
import time, torch, torchvision, sys
import torch._dynamo as dynamo
from torch._dynamo.utils import compile_times
def trace(model, x, label):
    dynamo.reset()
    f = torch.compile(model, backend="eager", dynamic=False)
    t = time.perf_counter(); f(x); dt = time.perf_counter() - t
    ct = compile_times(repr="csv", aggregate=True)
    names, vals = ct
    d = dict(zip(names, vals))
    print(f"{label}: {dt:.2f}s  bytecode_tracing {float(d.get('bytecode_tracing',0)):.2f} wrap_to_fake {float(d.get('wrap_to_fake_tensor_and_record',0)):.2f} variable_builder_call {float(d.get('variable_builder_call',0)):.2f}")
x = torch.randn(2, 3, 64, 64)
m = torchvision.models.resnet50()
trace(m, x, "torchvision resnet50, plain")
trace(m, x, "again (warm process)")
# tr_hydra-bound: the trainer's model on CPU
from tests.helpers import small_config
from tr_hydra.runtime.runner import Trainer
pc = small_config(model="resnet50", num_classes=1000, batch=2, val_batch=2, res=64, lowres_res=64, val_res=64, train_size=8, val_size=4)
tr = Trainer(pc, "/tmp/tcost", log=lambda *_: None)
trace(tr.model, x, "tr_hydra's arena-bound resnet50")
trace(tr.model, x, "again")
