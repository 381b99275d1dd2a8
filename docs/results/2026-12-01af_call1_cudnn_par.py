"""Fresh process: the first cuDNN search split over k threads (the 'ahead' search), then the
main thread's search; prints one JSON line."""
import json, sys, threading, time, os
import torch, torchvision
from tr_hydra.runtime import cudnn_prime as cp
k = int(sys.argv[1])
torch.backends.cudnn.benchmark = True
dev = torch.device("cuda", 0)
torch.cuda.init(); torch.empty(1, device=dev)
m = torchvision.models.resnet50()
calls = []
t = time.perf_counter()
for b, r, tr in [(256,224,True),(104,224,True),(256,160,True),(104,160,True),(256,224,False),(80,224,False)]:
    calls += cp.record(m, b, 3, r, torch.bfloat16, tr, True)
rec = time.perf_counter() - t
res = {"threads": k, "convs": len(cp.unique(calls)), "record_s": round(rec, 2)}
t = time.perf_counter()
if k > 0:
    out = [None] * k
    def work(i):
        torch.cuda.set_device(0)
        with torch.cuda.stream(torch.cuda.Stream(0)):
            out[i] = cp.prime(cp.share_of(calls, i, k), dev).seconds
    ths = [threading.Thread(target=work, args=(i,)) for i in range(k)]
    for th in ths: th.start()
    for th in ths: th.join()
    torch.cuda.empty_cache()
    res["ahead_s"] = round(time.perf_counter() - t, 2)
    res["ahead_each_s"] = [round(x, 2) for x in out]
s = torch.cuda.Stream(0)
with torch.cuda.stream(s):
    res["main_s"] = round(cp.prime(calls, dev).seconds, 2)
    res["again_s"] = round(cp.prime(calls, dev).seconds, 2)
res["total_s"] = round(time.perf_counter() - t, 2)
print(json.dumps(res), flush=True)
