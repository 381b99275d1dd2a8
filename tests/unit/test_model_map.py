"""The model map: each parameter's kind from the module that holds it, and a one-line refusal
naming what the plan cannot place."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torchvision

from tr_hydra.compiler.analysis import map_model
from tr_hydra.errors import ModelMappingError


def _kinds(model: nn.Module) -> dict[str, str]:
    return {p.name: p.kind for p in map_model(model).params}


def test_each_new_kind_of_tensor_has_its_role():
    """Hand-read from torchvision's modules: convnext_tiny's stem conv reads the image, its
    depthwise convs are deep convs with biases, its LayerNorms' affines sit with BatchNorm's, its
    layer scale is a per-channel scale; mobilenet_v3's squeeze-excitation convs carry biases."""
    with torch.device("meta"):
        cn = torchvision.models.convnext_tiny(num_classes=10)
        mb = torchvision.models.mobilenet_v3_large(num_classes=10)
    k = _kinds(cn)
    assert k["features.0.0.weight"] == "FIRST_CONV" and k["features.0.0.bias"] == "FC_BIAS"
    assert k["features.0.1.weight"] == "BN_WEIGHT" and k["features.0.1.bias"] == "BN_BIAS"  # LayerNorm2d
    assert k["features.1.0.block.0.weight"] == "DEEP_CONV"  # 7x7 depthwise
    assert k["features.1.0.block.2.weight"] == "BN_WEIGHT"  # LayerNorm
    assert k["features.1.0.block.3.weight"] == "FC_WEIGHT" and k["features.1.0.block.3.bias"] == "FC_BIAS"
    assert k["features.1.0.layer_scale"] == "BN_WEIGHT"
    k = _kinds(mb)
    assert k["features.4.block.2.fc1.weight"] == "DEEP_CONV" and k["features.4.block.2.fc1.bias"] == "FC_BIAS"
    assert [n for n, v in k.items() if v == "FIRST_CONV"] == ["features.0.0.weight"]


class _Net(nn.Module):
    def __init__(self, extra: nn.Module):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.extra = extra
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        return self.fc(self.extra(self.conv(x)).mean((2, 3)))


class _Matrix(nn.Module):
    def __init__(self):
        super().__init__()
        self.mix = nn.Parameter(torch.ones(8, 8))

    def forward(self, x):
        return torch.einsum("nchw,cd->ndhw", x, self.mix)


@pytest.mark.parametrize("extra,words", [
    (nn.GroupNorm(2, 8), "parameter extra.weight (GroupNorm.weight, shape (8,)) fits no region"),
    (_Matrix(), "parameter extra.mix (_Matrix.mix, shape (8, 8)) fits no region"),
])
def test_what_the_plan_cannot_place_is_refused_in_one_line_naming_it(extra, words):
    with pytest.raises(ModelMappingError) as e:
        map_model(_Net(extra).to("meta"))
    assert str(e.value).startswith(words) and "\n" not in str(e.value)


def test_a_grouped_convolution_over_the_image_is_refused():
    net = _Net(nn.Identity())
    net.conv = nn.Conv2d(3, 9, 3, groups=3)
    net.fc = nn.Linear(9, 4)
    with pytest.raises(ModelMappingError, match="conv.weight .*grouped convolution over the image"):
        map_model(net.to("meta"))
