"""CUDA: every torchvision classifier of ``model=`` trains in the captured step with 16-bit AMP
(bf16 and fp16 in turn), EMA and BN folding, allocates nothing after the capture, and a run
stopped and resumed with graphs ends bit-identical to one that never stopped."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from tr_hydra.config.epochs import epoch_schedule
from tr_hydra.config.specs import OptimizerSpec

from tests.helpers import fit_stop_resume, small_config
from tests.unit.test_models_vs_torch import NEW

pytestmark = pytest.mark.cuda
OPTIMIZERS = ("lars", "adamw", "momentum", "nesterov", "adam", "sgd")


@pytest.fixture
def deterministic():
    yield
    torch.use_deterministic_algorithms(False)


@pytest.mark.parametrize("model", NEW)
@pytest.mark.parametrize("compile", ["none", "inductor"])
def test_each_model_trains_captured_and_resumes_exactly(tmp_path, deterministic, model, compile):
    k = NEW.index(model)
    name = OPTIMIZERS[k % len(OPTIMIZERS)]
    pc = small_config(model=model, device="cuda", compile=compile,
                      optimizer=OptimizerSpec(name=name, lr=1e-3 if name.startswith("adam") else 0.02,
                                              schedule="constant"),
                      batch=16, val_batch=16, train_size=48, val_size=16, res=64, lowres_res=64, val_res=64,
                      amp=True, amp_dtype=("bf16", "fp16")[k % 2], ema=True, bn_folded=model != "convnext_tiny")
    pc = dataclasses.replace(pc, runtime=dataclasses.replace(pc.runtime, deterministic=True))
    full, resumed, _ = fit_stop_resume(pc, tmp_path, 4, epochs=2, log_every=1)
    assert full.graphs is not None
    a, b = full.final_state_dict(), resumed.final_state_dict()
    for key in a:
        assert torch.equal(a[key], b[key]), f"{model}: {key} differs after the resume"
    steps = epoch_schedule(pc, 0)
    torch.cuda.synchronize()
    s0 = torch.cuda.memory_stats()
    full.run_steps(steps, "train")
    full.validator.validate()
    torch.cuda.synchronize()
    s1 = torch.cuda.memory_stats()
    assert s1["allocation.all.allocated"] == s0["allocation.all.allocated"], f"{model}: allocated after the capture"
