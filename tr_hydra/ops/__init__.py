"""Kernels and modules the step takes in place of PyTorch's own."""
from __future__ import annotations

from torch import nn


def retype(model: nn.Module, base: type, cls: type, want=lambda m: True) -> list[str]:
    """Turn each module of ``model`` whose type is exactly ``base`` and that ``want`` accepts
    into ``cls`` in place, as ``models.stem`` turns its convolutions (the class changes, the
    module and its parameters stay). Returns their names."""
    swapped = []
    for name, m in model.named_modules():
        if type(m) is base and want(m):
            m.__class__ = cls
            swapped.append(name)
    return swapped
