# Diagnostic run against the search-on-a-thread version (cudnn_prime.BackgroundPrime, not kept;
# see 2026-11-30m_search_on_thread_runner.diff). Run: PYTHONPATH=. python3 <this file>
import time, torch, traceback, tempfile
from tests.helpers import small_config
from tr_hydra.runtime import cudnn_prime as cp
from tr_hydra.runtime.runner import Trainer
torch.backends.cudnn.benchmark = True
ev = []
orig_end = cp.BackgroundPrime._on_compile_end
def on_end(self, *a):
    ev.append(("end_cb", time.perf_counter(), self._thread.is_alive(), a))
    orig_end(self, *a)
    ev.append(("end_cb_joined", time.perf_counter()))
cp.BackgroundPrime._on_compile_end = on_end
orig_prime = cp.prime
def prime(calls, device):
    ev.append(("prime_start", time.perf_counter(), time.time())); r = orig_prime(calls, device); ev.append(("prime_end", time.perf_counter())); return r
cp.prime = prime
from torch._dynamo.callback import callback_handler as h
h.register_start_callback(lambda *a: ev.append(("dyn_start", time.perf_counter(), a)))
batch = 18
pc = small_config(device="cuda", compile="inductor", amp=True, batch=batch, val_batch=batch,
                  train_size=3 * batch + 7, val_size=batch + 1, lowres_epochs=1, max_steps=2)
with tempfile.TemporaryDirectory() as d:
    tr = Trainer(pc, d, log=print)
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="all")
    tr.capture(); torch.cuda.synchronize()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
from torch._inductor.runtime.cache_dir_utils import cache_dir
allocs = [e for trace in snap["device_traces"] for e in trace if e["action"] == "alloc"]
search_at = [i for i, e in enumerate(allocs) if any("generate_and_filter_plans" in f["name"] for f in e.get("frames", ()))]
compiled = [i for i, e in enumerate(allocs) if any(f["filename"].startswith(cache_dir()) for f in e.get("frames", ()))]
print("n allocs", len(allocs), "searches", len(search_at), search_at[:5], search_at[-5:], "compiled", compiled[:5])
print(sorted(allocs[0].keys()))
tu = lambda i: (allocs[i].get("time_us", 0) - allocs[0].get("time_us", 0)) / 1e6
print("t first search", tu(search_at[0]), "last search", tu(search_at[-1]), "first compiled", tu(compiled[0]))
py = [f for f in allocs[compiled[0]]["frames"] if f["filename"].endswith(".py")]
for f in py[:60]:
    print("  ", f["filename"][-60:], f["line"], f["name"][:60])
t0 = ev[0][1]
for e in ev: print(e[0], round(e[1]-t0, 3), e[2:] if len(e) > 2 else "")
