"""DALI decode rate alone: the baseline's reader pipeline against tr_hydra's (external source of paths,
io.file.read, checkpointing, checkpoint() before each batch, padded output). A kind containing
"nommap" reads the files with plain reads (tr_hydra's data.mmap=false, added after session o ran
this script)."""
import json, os, sys, time
from pathlib import Path
import numpy as np
from nvidia.dali import fn, pipeline_def, types
from tr_hydra.bench import make_jpegs
root = make_jpegs(sys.argv[1], int(sys.argv[2]))
train = Path(root) / "train"
files = sorted(str(p) for p in train.rglob("*.jpg"))
B, RES, N = 256, 224, int(sys.argv[3]) if len(sys.argv) > 3 else 60
T = os.cpu_count()
MEAN, STD = [0.485 * 255, 0.456 * 255, 0.406 * 255], [0.229 * 255, 0.224 * 255, 0.225 * 255]

def build(kind):
    ck = "ckpt" in kind
    @pipeline_def(batch_size=B, num_threads=T, device_id=0, seed=1, prefetch_queue_depth=2,
                  **({"enable_checkpointing": True} if ck else {}))
    def pipe():
        if kind.startswith("reader"):
            enc, _ = fn.readers.file(file_root=str(train), random_shuffle=True, name="Reader")
        else:
            enc = fn.io.file.read(fn.external_source(name="images", dtype=types.UINT8, ndim=1), dont_use_mmap="nommap" in kind)
        img = fn.decoders.image_random_crop(enc, device="mixed", output_type=types.RGB,
                                            random_area=[0.08, 1.0], random_aspect_ratio=[0.75, 4 / 3])
        img = fn.resize(img, size=(RES, RES))
        return fn.crop_mirror_normalize(img, crop=(RES, RES), mirror=fn.random.coin_flip(), mean=MEAN, std=STD,
                                        dtype=types.FLOAT16, output_layout="HWC", pad_output="pad" in kind)
    p = pipe(); p.build(); return p

rng = np.random.default_rng(0)
def paths():
    ids = rng.choice(len(files), B, replace=False)
    return [np.frombuffer(files[i].encode(), dtype=np.uint8) for i in ids]

res = {}
for kind in sys.argv[4].split(","):
    p = build(kind)
    ext = not kind.startswith("reader")
    fed = 0
    def feed():
        global fed
        p.feed_input("images", paths()); fed += 1
    if ext:
        feed(); feed()
    p.schedule_run()
    times = []
    for i in range(N):
        if "every" in kind:
            p.checkpoint()
        out = p.outputs()
        out[0].as_tensor()  # device TensorList
        times.append(time.perf_counter())
        if ext:
            feed()
        p.schedule_run()
    w = times[10:]
    res[kind] = (len(w) - 1) * B / (w[-1] - w[0])
    print(kind, f"{res[kind]:,.0f} img/s", flush=True)
    del p
json.dump(res, open(os.environ.get("OUT", ".") + "/dali_micro.json", "w"), indent=1)
