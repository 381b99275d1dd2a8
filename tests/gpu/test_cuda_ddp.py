"""dist=ddp under torchrun: NCCL all-reduces recorded inside the captured step."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.cuda


def _torchrun(ranks: int, tmp_path, *args: str, timeout: int = 600):
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", PYTHONPATH=os.pathsep.join(sys.path))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}",
           "-m", "tr_hydra.cli.train", "dist=ddp", "data=synthetic", "amp=true", "runtime.device=cuda",
           "variants.batch_size=32", "trainer.epochs=2", f"hydra.run.dir={tmp_path / 'run'}", *args]
    out = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, env=env, timeout=timeout)
    assert out.returncode == 0, out.stderr[-3000:]
    return out


def test_ddp_one_gpu_with_graphs(tmp_path):
    out = _torchrun(1, tmp_path, "data.train_size=512", "data.val_size=128")
    assert "captured" in out.stdout and "CUDA graphs" in out.stdout
    assert (tmp_path / "run" / "model_final.pt").is_file()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_ddp_two_gpus_with_graphs_agree_and_exit(tmp_path):
    """Two ranks: NCCL inside the captured step, identical weights, and a clean exit (destroying
    the process group while a captured graph holds its communicator used to hang for ever)."""
    out = _torchrun(2, tmp_path, "data.train_size=1024", "data.val_size=128", timeout=900)
    assert "weights identical on all 2 ranks" in out.stdout and "done: " in out.stdout
    assert "all 2 ranks ready" in out.stdout
