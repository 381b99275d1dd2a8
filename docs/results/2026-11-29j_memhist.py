"""Record the allocator's history over a tr-bench run; print the live blocks at the peak."""
import os, pickle, runpy, sys
import torch
torch.cuda.memory._record_memory_history(max_entries=3_000_000, stacks="all")
sys.argv = ["tr-bench"] + sys.argv[1:]
try:
    runpy.run_module("tr_hydra.cli.bench", run_name="__main__")
except SystemExit:
    pass
snap = torch.cuda.memory._snapshot()
torch.cuda.memory._record_memory_history(enabled=None)
out = os.environ.get("OUT", "/tmp")
trace = snap["device_traces"][0]
print("events", len(trace), "max_allocated MiB", torch.cuda.max_memory_allocated() / 2**20)
# blocks alive before the trace started (segments' active blocks with no alloc event): ignore
live, cur, peak, peak_i, peak_live = {}, 0, 0, -1, None
for i, e in enumerate(trace):
    a = e["action"]
    if a == "alloc":
        live[e["addr"]] = e
        cur += e["size"]
    elif a in ("free_requested",):
        if e["addr"] in live:
            cur -= live.pop(e["addr"])["size"]
    if cur > peak:
        peak, peak_i = cur, i
        peak_live = None
    if i == peak_i:
        pass
# second pass to materialise the live set at peak_i
live, cur = {}, 0
for i, e in enumerate(trace[:peak_i + 1]):
    if e["action"] == "alloc":
        live[e["addr"]] = e; cur += e["size"]
    elif e["action"] == "free_requested" and e["addr"] in live:
        cur -= live.pop(e["addr"])["size"]
print(f"traced peak {peak / 2**20:.1f} MiB at event {peak_i} of {len(trace)}")
def where(e, n=6):
    fr = [f for f in e.get("frames", []) if "tr_hydra" in f["filename"] or "torch/_inductor" in f["filename"]
          or "torch/_functorch" in f["filename"] or "autograd" in f["filename"]]
    return " < ".join(f"{os.path.basename(f['filename'])}:{f['line']}:{f['name']}" for f in fr[:n])
blocks = sorted(live.values(), key=lambda e: -e["size"])
tot = sum(e["size"] for e in blocks)
print(f"live at peak: {len(blocks)} blocks, {tot / 2**20:.1f} MiB")
# group by stack
groups = {}
for e in blocks:
    k = where(e)
    g = groups.setdefault(k, [0, 0]); g[0] += e["size"]; g[1] += 1
for k, (s, n) in sorted(groups.items(), key=lambda kv: -kv[1][0])[:30]:
    print(f"{s / 2**20:9.2f} MiB {n:5d}  {k[:400]}")
def cpp(e, n=8):
    fr = [f for f in e.get("frames", []) if not f["filename"].endswith(".py") and "??" not in f["name"]]
    keep = [f["name"][:90] for f in fr if any(k in f["name"] for k in ("cudnn", "conv", "Workspace", "workspace", "cublas", "empty", "at::native"))]
    return " < ".join(keep[:n])
print("top blocks at peak:")
for e in blocks[:12]:
    print(f"  {e['size'] / 2**20:8.2f} MiB  {where(e, 3)[:200]} || {cpp(e)[:300]}")
print("last events up to the peak:")
for e in trace[max(0, peak_i - 12):peak_i + 1]:
    print(f"  {e['action']:15s} {e['size'] / 2**20:8.2f} MiB  {where(e, 2)[:120]} || {cpp(e, 4)[:300]}")
