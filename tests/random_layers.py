"""A test-only model with random layers, registered under two names: ``test_random_mini``
(dropout p=0.3 before the fc, stochastic depth p=0.3 on layer1's residual branch) and
``test_random_mini_p0`` (both p=0); and the deterministic configuration the random-layer tests
train it with."""
from __future__ import annotations

import dataclasses

import torch.nn as nn
import torchvision

from tests.helpers import small_config
from tr_hydra.models.registry import ResNetMini, register_model


class RandomMini(ResNetMini):
    """ResNetMini with stochastic depth on layer1's residual branch and dropout before the fc.
    The same parameters, created in the same order: with one seed it starts from ResNetMini's
    weights."""

    def __init__(self, num_classes: int = 10, width: int = 16, p_drop: float = 0.3, p_depth: float = 0.3):
        super().__init__(num_classes, width)
        self.depth = torchvision.ops.StochasticDepth(p_depth, "row")
        self.dropout = nn.Dropout(p_drop)

    def forward(self, x):
        x = self.relu(self.bn1(self.conv1(x)))
        b = self.layer1
        branch = b.bn2(b.conv2(b.relu(b.bn1(b.conv1(x)))))
        x = b.relu(self.depth(branch) + x)  # layer1 keeps its input's shape: no downsample
        x = self.layer2(x)
        return self.fc(self.dropout(self.avgpool(x).flatten(1)))


register_model("test_random_mini")(lambda num_classes, width=16, **_: RandomMini(num_classes, width))
register_model("test_random_mini_p0")(
    lambda num_classes, width=16, **_: RandomMini(num_classes, width, p_drop=0.0, p_depth=0.0))


def random_config(model="test_random_mini", **kw):
    """``small_config`` of ``model`` (96 training images, batches of 32: 3 steps an epoch) with
    ``runtime.deterministic=true``."""
    base = small_config(model=model, train_size=96, batch=32, val_size=32, **kw)
    return dataclasses.replace(base, runtime=dataclasses.replace(base.runtime, deterministic=True))
