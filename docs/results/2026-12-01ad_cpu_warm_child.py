"""A parallel compile child, cold then warm, with runtime.precompile_saved and without (CPU).
Run from the repository root."""
import dataclasses, os, sys
sys.path.insert(0, os.getcwd())
os.environ["TORCHINDUCTOR_CACHE_DIR"] = "/tmp/warm_cache"
from tests.helpers import small_config
from tr_hydra.runtime import precompile as pcm
pc = small_config(compile="inductor", train_size=80, val_size=40)
pc = dataclasses.replace(pc, runtime=dataclasses.replace(pc.runtime, precompile=2))
for run, saved in (("cold-saved", True), ("warm-saved", True), ("warm-saved2", True), ("cold-plain", False), ("warm-plain", False), ("warm-plain2", False)):
    if run.startswith("cold"):
        os.system("rm -rf /tmp/warm_cache")
    pre = pcm.Precompiler(pc, [("train_last", True)], workers=1, log=lambda *_: None, saved=saved)
    pre.wait("train_last"); s = pre.summary()["train_last"]; pre.close()
    print(run, "step_s", s["step_s"], "saved_s", s.get("saved_s"), "fx hit/miss", s["fxgraph_cache_hit"], s["fxgraph_cache_miss"], "aot hit/miss", s["autograd_cache_hit"], s["autograd_cache_miss"], flush=True)
