import gc, time, sys, os, tempfile
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp())
import torch, torchvision
mode = sys.argv[1] if len(sys.argv) > 1 else "default"
stats = {0: [0, 0.0], 1: [0, 0.0], 2: [0, 0.0]}
t0 = [0.0]
def cb(phase, info):
    if phase == "start":
        t0[0] = time.perf_counter()
    else:
        s = stats[info["generation"]]
        s[0] += 1; s[1] += time.perf_counter() - t0[0]
gc.callbacks.append(cb)
if mode == "freeze":
    gc.freeze()
    gc.set_threshold(50000, 50, 1000)
elif mode == "freeze_default":
    gc.freeze()
elif mode == "defer":
    gc.set_threshold(700, 10, 1_000_000)
elif mode == "off":
    gc.disable()
print("threshold", gc.get_threshold(), "frozen", gc.get_freeze_count())
m = torchvision.models.resnet50().to(memory_format=torch.channels_last)
x = torch.randn(8, 3, 64, 64).to(memory_format=torch.channels_last)
f = torch.compile(m, dynamic=False)
t = time.perf_counter()
with torch.autocast("cpu", dtype=torch.bfloat16):
    y = f(x)
y.float().sum().backward()
total = time.perf_counter() - t
import resource; print("maxrss %.0f MB" % (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss/1024)); print(mode, "compile+step %.1fs" % total, {g: (n, round(s, 2)) for g, (n, s) in stats.items()},
      "gc total %.2fs" % sum(s for _, s in stats.values()))
