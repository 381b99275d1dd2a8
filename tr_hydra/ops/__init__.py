"""Kernels and modules the step takes in place of PyTorch's own."""
from __future__ import annotations

from torch import nn


def swaps_step_ops(device_type: str, compile_mode: str) -> bool:
    """Whether a run's step takes the ops of this package: on CUDA when Inductor compiles the
    step. Max pooling's backward then gathers (``maxpool``), ReLU's reads a one-bit mask
    (``relu_mask``) and a linear layer of few outputs is a reduction (``reduced_linear``); eager,
    each would cost kernels of its own."""
    inductor = compile_mode == "inductor" or (compile_mode == "auto" and device_type == "cuda")
    return device_type == "cuda" and inductor


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
