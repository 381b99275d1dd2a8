"""The stem convolution computed as a space-to-depth convolution.

A stride-2 convolution over the 3-channel image (ResNet's 7x7 stem) is a poor fit for cuDNN: a
small share of the FLOPs and a large share of ResNet-50's step. The same convolution can be written as a stride-1 convolution over
the image folded into 2x2 blocks (12 channels at half the height and width) with a 4x4 kernel
rearranged from the 7x7 one plus a zero tap. That form runs in about half the time (``docs/performance.md``).

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


def why_not(m: nn.Module) -> str | None:
    """Why the rearrangement does not apply to ``m`` (None: it applies). It needs a plain
    ``nn.Conv2d`` of stride 2, no dilation or groups, symmetric zero padding given as numbers, a
    square kernel (odd or even) and at most ``MAX_IN_CHANNELS`` input channels; a bias is kept
    as it is."""
    if type(m) is not nn.Conv2d:
        return f"{type(m).__name__}, not nn.Conv2d"
    if m.stride != (2, 2):
        k = "x".join(map(str, m.kernel_size))
        return f"{k} stride {m.stride[0] if m.stride[0] == m.stride[1] else m.stride}"
    if m.dilation != (1, 1) or m.groups != 1:
        return "dilated" if m.dilation != (1, 1) else f"groups={m.groups}"
    if m.padding_mode != "zeros" or not isinstance(m.padding, tuple) or m.padding[0] != m.padding[1]:
        return f"padding {m.padding!r}, {m.padding_mode}"
    if m.kernel_size[0] != m.kernel_size[1]:
        return f"kernel {m.kernel_size}"
    if m.in_channels > MAX_IN_CHANNELS:
        return f"{m.in_channels} input channels"
    return None


def eligible(m: nn.Module) -> bool:
    """A Conv2d the rearrangement applies to (``why_not``)."""
    return why_not(m) is None


def stem_off_reason(model: nn.Module, names) -> str:
    """Why no convolution over the image (``names``) takes the space-to-depth form, one line."""
    modules = dict(model.named_modules())
    found = [(n, why_not(modules[n])) for n in names if n in modules]
    if not found:
        return "no convolution over the image"
    return ("no stride-2 convolution over the image ("
            + ", ".join(f"{n}: {r}" for n, r in found if r) + ")")


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


AUTO_STEM_CHANNELS = 8  # 16-bit channels in multiples of 8: the 16 bytes cuDNN's tensor-core kernels load


def stem_channel_multiple(device_type: str, amp: bool) -> int | None:
    """The channel multiple the convolution over the image reads its input padded to: 8 on
    CUDA with 16-bit autocast (ResNet-50's 12-channel fold reads 16, a 3-channel stem 8: both
    measured faster); None (the image as it is) elsewhere (CPU, or fp32, where no
    gain was measured)."""
    return AUTO_STEM_CHANNELS if device_type == "cuda" and amp else None


def extra_channels(c: int, multiple: int | None) -> int:
    """Zero channels that bring ``c`` up to a multiple of ``multiple`` (``stem_channel_multiple``;
    None: none)."""
    return 0 if not multiple else -c % multiple


def pad_channels(t: torch.Tensor, extra: int) -> torch.Tensor:
    """``t`` (N, C, H, W) or a weight (O, C, kh, kw) with ``extra`` zero channels after its C.
    A convolution over zero channels with zero weights adds nothing, so the output is the same;
    the weight's gradient flows back through the pad (a slice) into the real channels."""
    return F.pad(t, (0, 0, 0, 0, 0, extra)) if extra else t


def as_computed(x: torch.Tensor, fmt: torch.memory_format) -> torch.Tensor:
    """The image as the convolution reads it: in autocast's compute dtype (the input buffer may
    hold another 16-bit type, as DALI writes it) and in ``fmt``'s layout."""
    dev = x.device.type
    # the meta device has no autocast (convolutions recorded there get the compute dtype already)
    if x.is_floating_point() and dev != "meta" and torch.is_autocast_enabled(dev):
        dt = torch.get_autocast_dtype(dev)
        if x.dtype != dt:
            x = x.to(dt)
    return x.contiguous(memory_format=fmt)


def recomputed(fn, x: torch.Tensor) -> torch.Tensor:
    """``fn(x)`` for a convolution over the image to read. Compiled, the result is recomputed in
    the backward (a copy, a cast, a rearrangement: one cheap pass) from ``x``, which the
    partitioner then keeps instead: ``x`` is the input buffer, in the arena, so keeping it
    costs nothing, where the convolution's weight gradient would otherwise keep ``fn(x)`` in
    the activation pool (9.7 MiB for ResNet-50 at batch 32, its folded image in bf16).
    Eager, autograd saves what the convolution reads either way: plain ``fn(x)``."""
    if torch.compiler.is_compiling() and torch.is_grad_enabled():
        from torch.utils.checkpoint import checkpoint
        return checkpoint(fn, x, use_reentrant=False)
    return fn(x)


def _layout(x: torch.Tensor) -> torch.memory_format:
    # NCHW on the CPU (see nchw_compute_on_cpu); on the meta device as on CUDA, where
    # cuDNN's search before the first step records the step's convolutions
    return torch.contiguous_format if x.device.type == "cpu" else torch.channels_last


class SpaceToDepthConv2d(nn.Conv2d):
    """A Conv2d (same parameters, same ``state_dict``) whose forward is the space-to-depth form.
    With ``channel_multiple`` (``stem_channel_multiple``) the folded image and kernel get zero
    channels up to that multiple (ResNet-50's 12 to 16), in the same copy."""

    channel_multiple: int | None = None

    def read_channels(self) -> int:
        """Channels the convolution reads: the fold's, padded."""
        c = 4 * self.in_channels
        return c + extra_channels(c, self.channel_multiple)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k, p = self.kernel_size[0], self.padding[0]
        fmt = _layout(x)
        extra = extra_channels(4 * self.in_channels, self.channel_multiple)
        xs = recomputed(lambda a: as_computed(pad_channels(fold_input(a, k, p), extra), fmt), x)
        ws = pad_channels(fold_weight(self.weight, p), extra).contiguous(memory_format=fmt)
        return F.conv2d(xs, ws, self.bias, 1, 0)


class ImageConv2d(nn.Conv2d):
    """A Conv2d over the image (same parameters, same ``state_dict``, the same convolution) whose
    input copy (cast and made contiguous) is recomputed in the backward rather than kept; see
    ``recomputed``. For the stems the space-to-depth form leaves alone (CIFAR's stride 1). With
    ``channel_multiple`` the copy and the weight get zero channels up to that multiple."""

    channel_multiple: int | None = None

    def read_channels(self) -> int:
        return self.in_channels + extra_channels(self.in_channels, self.channel_multiple)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fmt = _layout(x)
        extra = extra_channels(self.in_channels, self.channel_multiple)
        # contiguous in fmt: on the CPU the arena's channels_last weight is read as NCHW
        # (nchw_compute_on_cpu); on CUDA it is channels_last already, and this is a no-op
        w = pad_channels(self.weight, extra).contiguous(memory_format=fmt)
        return self._conv_forward(recomputed(lambda a: as_computed(pad_channels(a, extra), fmt), x), w, self.bias)


def _convert(model: nn.Module, names, cls, channels: int | None, want=lambda m: True) -> list[str]:
    changed = []
    modules = dict(model.named_modules())
    for name in names:
        m = modules.get(name)
        if m is not None and type(m) is nn.Conv2d and want(m):
            m.__class__ = cls
            if channels and m.groups == 1:  # zero channels would shift a grouped conv's groups
                m.channel_multiple = channels
            changed.append(name)
    return changed


def image_input_recomputed(model: nn.Module, names, channels: int | None = None) -> list[str]:
    """Turn the named plain convolutions over the image into ``ImageConv2d`` in place (reading
    their input padded to a multiple of ``channels``, if given)."""
    return _convert(model, names, ImageConv2d, channels)


def space_to_depth_stem(model: nn.Module, names: tuple[str, ...] | list[str],
                        channels: int | None = None) -> list[str]:
    """Turn the named convolutions (the ones that read the image) that qualify into
    ``SpaceToDepthConv2d`` in place (the fold padded to a multiple of ``channels``, if given);
    returns the module names changed."""
    return _convert(model, names, SpaceToDepthConv2d, channels, eligible)
