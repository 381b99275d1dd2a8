"""Every torchvision classifier of ``model=`` trains with each optimizer, 16-bit AMP, EMA and BN
folding, and a run stopped and resumed ends bit-identical to one that never stopped."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from tr_hydra.config.specs import OptimizerSpec

from tests.helpers import fit_stop_resume, small_config
from tests.unit.test_models_vs_torch import NEW

OPTIMIZERS = ("lars", "adamw", "momentum", "nesterov", "adam", "sgd")
NO_BN = {"convnext_tiny"}


@pytest.mark.parametrize("model", NEW)
def test_trains_with_amp_ema_and_folding_and_resumes_exactly(tmp_path, model):
    k = NEW.index(model)
    name = OPTIMIZERS[k % len(OPTIMIZERS)]
    lr = 1e-3 if name.startswith("adam") else 0.02
    pc = small_config(model=model, optimizer=OptimizerSpec(name=name, lr=lr, schedule="constant"),
                      batch=2, val_batch=2, train_size=6, val_size=2, res=32, lowres_res=32, val_res=32,
                      amp=True, amp_dtype=("bf16", "fp16")[k % 2], ema=True, bn_folded=model not in NO_BN)
    pc = dataclasses.replace(pc, runtime=dataclasses.replace(pc.runtime, deterministic=True))
    full, resumed, at_stop = fit_stop_resume(pc, tmp_path, 2, epochs=1, log_every=1)
    assert at_stop, "no checkpoint at the stop"
    a, b = full.final_state_dict(), resumed.final_state_dict()
    assert set(a) == set(b)
    for key in a:
        assert torch.equal(a[key], b[key]), f"{model}: {key} differs after the resume"
        assert not a[key].is_floating_point() or torch.isfinite(a[key]).all(), f"{model}: {key} not finite"
