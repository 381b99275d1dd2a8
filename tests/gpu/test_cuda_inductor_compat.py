"""Kernels tuned by coordinate descent, loaded from Inductor's cache by another process, are not
tuned again (PyTorch issue 172819; ``tr_hydra.internals.inductor_compat``)."""
from __future__ import annotations

import pytest

from tests.helpers import run_script_with_caches

pytestmark = pytest.mark.cuda

# one process: a small conv net compiled with coordinate descent, a training step; prints what
# Inductor's cache did and how often coordinate descent ran
SCRIPT = r"""
import json, sys, torch
from torch import nn
from torch._dynamo.utils import counters
from torch._inductor.runtime.triton_heuristics import CachingAutotuner
if sys.argv[1] == "fix":
    from tr_hydra.internals import inductor_compat
    inductor_compat.apply()
tunings = [0]
original = CachingAutotuner.coordinate_descent_tuning
def counted(self, *a, **k):
    tunings[0] += 1
    return original(self, *a, **k)
CachingAutotuner.coordinate_descent_tuning = counted
torch.manual_seed(0)
m = nn.Sequential(nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
                  nn.Conv2d(32, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
                  nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10)).cuda().to(memory_format=torch.channels_last)
f = torch.compile(m, dynamic=False, options={"coordinate_descent_tuning": True})
x = torch.randn(64, 16, 32, 32, device="cuda").to(memory_format=torch.channels_last)
with torch.autocast("cuda", torch.bfloat16):
    loss = f(x).float().square().mean()
loss.backward()
torch.cuda.synchronize()
print("RESULT " + json.dumps({"hit": counters["inductor"]["fxgraph_cache_hit"],
                              "miss": counters["inductor"]["fxgraph_cache_miss"], "tunings": tunings[0],
                              "loss": loss.item()}))
"""


def _run(tmp_path, mode: str) -> dict:
    return run_script_with_caches(SCRIPT, tmp_path, mode)


def test_kernels_tuned_in_one_process_load_tuned_in_the_next(tmp_path):
    import inspect
    from torch._inductor.runtime.triton_heuristics import CachingAutotuner
    from tr_hydra.internals.inductor_compat import recheck_is_faulty
    faulty = recheck_is_faulty(inspect.getsource(CachingAutotuner.recheck_autotune_cache))

    first = _run(tmp_path, "fix")  # compiles and tunes: the cache is empty
    assert first["miss"] >= 2 and first["tunings"] > 0
    if faulty:  # this PyTorch's own check: the load tunes every kernel again
        plain = _run(tmp_path, "plain")
        assert plain["hit"] >= 2 and plain["miss"] == 0
        assert plain["tunings"] > 0
    fixed = _run(tmp_path, "fix")
    assert fixed["hit"] >= 2 and fixed["miss"] == 0
    assert fixed["tunings"] == 0
    assert fixed["loss"] == pytest.approx(first["loss"], rel=1e-3)
