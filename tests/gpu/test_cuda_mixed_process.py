"""CUDA: tr_hydra's captured step and torch.compile(mode="reduce-overhead") in one process.

The CUDA graph trees of reduce-overhead clear cuBLAS's workspaces at each warm-up and recording.
A graph captured with a workspace from outside its pool then writes into freed bytes at every
replay: with tr_hydra's graphs captured first, the process died (an illegal address, or a
segmentation fault in the trees' next replay). The captured graphs now own their workspaces."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.cuda
ROOT = Path(__file__).resolve().parents[2]

_SEQUENCE = """
import torch
from tr_hydra.bench.baselines import pytorch_runner
from tr_hydra.bench.modes import tr_runner
dev = torch.device("cuda")
step8, rt = tr_runner("resnet18_cifar", 512, 32, 10, "inductor", dev, True)
for _ in range(2):
    step8()
step = pytorch_runner("resnet18_cifar", 512, 32, 10, "reduce-overhead", dev, True)
for _ in range(4):
    step()
for _ in range(2):
    step8()
    step()
torch.cuda.synchronize()
print("nonfinite", rt.ex.scalar("nonfinite"))
"""


def test_tr_hydra_then_reduce_overhead_in_one_process():
    """The sequence that crashed: tr_hydra's runner built and stepped, then a reduce-overhead
    step built and stepped, then both again (in a child: a crash must not take pytest down)."""
    r = subprocess.run([sys.executable, "-X", "faulthandler", "-c", textwrap.dedent(_SEQUENCE)],
                       cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, f"exit {r.returncode}:\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}"
    assert "nonfinite 0.0" in r.stdout
