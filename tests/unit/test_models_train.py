"""The torchvision classifiers of ``model=`` train with each optimizer, 16-bit AMP, EMA and BN
folding, and a run stopped and resumed ends bit-identical to one that never stopped."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from tr_hydra.config.specs import OptimizerSpec

from tests.helpers import fit_stop_resume, small_config
# one model of each structure the ResNets lack, each with another optimizer (resnet101, resnet152
# and wide_resnet50_2 are resnet50's blocks, resnext50_32x4d's grouped ones are regnet's kind,
# efficientnet_v2_s is efficientnet_b0's parts: test_models_vs_torch checks their steps); 16-bit
# compute on the two cheapest, since the CPU's bf16 and fp16 kernels are slow
# (tests/gpu/test_cuda_models.py runs every model with AMP)
CASES = [
    ("regnet_y_1_6gf", "lars", None),         # grouped convolutions, squeeze-excitation biases
    ("mobilenet_v2", "momentum", "fp16"),     # depthwise convolutions, ReLU6, dropout
    ("mobilenet_v3_large", "adam", "bf16"),   # hardswish, squeeze-excitation, BN eps 1e-3
    ("efficientnet_b0", "sgd", None),         # SiLU, stochastic depth
    ("densenet121", "adamw", None),           # concatenation
    ("convnext_tiny", "adamw", None),         # LayerNorm, layer scale, linear layers in blocks; no BN
]


@pytest.mark.parametrize("model,name,amp_dtype", CASES)
def test_trains_with_amp_ema_and_folding_and_resumes_exactly(tmp_path, model, name, amp_dtype):
    lr = 1e-3 if name.startswith("adam") else 0.02
    pc = small_config(model=model, optimizer=OptimizerSpec(name=name, lr=lr, schedule="constant"),
                      batch=2, val_batch=2, train_size=6, val_size=2, res=32, lowres_res=32, val_res=32,
                      amp=amp_dtype is not None, amp_dtype=amp_dtype or "bf16", ema=True, bn_folded=model != "convnext_tiny")
    pc = dataclasses.replace(pc, runtime=dataclasses.replace(pc.runtime, deterministic=True))
    full, resumed, at_stop = fit_stop_resume(pc, tmp_path, 2, epochs=1, log_every=1)
    assert at_stop, "no checkpoint at the stop"
    a, b = full.final_state_dict(), resumed.final_state_dict()
    assert set(a) == set(b)
    for key in a:
        assert torch.equal(a[key], b[key]), f"{model}: {key} differs after the resume"
        assert not a[key].is_floating_point() or torch.isfinite(a[key]).all(), f"{model}: {key} not finite"
