"""Getting a model ready to run from the arena: initial weights, CPU compute format,
deterministic pooling."""
from __future__ import annotations

from pathlib import Path

import torch

from tr_hydra.errors import ConfigError


def load_init(model: torch.nn.Module, path: str) -> None:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"model.init_from: {path} is not a file")
    try:
        sd = torch.load(p, map_location="cpu", weights_only=True)
    except Exception as e:  # a corrupt or non-tensor file
        raise ConfigError(f"model.init_from: {path} is not a loadable state_dict ({type(e).__name__})") from None
    if isinstance(sd, dict) and "state_dict" in sd and isinstance(sd["state_dict"], dict):
        sd = sd["state_dict"]
    try:
        model.load_state_dict(sd, strict=True)
    except RuntimeError as e:
        first = str(e).strip().splitlines()
        raise ConfigError(f"model.init_from: {path} does not fit the model: {first[1].strip() if len(first) > 1 else first[0]}") from None


def nchw_compute_on_cpu(model: torch.nn.Module) -> None:
    """On CPU, convolutions and BatchNorm compute in NCHW.

    The arena keeps conv weights in channels_last (the planned layout, what cuDNN wants), but
    PyTorch's CPU channels_last kernels lose precision: on resnet18_cifar the fp32 gradients of one
    batch were 2.2e-3 (relative norm) away from float64 in channels_last and 2.3e-6 in NCHW, and
    BatchNorm on a batch with near-cancelling bias gradients 0.7% against 1e-6. So each conv reads
    a contiguous copy of its weight (the gradient flows back into the arena view in place) and a
    contiguous input. CUDA keeps channels_last end to end.
    """
    from tr_hydra.models.stem import ImageConv2d, SpaceToDepthConv2d
    for m in model.modules():
        if isinstance(m, torch.nn.Conv2d) and not isinstance(m, (SpaceToDepthConv2d, ImageConv2d)):  # those already do
            def forward(x, _m=m):
                return _m._conv_forward(x.contiguous(), _m.weight.contiguous(), _m.bias)
            m.forward = forward


class GlobalAvgPool(torch.nn.Module):
    """AdaptiveAvgPool2d(1) as a mean over H and W: the same numbers, and a backward that is
    deterministic on CUDA (adaptive_avg_pool2d's is not)."""

    def forward(self, x):
        return x.mean(dim=(2, 3), keepdim=True)


def deterministic_pools(model: torch.nn.Module) -> None:
    for name, m in list(model.named_modules()):
        for child_name, child in list(m.named_children()):
            if isinstance(child, torch.nn.AdaptiveAvgPool2d) and child.output_size in (1, (1, 1)):
                setattr(m, child_name, GlobalAvgPool())
