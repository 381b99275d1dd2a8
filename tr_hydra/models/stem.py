"""The stem convolution computed as a space-to-depth convolution.

A stride-2 convolution over the 3-channel image (ResNet's 7x7 stem) is a poor fit for cuDNN: on
the H200 it ran at about 40 TFLOPS, 2.9 ms of forward and weight gradient per ResNet-50 step at
batch 256, 8% of the step. The same convolution can be written as a stride-1 convolution over
the image folded into 2x2 blocks (12 channels at half the height and width) with a 4x4 kernel
rearranged from the 7x7 one plus a zero tap. That form ran in 1.5 ms (``docs/benchmarks.md``).

Only the computation changes. The module keeps its ``(O, C, kh, kw)`` weight, so the arena, the
optimizer, checkpoints and ``state_dict`` are exactly those of the plain model. The rearranged
kernel is made from the weight inside the step (9,408 numbers for ResNet-50), and its gradient
flows back into the weight through the same rearrangement.

Exactness: with ``k' = k + q`` (``q = p mod 2`` zero taps in front, one more at the back when
needed to make the kernel even), ``out[i] = sum_k' w'[k'] x[2i + k' - (p + q)]``. Padding the
input by ``p + q`` in front makes block ``b = i + k' // 2`` and parity ``k' mod 2``, so the sum is
a stride-1 convolution over the blocks, with no padding.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

MAX_IN_CHANNELS = 4  # the rearrangement pays off only for thin inputs (the image)


def eligible(m: nn.Module) -> bool:
    """A Conv2d the rearrangement applies to: stride 2, no dilation or groups, symmetric zero
    padding, an odd or even square kernel, and at most ``MAX_IN_CHANNELS`` input channels."""
    return (isinstance(m, nn.Conv2d) and m.stride == (2, 2) and m.dilation == (1, 1) and m.groups == 1
            and m.padding_mode == "zeros" and isinstance(m.padding, tuple) and m.padding[0] == m.padding[1]
            and m.kernel_size[0] == m.kernel_size[1] and m.in_channels <= MAX_IN_CHANNELS)


def _geometry(k: int, p: int) -> tuple[int, int]:
    """(front zero taps q, taps after padding to an even count)."""
    q = p % 2
    k2 = k + q
    return q, k2 + (k2 % 2)


def fold_weight(w: torch.Tensor, p: int) -> torch.Tensor:
    """(O, C, k, k) -> (O, 4C, k2/2, k2/2): channel index = (row parity, column parity, c)."""
    o, c, k, _ = w.shape
    q, k2 = _geometry(k, p)
    back = k2 - k - q
    wp = F.pad(w, (q, back, q, back))
    h = k2 // 2
    return wp.reshape(o, c, h, 2, h, 2).permute(0, 3, 5, 1, 2, 4).reshape(o, 4 * c, h, h)


def fold_input(x: torch.Tensor, k: int, p: int) -> torch.Tensor:
    """(N, C, H, W) -> (N, 4C, L_h/2, L_w/2), padded so that a stride-1, unpadded convolution with
    ``fold_weight``'s kernel gives the original output."""
    n, c, hh, ww = x.shape
    q, k2 = _geometry(k, p)
    front = p + q

    def length(size: int) -> int:
        out = (size + 2 * p - k) // 2 + 1
        return 2 * (out - 1 + k2 // 2)

    lh, lw = length(hh), length(ww)
    xp = F.pad(x, (front, lw - front - ww, front, lh - front - hh))  # a negative back pad crops
    return xp.reshape(n, c, lh // 2, 2, lw // 2, 2).permute(0, 3, 5, 1, 2, 4).reshape(n, 4 * c, lh // 2, lw // 2)


class SpaceToDepthConv2d(nn.Conv2d):
    """A Conv2d (same parameters, same ``state_dict``) whose forward is the space-to-depth form."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k, p = self.kernel_size[0], self.padding[0]
        fmt = torch.channels_last if x.is_cuda else torch.contiguous_format  # see nchw_compute_on_cpu
        xs = fold_input(x, k, p).contiguous(memory_format=fmt)
        ws = fold_weight(self.weight, p).contiguous(memory_format=fmt)
        return F.conv2d(xs, ws, self.bias, 1, 0)


def space_to_depth_stem(model: nn.Module, names: tuple[str, ...] | list[str]) -> list[str]:
    """Turn the named convolutions (the ones that read the image) that qualify into
    ``SpaceToDepthConv2d`` in place; returns the module names changed."""
    changed = []
    modules = dict(model.named_modules())
    for name in names:
        m = modules.get(name)
        if m is not None and type(m) is nn.Conv2d and eligible(m):
            m.__class__ = SpaceToDepthConv2d
            changed.append(name)
    return changed
