"""A classifier's last linear layer as a reduction Inductor compiles, not a cuBLAS product.

cuBLAS and cuBLASLt keep a workspace per stream once a matrix product has run, tens of MiB
held in the captured graphs' pool for as long as the run lives (``runtime/graphs.py``).
In a convolutional classifier the only matrix products are the last linear layer's, and with
few classes they are tiny: CIFAR ResNet-18's is (512 x 512) @ (512 x 10) at batch 512. Computed
as a broadcast product summed over the shared dimension, Inductor fuses each into one reduction
kernel (forward, input gradient, weight gradient) and nothing in the step calls cuBLAS, so its
workspace is never allocated.

The products are formed and summed in float32, the bias added in float32, and the result rounded
to the autocast dtype, as a cuBLAS bf16/fp16 product accumulates in float32 and rounds once:
the same numbers up to the order of the sum. ``ReducedLinear`` keeps ``nn.Linear``'s
parameters and ``state_dict``. The step (``ops.swaps``) turns each ``nn.Linear`` of at most
``MAX_OUT`` outputs whose input is (N, features), a classifier's head, into one; a linear layer
over an activation's every position (ConvNeXt's blocks) or of more outputs stays cuBLAS's.
"""
from __future__ import annotations

import torch
from torch import nn

from tr_hydra.ops import retype

MAX_OUT = 16  # outputs (classes) up to which the product is a reduction


class ReducedLinear(nn.Linear):
    """``nn.Linear`` computed as a broadcast product summed over ``in_features``, in float32 (or
    the inputs' wider dtype)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kind = x.device.type
        common = torch.promote_types(x.dtype, self.weight.dtype)
        autocast = kind in ("cuda", "cpu") and torch.is_autocast_enabled(kind)
        dtype = torch.get_autocast_dtype(kind) if autocast else common
        acc = torch.promote_types(common, torch.float32)
        y = (x.to(acc).unsqueeze(-1) * self.weight.to(acc).t()).sum(-2)
        if self.bias is not None:
            y = y + self.bias.to(acc)
        return y.to(dtype)


def why_not(name: str, m: nn.Linear, max_out: int, shapes: dict | None) -> str | None:
    """Why the ``nn.Linear`` ``name`` stays a cuBLAS product (None: it is reduced). It needs at
    most ``max_out`` outputs and, with ``shapes`` (``ops.call_shapes``), every call over a 2-D
    (N, features) input: a classifier's head, not a linear layer over every position of an
    N, H, W, C activation (where the product is no longer small)."""
    if m.out_features > max_out:
        return f"more than {max_out} outputs"
    if shapes is not None:
        calls = shapes.get(name)
        if not calls:
            return "never called"
        if not all(s is not None and len(s) == 2 for s in calls):
            return "input not 2-D"
    return None


def reduced_linears(model: nn.Module, max_out: int = MAX_OUT, shapes: dict | None = None,
                    skipped: dict | None = None) -> list[str]:
    """Turn each ``nn.Linear`` of ``model`` that ``why_not`` accepts into ``ReducedLinear`` in
    place (without ``shapes``, by its outputs alone: the reduction is the same product over any
    leading dimensions). Returns their names; ``skipped`` (if given) gets the others, with the
    reason."""
    return retype(model, nn.Linear, ReducedLinear, lambda name, m: why_not(name, m, max_out, shapes), skipped)


def uses_blas(model: nn.Module) -> bool:
    """Whether ``model`` has a linear layer left that runs as a cuBLAS product."""
    return any(isinstance(m, (nn.Linear, nn.Bilinear, nn.MultiheadAttention)) and not isinstance(m, ReducedLinear)
               for m in model.modules())
