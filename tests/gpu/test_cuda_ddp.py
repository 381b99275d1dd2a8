"""dist=ddp on one GPU under torchrun: NCCL all-reduces recorded inside the captured step."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.cuda


def test_ddp_one_gpu_with_graphs(tmp_path):
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", PYTHONPATH=os.pathsep.join(sys.path))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
           "-m", "tr_hydra.cli.train", "dist=ddp", "data=synthetic", "amp=true", "runtime.device=cuda",
           "data.train_size=512", "data.val_size=128", "variants.batch_size=32", "trainer.epochs=2",
           f"hydra.run.dir={tmp_path / 'run'}"]
    out = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "captured" in out.stdout and "CUDA graphs" in out.stdout
    assert (tmp_path / "run" / "model_final.pt").is_file()
