"""Max pooling whose backward gathers, one Triton kernel over the input.

A stem's max pooling (ResNet's and DenseNet's: a 3x3 window at stride 2, padding 1, over a
112x112 activation). Inductor computes that pooling's backward as a gather too, but through the
int64 indices it rebuilds from the window offsets and with a bounds check per candidate window:
the largest Triton kernel of ResNet-50's step, for a pass that moves little data
(``docs/performance.md``).

Here the forward is PyTorch's (``F.max_pool2d`` with indices, which Inductor fuses with the
BatchNorm and ReLU before it) and keeps, for each output, only the position of its maximum in
its window as one byte (``kh * k + kw``). The backward is one kernel: each program takes a row
of the input's gradient, a block of columns and channels, and for each of the (at most
``ceil(k / s)`` squared) windows that hold an element, adds the window's gradient if its
maximum is that element. The sums are in float32, as PyTorch's own backward sums, and every
element is written once (no atomics, no zero-fill), so the result is deterministic.

Only the computation of the backward changes: the module has no parameters, the forward's
values and the chosen maxima are PyTorch's, and ties go where PyTorch's indices send them.
Off CUDA (and on CUDA without Triton) the backward is PyTorch's ``max_pool2d_with_indices_backward``
on the indices rebuilt from the offsets.
"""
# no ``from __future__ import annotations``: triton_op reads the signature's types as objects
import functools
import math

import torch
import torch.nn.functional as F
from torch import nn

BLOCK_W = 16
BLOCK_C = 64
NUM_WARPS = 2


@functools.lru_cache(maxsize=None)
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def maxpool_gather_backward_kernel(
            g_ptr, off_ptr, out_ptr, C, H, W, OH, OW,
            g_sn, g_sc, g_sh, g_sw, o_sn, o_sc, o_sh, o_sw, x_sn, x_sc, x_sh, x_sw,
            K: tl.constexpr, S: tl.constexpr, P: tl.constexpr, NWIN: tl.constexpr,
            BLOCK_W: tl.constexpr, BLOCK_C: tl.constexpr):
        row = tl.program_id(0)  # n * H + h
        n = (row // H).to(tl.int64)
        h = row % H
        w = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)[:, None]
        c = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)[None, :]
        inside = (w < W) & (c < C)
        acc = tl.zeros([BLOCK_W, BLOCK_C], dtype=tl.float32)
        oh_last = (h + P) // S  # the last window (row) that holds row h
        ow_last = (w + P) // S
        for i in tl.static_range(NWIN):
            oh = oh_last - i
            kh = h + P - oh * S
            row_ok = (oh >= 0) & (oh < OH) & (kh < K)
            for j in tl.static_range(NWIN):
                ow = ow_last - j
                kw = w + P - ow * S
                ok = inside & row_ok & (ow >= 0) & (ow < OW) & (kw < K)
                off = tl.load(off_ptr + n * o_sn + c * o_sc + oh * o_sh + ow * o_sw, mask=ok, other=-1)
                hit = ok & (off.to(tl.int32) == kh * K + kw)
                g = tl.load(g_ptr + n * g_sn + c * g_sc + oh * g_sh + ow * g_sw, mask=hit, other=0.0)
                acc += g.to(tl.float32)
        tl.store(out_ptr + n * x_sn + c * x_sc + h * x_sh + w * x_sw,
                 acc.to(out_ptr.dtype.element_ty), mask=inside)

    return maxpool_gather_backward_kernel


def __getattr__(name):
    """``maxpool_gather_backward_kernel``, made on first use (Triton imported then): a saved
    compile (``internals.saved_compile``) finds the Triton kernels it launches by module and
    name when it is loaded."""
    if name == "maxpool_gather_backward_kernel":
        return _kernel()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _grad_strides(gy: torch.Tensor, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The input gradient's strides: channels-last when the output's gradient is, else contiguous."""
    n, c, h, w = shape
    if gy.dim() == 4 and gy.stride(1) == 1 and c > 1:
        return (h * w * c, 1, w * c, c)
    return (c * h * w, h * w, w, 1)


def gather_backward_launch(gy: torch.Tensor, offsets: torch.Tensor, out: torch.Tensor,
                           k: int, s: int, p: int, wrap=None) -> None:
    """Run the kernel: ``out`` (N, C, H, W) gets the input gradient of a k x k, stride-s, padding-p
    max pooling, from the output gradient ``gy`` and the window offsets (both (N, C, OH, OW))."""
    kernel = _kernel()
    if wrap is not None:
        kernel = wrap(kernel)
    n, c, h, w = out.shape
    oh, ow = gy.shape[-2:]
    grid = (n * h, math.ceil(w / BLOCK_W), math.ceil(c / BLOCK_C))
    kernel[grid](gy, offsets, out, c, h, w, oh, ow, *gy.stride(), *offsets.stride(), *out.stride(),
                 K=k, S=s, P=p, NWIN=-(-k // s), BLOCK_W=BLOCK_W, BLOCK_C=BLOCK_C, num_warps=NUM_WARPS)


def offsets_to_indices(offsets: torch.Tensor, width: int, k: int, s: int, p: int) -> torch.Tensor:
    """PyTorch's flat indices (``row * width + column`` of the input plane) from the offsets."""
    oh, ow = offsets.shape[-2:]
    off = offsets.long()
    rows = torch.arange(oh, device=offsets.device).view(oh, 1) * s - p + off // k
    cols = torch.arange(ow, device=offsets.device).view(1, ow) * s - p + off % k
    return rows * width + cols


def indices_to_offsets(indices: torch.Tensor, width: int, k: int, s: int, p: int) -> torch.Tensor:
    """Each maximum's position in its window, ``kh * k + kw``, as int8 (k * k <= 127)."""
    oh, ow = indices.shape[-2:]
    top = torch.arange(oh, device=indices.device).view(oh, 1) * s - p
    left = torch.arange(ow, device=indices.device).view(1, ow) * s - p
    return ((indices // width - top) * k + (indices % width - left)).to(torch.int8)


def _reference_backward(gy, offsets, shape, k, s, p):
    idx = offsets_to_indices(offsets, shape[-1], k, s, p)
    x = torch.empty_strided(shape, _grad_strides(gy, shape), dtype=gy.dtype, device=gy.device)  # read for its shape
    return torch.ops.aten.max_pool2d_with_indices_backward(gy, x, [k, k], [s, s], [p, p], [1, 1], False, idx)


@functools.lru_cache(maxsize=None)
def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return True


@torch.library.triton_op("tr_hydra::maxpool_gather_backward", mutates_args=())
def maxpool_gather_backward(gy: torch.Tensor, offsets: torch.Tensor, height: int, width: int,
                            k: int, s: int, p: int) -> torch.Tensor:
    n, c = gy.shape[0], gy.shape[1]
    shape = (n, c, height, width)
    if gy.device.type != "cuda" or not _triton_available():
        return _reference_backward(gy, offsets, shape, k, s, p)
    out = torch.empty_strided(shape, _grad_strides(gy, shape), dtype=gy.dtype, device=gy.device)
    from torch.library import wrap_triton
    gather_backward_launch(gy, offsets, out, k, s, p, wrap=wrap_triton)
    return out


@torch.library.triton_op("tr_hydra::maxpool_with_offsets", mutates_args=())
def maxpool_with_offsets(x: torch.Tensor, k: int, s: int, p: int) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch's max pooling, and each maximum's place in its window as one byte. An operator of
    PyTorch's own kind rather than an ``autograd.Function``: AOTAutograd's cache refuses graphs
    with the latter (measured: each parallel compile's work was redone in the trainer), and
    Inductor still sees the body, so it fuses it with the BatchNorm and ReLU before it."""
    y, idx = F.max_pool2d(x, k, s, p, return_indices=True)
    return y, indices_to_offsets(idx, x.shape[-1], k, s, p)


def _setup_context(ctx, inputs, output):
    x, k, s, p = inputs
    ctx.save_for_backward(output[1])
    ctx.geometry = (x.shape[-2], x.shape[-1], k, s, p)
    ctx.mark_non_differentiable(output[1])


def _backward(ctx, gy, _goffsets):
    (offsets,) = ctx.saved_tensors
    height, width, k, s, p = ctx.geometry
    return maxpool_gather_backward(gy, offsets, height, width, k, s, p), None, None, None


maxpool_with_offsets.register_autograd(_backward, setup_context=_setup_context)


def _square(v):
    if isinstance(v, int):
        return v
    v = tuple(v)
    return v[0] if len(v) == 2 and v[0] == v[1] else None


class GatherMaxPool2d(nn.Module):
    """``nn.MaxPool2d`` (square window, no dilation, floor mode) with the gathering backward."""

    def __init__(self, kernel_size: int, stride: int, padding: int):
        super().__init__()
        self.kernel_size, self.stride, self.padding = kernel_size, stride, padding

    def forward(self, x):
        if x.dim() != 4 or not torch.is_grad_enabled() or not x.requires_grad:
            return F.max_pool2d(x, self.kernel_size, self.stride, self.padding)
        return maxpool_with_offsets(x, self.kernel_size, self.stride, self.padding)[0]

    def extra_repr(self) -> str:
        return f"kernel_size={self.kernel_size}, stride={self.stride}, padding={self.padding}"


def why_not(m: nn.MaxPool2d) -> str | None:
    """Why the kernel does not cover the ``nn.MaxPool2d`` ``m`` (None: it does). It needs a
    square window of at most 11 (offsets fit a byte), square stride and padding, no dilation,
    floor mode and no indices returned; any padding PyTorch accepts (at most half the window)."""
    if m.ceil_mode or m.return_indices:
        return "ceil_mode" if m.ceil_mode else "return_indices"
    k, s, p, d = (_square(m.kernel_size), _square(m.stride if m.stride is not None else m.kernel_size),
                  _square(m.padding), _square(m.dilation))
    if None in (k, s, p, d):
        return "a window, stride or padding that is not square"
    if d != 1:
        return f"dilation {d}"
    if not (1 <= k <= 11 and s >= 1):
        return f"window {k}, stride {s}"
    return None


def eligible(m: nn.Module) -> bool:
    """An ``nn.MaxPool2d`` (exactly that type) the kernel covers (``why_not``)."""
    return type(m) is nn.MaxPool2d and why_not(m) is None


def gather_maxpools(model: nn.Module, skipped: dict | None = None) -> list[str]:
    """Swap each eligible ``nn.MaxPool2d`` of ``model`` for ``GatherMaxPool2d``. Returns their
    names; ``skipped`` (if given) gets each ``nn.MaxPool2d`` left alone, with the reason."""
    swapped = []
    for name, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            full = f"{name}.{child_name}" if name else child_name
            if eligible(child):
                setattr(parent, child_name, GatherMaxPool2d(
                    _square(child.kernel_size), _square(child.stride if child.stride is not None else child.kernel_size),
                    _square(child.padding)))
                swapped.append(full)
            elif type(child) is nn.MaxPool2d and skipped is not None:
                skipped[full] = why_not(child)
    return swapped
