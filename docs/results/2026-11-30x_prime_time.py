"""Time cuDNN's search over ResNet-50's training convolutions (batch 256, bf16) in a fresh process."""
import json, sys, time
t0 = time.perf_counter()
import torch
from tr_hydra.models.registry import build_model
from tr_hydra.runtime import cudnn_prime as cp
torch.backends.cudnn.benchmark = True
m = build_model("resnet50", 1000)
calls = cp.unique(cp.record(m, 256, 3, 224, torch.bfloat16, True))
if len(sys.argv) > 3:
    k, n = int(sys.argv[2]), int(sys.argv[3]); calls = calls[k::n]
dev = torch.device("cuda")
torch.zeros(1, device=dev)
t1 = time.perf_counter()
first = cp.prime(calls[:1], dev)
rep = cp.prime(calls, dev)
print(json.dumps({"label": sys.argv[1], "import_and_record_s": round(t1 - t0, 2), "first_conv_s": round(first.seconds, 2),
                  "prime_s": round(rep.seconds, 2), "calls": rep.calls}), flush=True)
