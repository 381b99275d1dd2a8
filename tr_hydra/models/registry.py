"""Model registry: lookup by name, never by importing user-given callables."""
from __future__ import annotations

import contextlib
from typing import Callable

import torch
import torch.nn as nn

from tr_hydra.errors import ConfigError

_MODELS: dict[str, Callable[..., nn.Module]] = {}


def register_model(name: str):
    def deco(fn):
        _MODELS[name] = fn
        return fn
    return deco


def model_builder(name: str) -> Callable[..., nn.Module] | None:
    """The function registered under ``name``, or None."""
    return _MODELS.get(name)


def model_names() -> list[str]:
    return sorted(_MODELS)


def build_model(name: str, num_classes: int, *, zero_init_residual: bool = False, width: int = 16,
                device: str | torch.device | None = None) -> nn.Module:
    """The model ``name`` with its parameters on ``device`` (None: the default device in force).
    On the meta device a builder that reads numbers while it builds (RegNet rounds its widths
    from tensors) is built on the CPU and moved."""
    try:
        fn = _MODELS[name]
    except KeyError:
        raise ConfigError(f"model={name} is unknown; choose one of {', '.join(model_names())}") from None
    if zero_init_residual and name not in RESIDUAL_INIT:
        raise ConfigError(f"model.zero_init_residual applies to the ResNets ({', '.join(sorted(RESIDUAL_INIT))}), "
                          f"not model={name}")
    kwargs = dict(num_classes=num_classes, zero_init_residual=zero_init_residual, width=width)
    try:
        with contextlib.nullcontext() if device is None else torch.device(device):
            return fn(**kwargs)
    except NotImplementedError:
        if device is None or torch.device(device).type != "meta":
            raise
        with torch.device("cpu"):
            return fn(**kwargs).to("meta")


# torchvision's convolutional classifiers, under torchvision's names; those of RESIDUAL_INIT
# take zero_init_residual (each block's last BatchNorm starts at zero)
TORCHVISION = ("resnet18", "resnet34", "resnet50", "resnet101", "resnet152", "resnext50_32x4d",
               "wide_resnet50_2", "regnet_y_1_6gf", "mobilenet_v2", "mobilenet_v3_large",
               "efficientnet_b0", "efficientnet_v2_s", "densenet121", "convnext_tiny")
RESIDUAL_INIT = frozenset(TORCHVISION[:7] + ("resnet18_cifar",))


def _torchvision(name: str) -> Callable[..., nn.Module]:
    def build(num_classes: int, zero_init_residual: bool = False, **_) -> nn.Module:
        import torchvision  # it imports Dynamo: only for the runs that build one
        extra = {"zero_init_residual": zero_init_residual} if name in RESIDUAL_INIT else {}
        return getattr(torchvision.models, name)(num_classes=num_classes, **extra)
    return build


for _name in TORCHVISION:
    register_model(_name)(_torchvision(_name))


def cifar_stem(model: nn.Module) -> nn.Module:
    """3x3 stride-1 stem without max-pool: the usual change for 32x32 images."""
    model.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
    nn.init.kaiming_normal_(model.conv1.weight, mode="fan_out", nonlinearity="relu")
    model.maxpool = nn.Identity()
    return model


@register_model("resnet18_cifar")
def resnet18_cifar(num_classes: int, zero_init_residual: bool = False, **_) -> nn.Module:
    import torchvision
    return cifar_stem(torchvision.models.resnet18(num_classes=num_classes,
                                                  zero_init_residual=zero_init_residual))


class _Block(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        idt = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + idt)


class ResNetMini(nn.Module):
    """Stem, two residual stages, global pool, fc: small enough for CPU tests, same parts as a ResNet."""

    def __init__(self, num_classes: int = 10, width: int = 16):
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.layer1 = _Block(width, width, 1)
        self.layer2 = _Block(width, 2 * width, 2)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(2 * width, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x):
        x = self.relu(self.bn1(self.conv1(x)))
        x = self.layer2(self.layer1(x))
        return self.fc(self.avgpool(x).flatten(1))


@register_model("resnet_mini")
def resnet_mini(num_classes: int, width: int = 16, **_) -> nn.Module:
    return ResNetMini(num_classes=num_classes, width=width)


class ConvNetMini(nn.Module):
    """Two convs, ReLU, global pool, fc, no BatchNorm: its gradient is a plain mean over the
    batch, so data-parallel equivalence can be checked exactly."""

    def __init__(self, num_classes: int = 10, width: int = 16):
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 3, 1, 1, bias=False)
        self.conv2 = nn.Conv2d(width, 2 * width, 3, 2, 1, bias=False)
        self.relu = nn.ReLU()
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(2 * width, num_classes)

    def forward(self, x):
        x = self.relu(self.conv2(self.relu(self.conv1(x))))
        return self.fc(self.avgpool(x).flatten(1))


@register_model("convnet_mini")
def convnet_mini(num_classes: int, width: int = 16, **_) -> nn.Module:
    return ConvNetMini(num_classes=num_classes, width=width)
