"""DALI file reading alone (no decode), on a 2-core CPU, page cache warm: fn.readers.file against
external_source of paths + fn.io.file.read, each with and without mmap. Batch 256, 2 threads."""
import os, time, sys
import numpy as np
from pathlib import Path
from nvidia.dali import fn, pipeline_def, types
from tr_hydra.bench import make_jpegs
root = make_jpegs("/tmp/exp/jp", 2048)
train = Path(root) / "train"
files = sorted(str(p) for p in train.rglob("*.jpg"))
B = 256
def build(kind):
    @pipeline_def(batch_size=B, num_threads=2, device_id=None, seed=1, prefetch_queue_depth=2)
    def pipe():
        if kind.startswith("reader"):
            enc, _ = fn.readers.file(file_root=str(train), random_shuffle=True, name="Reader", dont_use_mmap=("nommap" in kind))
        else:
            enc = fn.io.file.read(fn.external_source(name="images", dtype=types.UINT8, ndim=1), dont_use_mmap=("nommap" in kind), bytes_per_sample_hint=[(200000 if "hint" in kind else 0)])
        return enc
    p = pipe(); p.build(); return p
rng = np.random.default_rng(0)
def paths():
    ids = rng.choice(len(files), B, replace=False)
    return [np.frombuffer(files[i].encode(), dtype=np.uint8) for i in ids]
for kind in ["reader", "reader_nommap", "ext", "ext_nommap", "reader", "reader_nommap", "ext", "ext_nommap"]:
    p = build(kind); ext = kind.startswith("ext")
    if ext: p.feed_input("images", paths()); p.feed_input("images", paths())
    p.schedule_run(); ts = []
    for i in range(40):
        out = p.outputs(); ts.append(time.perf_counter())
        if ext: p.feed_input("images", paths())
        p.schedule_run()
    w = ts[5:]; print(kind, f"{(len(w)-1)*B/(w[-1]-w[0]):,.0f} files/s"); del p
t=time.perf_counter()
for i in range(200): paths()
print("paths() per batch ms", (time.perf_counter()-t)/200*1e3)
