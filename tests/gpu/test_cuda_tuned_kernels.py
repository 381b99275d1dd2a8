"""Coordinate descent tunes only kernels over ``tuned_kernels.MIN_ELEMENTS`` on the GPU: the
small ones keep Inductor's config, a variant left untuned keeps every config, and a second
process that loads the compiled step from the cache runs no benchmark at all, even where the
loaded kernels' configs hash otherwise than the list they were tuned from
(``tr_hydra.internals.tuned_kernels``). With the run's steps (``runtime.tuning=auto``), each large
kernel is timed once and tuned only where that pays over them."""
from __future__ import annotations

import pytest

from tests.helpers import run_script_with_caches

pytestmark = pytest.mark.cuda

# one process: a conv net whose activations (64x32x32x32 = 2M elements) are tuned and whose
# per-channel kernels are not, compiled with coordinate descent; a training step
SCRIPT = r"""
import copy, json, sys, torch
from torch import nn
from torch._dynamo.utils import counters
from torch._inductor.runtime import triton_heuristics as th
from tr_hydra.internals import compile_ahead, inductor_compat, tuned_kernels
inductor_compat.apply()
picks = []  # large kernels whose several configs Inductor benchmarked first, saving its pick
if sys.argv[1] in ("rule", "untuned", "drift"):
    tuned_kernels.apply()
    pick = th.CachingAutotuner.autotune_to_one_config
    def counted(self, *args, **kwargs):
        picks.append(tuned_kernels.worth_tuning(self.size_hints))
        return pick(self, *args, **kwargs)
    th.CachingAutotuner.autotune_to_one_config = counted
if sys.argv[1] == "drift":  # the loaded kernels' configs hash otherwise than the tuned list
    hash_configs = th.hash_configs
    th.hash_configs = lambda configs: hash_configs(configs) + "-compiled"
seen = []  # "steps:N": runtime.tuning=auto's rule over N steps, and each kernel's launches as it counted them
if sys.argv[1].startswith("steps:"):
    tuned_kernels.apply()
    count = tuned_kernels.launches
    tuned_kernels.launches = lambda kernel: (seen.append(count(kernel)), seen[-1])[1]
# Triton compiles this process ran itself while coordinate descent tuned (those not found in Triton's cache)
misses, tuning = [], []
from triton.backends.nvidia.compiler import CUDABackend
stages = CUDABackend.add_stages  # called only where triton.compile does not find its result cached
CUDABackend.add_stages = lambda self, *a, **kw: (misses.append(1) if tuning else None, stages(self, *a, **kw))[1]
descent = th.CachingAutotuner.coordinate_descent_tuning
def marked(self, *a, **kw):
    tuning.append(1)
    try:
        return descent(self, *a, **kw)
    finally:
        tuning.pop()
th.CachingAutotuner.coordinate_descent_tuning = marked
# Inductor's compile workers ready, as they are long before a real plan's tuning (a kernel tuned
# while they start is tuned as Inductor tunes it, its candidates compiled by the tuner)
import time
from torch._inductor.async_compile import AsyncCompile
until = time.time() + 120
while not AsyncCompile.use_process_pool() and time.time() < until:
    time.sleep(0.1)
steps = int(sys.argv[1][6:]) if sys.argv[1].startswith("steps:") else None
variant = tuned_kernels.for_variant(sys.argv[1] != "untuned", steps)  # "untuned": a variant runtime.tuning left out
variant.__enter__()
torch.manual_seed(0)
m = nn.Sequential(nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
                  nn.Conv2d(32, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
                  nn.Conv2d(32, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),  # the same kernels again
                  nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10)).cuda().to(memory_format=torch.channels_last)
ref = copy.deepcopy(m)  # PyTorch's eager step in fp32: the rounding scale of the bf16 step
ref_loss = ref(x := torch.randn(64, 16, 32, 32, device="cuda").to(memory_format=torch.channels_last)).square().mean()
ref_loss.backward()
f = torch.compile(m, dynamic=False, options={"coordinate_descent_tuning": True})
with torch.autocast("cuda", torch.bfloat16):
    loss = f(x).float().square().mean()
loss.backward()
torch.cuda.synchronize()
print("RESULT " + json.dumps({"hit": counters["inductor"]["fxgraph_cache_hit"],
                              "benchmarks": counters["inductor"]["coordesc_tuning_bench"],
                              "counts": tuned_kernels.COUNTS, "ahead": compile_ahead.COUNTS, "misses": len(misses), "picks": sum(picks), "launches": seen, "loss": loss.item(),
                              "grad": m[0].weight.grad.float().norm().item(),
                              "ref_loss": ref_loss.item(), "ref_grad": ref[0].weight.grad.norm().item()}))
"""


def _run(cache, mode: str) -> dict:
    return run_script_with_caches(SCRIPT, cache, mode)


def test_small_kernels_keep_their_config_and_a_load_runs_no_benchmark(tmp_path):
    every = _run(tmp_path / "every", "every")  # Inductor's own: every kernel tuned
    first = _run(tmp_path / "rule", "rule")
    assert first["counts"]["tuned"] > 0 and first["counts"]["kept"] > 0
    # large kernels of several configs, whose pick Inductor saves before coordinate descent (2.14
    # marks it as tuned): none of them may pass for a tuned kernel
    assert first["picks"] > 0 and first["counts"]["loaded"] == 0, first
    assert 0 < first["benchmarks"] < every["benchmarks"]
    # each tuned kernel's candidates compiled ahead in Inductor's workers, timed after, and found
    # in Triton's cache by the tuner's own compile; Inductor's tuning alone compiles each itself
    assert first["ahead"]["timed"] > 0 and first["ahead"]["failed"] == 0, first
    assert first["misses"] == 0 and every["misses"] > 0, (first, every)
    assert every["ahead"]["ahead"] == 0
    again = _run(tmp_path / "rule", "rule")  # loads the compile and the tuned configs
    assert again["hit"] >= 2 and again["benchmarks"] == 0 and again["counts"]["tuned"] == 0
    # the loaded configs hash otherwise than the list the tuning saved its result under (as where
    # Inductor drops XBLOCK or adds a half reduction block): Inductor's check leaves the kernels
    # to be tuned again (its run() calls coordinate descent: "loaded" counts those calls);
    # tr_hydra's wrapper launches the configs coordinate descent saved, with no benchmark; Inductor's
    # pick among the configs, saved over those entries on the way, must not replace them for the
    # next process (a second drifted load, then an ordinary one)
    loads = [_run(tmp_path / "rule", mode) for mode in ("drift", "drift", "rule")]
    for r in loads:
        assert r["hit"] >= 2 and r["benchmarks"] == 0 and r["counts"]["tuned"] == 0, r
    assert loads[0]["counts"]["loaded"] > 0
    # runtime.tuning=auto's rule: over one step no kernel pays (each timed once, outside coordinate
    # descent's count); over 10^12 every large kernel does
    short = _run(tmp_path / "short", "steps:1")
    assert short["counts"]["tuned"] == 0 and short["counts"]["unpaid"] == first["counts"]["tuned"], short
    assert short["benchmarks"] == 0
    reload = _run(tmp_path / "short", "steps:1")  # its decisions kept: loaded, none timed again
    assert reload["hit"] >= 2 and reload["counts"]["tuned"] == reload["counts"]["unpaid"] == 0, reload
    assert reload["launches"] == [] and reload["benchmarks"] == 0, reload
    long = _run(tmp_path / "long", "steps:1000000000000")
    assert long["counts"]["tuned"] == first["counts"]["tuned"] and long["counts"]["unpaid"] == 0, long
    assert 0 < long["benchmarks"] < every["benchmarks"]
    # the kernels of the second and third blocks are one kernel each, launched twice a step
    assert len(long["launches"]) == first["counts"]["tuned"] and max(long["launches"]) >= 2, long
    off = _run(tmp_path / "untuned", "untuned")  # a variant left untuned: not one benchmark
    assert off["benchmarks"] == 0 and off["counts"]["tuned"] == 0 and off["counts"]["kept"] > first["counts"]["kept"]
    # the same step, whatever configs the kernels run with: within twice the bf16 step's own
    # distance from PyTorch's fp32 eager step
    for key in ("loss", "grad"):
        scale = abs(every[key] - every[f"ref_{key}"])
        for r in (first, again, *loads, short, reload, long, off):
            assert abs(r[key] - every[key]) <= 2 * scale + 1e-7, (key, r[key], every[key], scale)
