"""CUDA: the warm-up's autotuning (internals.autotune_flush, fixed behaviour with Inductor) keeps the
L2-flush buffer of Inductor's runtime autotuning under the memory high-water mark; Inductor's
own buffer (``fit_under_peak`` taken away) is the reference that raises it."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tr_hydra.internals.autotune_flush import fit_under_peak

pytestmark = pytest.mark.cuda

MiB = 2**20


def test_a_benchmark_flushes_within_the_room_and_the_peak_stays():
    from torch._inductor.runtime.benchmarking import benchmarker
    dev = torch.device("cuda")
    x = torch.zeros(1 << 20, device=dev)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats(dev)
    room = torch.empty(8 * MiB, dtype=torch.uint8, device=dev)
    del room  # 8 MiB under the high-water mark
    peak = torch.cuda.max_memory_allocated(dev)
    with fit_under_peak(dev) as rep:
        benchmarker.benchmark_gpu(lambda: x.add_(1))
        # a candidate whose call copies its argument (as Inductor's does for the ones a kernel
        # overwrites): the 4 MiB copy comes off the room
        benchmarker.benchmark_gpu(lambda: x.clone().add_(1))
    assert rep.supported and rep.benchmarks == 2 and rep.sizes == [8 * MiB, 4 * MiB]
    assert rep.full_bytes > 8 * MiB  # the device's L2
    assert torch.cuda.max_memory_allocated(dev) == peak
    # Inductor's own buffer: the peak goes up by about L2's size
    benchmarker.benchmark_gpu(lambda: x.add_(1))
    assert torch.cuda.max_memory_allocated(dev) >= peak - 8 * MiB + rep.full_bytes
    assert "benchmark_gpu" not in vars(benchmarker)


CHILD = r"""
import contextlib, dataclasses, json, sys
import torch
from tests.helpers import small_config
from tr_hydra.internals import autotune_flush
from tr_hydra.train.trainer import Trainer
mode, run_dir = sys.argv[1], sys.argv[2]
if mode == "full":  # Inductor's own buffer: nothing wrapped
    autotune_flush.fit_under_peak = lambda device: contextlib.nullcontext()
pc = small_config(device="cuda", compile="inductor", amp=True, batch=64, val_batch=64, res=32,
                  lowres_res=32, val_res=32, train_size=64 * 3, val_size=64, max_steps=1)
pc = dataclasses.replace(pc, runtime=dataclasses.replace(pc.runtime, precompile=0))
tr = Trainer(pc, run_dir, log=lambda *_: None)
torch.backends.cudnn.benchmark = False  # no cuDNN search (nor its workspace) in either peak
torch.cuda.reset_peak_memory_stats()
rep = tr.get_ready()
assert rep.cudnn is None
rep = rep.autotune_flush
print(json.dumps({"peak": torch.cuda.max_memory_allocated(),
                  "benchmarks": rep.benchmarks if rep else None, "cut": rep.cut if rep else None,
                  "full": rep.full_bytes if rep else None}))
"""


def _cold_run(mode: str, tmp: Path) -> dict:
    """A fresh process with empty Inductor and Triton caches: every kernel autotunes in the warm-up."""
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp / f"inductor_{mode}"),
               TRITON_CACHE_DIR=str(tmp / f"triton_{mode}"),
               PYTHONPATH=os.pathsep.join([str(Path(__file__).parents[2]), os.environ.get("PYTHONPATH", "")]))
    (tmp / mode).mkdir()
    out = subprocess.run([sys.executable, "-c", CHILD, mode, str(tmp / mode)], env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_trainer_warm_up_autotunes_under_its_peak(tmp_path):
    fit, full = _cold_run("fit", tmp_path), _cold_run("full", tmp_path)
    assert fit["benchmarks"] > 0 and fit["cut"] > 0, fit
    assert full["benchmarks"] is None  # full: Inductor's buffer, nothing wrapped
    # the same trainer and kernels; only the flush differs, and with this small a model the
    # L2-sized buffer is most of what the warm-up adds
    assert fit["peak"] < full["peak"] - fit["full"] // 2, (fit, full)
