"""PyTorch's best-practice ResNet-50 step under torch.compile(mode="reduce-overhead"), in a process
that never imports tr_hydra: channels_last, bf16 autocast, fused SGD with momentum,
zero_grad(set_to_none=True), cudnn.benchmark, one synthetic batch on the device. Prints one JSON
line: img/s of each repeat and their median. The reference for tr-bench's in-process baseline
(docs/performance.md, "How it is measured").

    python docs/results/stock_reduce_overhead.py [batch] [steps] [repeats]
"""
import json
import statistics
import sys
import time

import torch
import torch.nn.functional as F
import torchvision

batch, steps, repeats = (int(a) for a in (sys.argv[1:] + ["256", "100", "3"][len(sys.argv) - 1:]))
assert "tr_hydra" not in sys.modules
torch.backends.cudnn.benchmark = True
torch.manual_seed(0)
dev = torch.device("cuda")
model = torchvision.models.resnet50(num_classes=1000).to(dev).to(memory_format=torch.channels_last)
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-5, fused=True)
x = torch.randn(batch, 3, 224, 224, device=dev).to(memory_format=torch.channels_last).to(torch.bfloat16)
y = torch.randint(0, 1000, (batch,), device=dev)


def fwd_bwd(x, y):
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = F.cross_entropy(model(x), y)
    loss.backward()


f = torch.compile(fwd_bwd, mode="reduce-overhead")


def step():
    f(x, y)
    opt.step()
    opt.zero_grad(set_to_none=True)


for _ in range(20):
    step()
torch.cuda.synchronize()
rates = []
for _ in range(repeats):
    t = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    rates.append(batch * steps / (time.perf_counter() - t))
print(json.dumps({"torch": torch.__version__, "device": torch.cuda.get_device_name(), "batch": batch,
                  "steps": steps, "img_per_sec": [round(r, 1) for r in rates],
                  "median": round(statistics.median(rates), 1)}))
