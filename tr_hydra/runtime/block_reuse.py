"""``runtime.reuse_blocks``: residual blocks that are alike compiled once, not once per block.

ResNet-50 has 16 bottleneck blocks. The first of each stage changes the width or the stride; the
other 12 come in 4 groups of alike blocks (same code, same parameter and input shapes). Each of
those 12 blocks' forward becomes a ``torch.compiler.nested_compile_region``, one per group:
Dynamo still traces every call, but AOTAutograd and Inductor compile each group's block once,
forward and backward, and the step calls that code at each block of the group. The compile is
host Python, so there is less of it to do before the first step.

PyTorch's regions cannot mutate their inputs in training (``invoke_subgraph`` refuses in-place
updates of buffers), and BatchNorm in training updates its running statistics in place. So inside
a region each BatchNorm normalises with the batch's own statistics (``torch.native_batch_norm``
with no running statistics, as BatchNorm in training does) and returns the batch's mean and
unbiased variance; the block's forward, outside the region, folds them into the running statistics with
the module's momentum, which is what ``nn.BatchNorm2d`` does in place. In evaluation a region
calls each BatchNorm as it is (folded or not). Outside ``torch.compile`` a region is a plain call.

Only blocks that have a twin are marked (the first block of each stage is compiled in place, as
before), and only blocks whose layout is known: torchvision's ``BasicBlock`` and ``Bottleneck``
and tr_hydra's ``_Block`` (``conv1``/``bn1``, ``conv2``/``bn2``, ``conv3``/``bn3`` for a
bottleneck, and a ``downsample`` of a convolution and a BatchNorm, or none), with BatchNorms that
track running statistics with a momentum. Other blocks keep their own forward.
"""
from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import nn


# Inductor's options for a model with blocks made regions. With buffer reuse on, Inductor (torch
# 2.14, on the CPU) reused the buffer of a region's input, a block's weight, inside the region's
# code: the first block's two convolution weights came out of one step changed, and the
# gradients were wrong (``tests/unit/test_block_reuse.py``). Without it each temporary is freed
# and allocated anew, from the caching allocator, or from the CUDA graph's pool in a capture.
INDUCTOR_OPTIONS = {"allow_buffer_reuse": False}


def _bn(m: nn.BatchNorm2d, x: torch.Tensor, weight, bias, stats: list) -> torch.Tensor:
    # BatchNorm in training on the batch's statistics, as ``F.batch_norm`` without running
    # statistics, through the op that also returns them: the batch's mean and 1/sqrt(var + eps)
    # (float32 for 16-bit inputs), so the input is reduced over once, not a second time for the
    # statistics (a second ``var_mean`` cost a read of every normalised activation per step)
    out, mean, rstd = torch.native_batch_norm(x, weight, bias, None, None, True, 0.0, m.eps)
    with torch.no_grad():
        n = x.numel() // x.shape[1]
        var = (rstd.reciprocal().square() - m.eps) * (n / max(n - 1, 1))  # unbiased, as BatchNorm keeps
    stats.append(mean)
    stats.append(var)
    return out


def _conv(m: nn.Conv2d, x: torch.Tensor, weight) -> torch.Tensor:
    if x.device.type == "cpu":  # as the trainer's CPU convolutions compute (model_prep.nchw_compute_on_cpu)
        x, weight = x.contiguous(), weight.contiguous()
    return m._conv_forward(x, weight, None)


def _block(self, x, *p):
    """A residual block's training forward as a region, on its parameters ``p`` (in the order
    of ``_params``): (output, then each BatchNorm's batch mean and unbiased variance, in the
    order of ``_norms``)."""
    stats: list = []
    out = torch.relu(_bn(self.bn1, _conv(self.conv1, x, p[0]), p[1], p[2], stats))
    if hasattr(self, "conv3"):
        out = torch.relu(_bn(self.bn2, _conv(self.conv2, out, p[3]), p[4], p[5], stats))
        out = _bn(self.bn3, _conv(self.conv3, out, p[6]), p[7], p[8], stats)
        k = 9
    else:
        out = _bn(self.bn2, _conv(self.conv2, out, p[3]), p[4], p[5], stats)
        k = 6
    idt = x if self.downsample is None else \
        _bn(self.downsample[1], _conv(self.downsample[0], x, p[k]), p[k + 1], p[k + 2], stats)
    return (torch.relu(out + idt), *stats)


def _convs(block: nn.Module) -> list[nn.Conv2d]:
    convs = [block.conv1, block.conv2] + ([block.conv3] if hasattr(block, "conv3") else [])
    return convs + ([block.downsample[0]] if block.downsample is not None else [])


def _norms(block: nn.Module) -> list[nn.BatchNorm2d]:
    bns = [block.bn1, block.bn2] + ([block.bn3] if hasattr(block, "conv3") else [])
    return bns + ([block.downsample[1]] if block.downsample is not None else [])


def _params(block: nn.Module) -> list[torch.Tensor]:
    out = []
    for c, b in zip(_convs(block), _norms(block)):
        out += [c.weight, b.weight, b.bias]
    return out


def _block_types() -> tuple[type, ...]:
    from torchvision.models.resnet import BasicBlock, Bottleneck
    from tr_hydra.models.registry import _Block
    return (BasicBlock, Bottleneck, _Block)


def _markable(block: nn.Module) -> bool:
    names = ("conv1", "bn1", "conv2", "bn2") + (("conv3", "bn3") if isinstance(getattr(block, "conv3", None), nn.Conv2d) else ())
    if not all(isinstance(getattr(block, n, None), nn.Conv2d if n.startswith("conv") else nn.BatchNorm2d)
               for n in names):
        return False
    ds = getattr(block, "downsample", None)
    if ds is not None and not (isinstance(ds, nn.Sequential) and len(ds) == 2 and isinstance(ds[0], nn.Conv2d)
                               and isinstance(ds[1], nn.BatchNorm2d)):
        return False
    return all(c.bias is None for c in _convs(block)) and \
        all(b.track_running_stats and b.momentum is not None and b.affine for b in _norms(block))


def _signature(block: nn.Module) -> tuple:
    """What makes two blocks one region: their type, each parameter's and buffer's shape, each
    convolution's settings. (A region is reused for calls whose inputs match, but PyTorch keys
    it by the function, not by the module's parameters, so each distinct block gets a function
    of its own.)"""
    convs = tuple((n, c.stride, c.padding, c.dilation, c.groups) for n, c in block.named_modules()
                  if isinstance(c, nn.Conv2d))
    return (type(block), tuple((n, tuple(p.shape)) for n, p in block.named_parameters()),
            tuple((n, tuple(b.shape)) for n, b in block.named_buffers() if b is not None), convs,
            tuple(float(b.eps) for b in _norms(block)))


def mark_block_regions(model: nn.Module) -> tuple[int, int]:
    """Mark each residual block of ``model`` that has a twin (another block with the same
    signature) as a nested compile region, one per signature (see the module's docstring).
    A block without a twin is left as it is: its code is generated once either way (PyTorch
    inlines a region called once). Returns (blocks marked, distinct regions)."""
    if not hasattr(torch.compiler, "nested_compile_region"):
        return 0, 0
    groups: dict[tuple, list[nn.Module]] = {}
    for block in model.modules():
        if isinstance(block, _block_types()) and _markable(block):
            groups.setdefault(_signature(block), []).append(block)
    marked = distinct = 0
    for blocks in groups.values():
        if len(blocks) < 2:
            continue
        name = f"block_region_{distinct}"
        fn = types.FunctionType(_block.__code__.replace(co_name=name), _block.__globals__, name)
        forward = _region_forward(torch.compiler.nested_compile_region(fn))
        for block in blocks:
            block.forward = types.MethodType(forward, block)
        marked += len(blocks)
        distinct += 1
    return marked, distinct


def _region_forward(region):
    def forward(self, x):
        if not self.training:  # evaluation compiles the block in place (it mutates nothing)
            return type(self).forward(self, x)
        # the region's parameters as copies: PyTorch refuses a region whose inputs share storage,
        # and every parameter lives in the arena's (the gradients flow back through the copy)
        out, *stats = region(self, x, *[p.clone() for p in _params(self)])
        with torch.no_grad():
            # one foreach update per momentum (one kernel on CUDA), not one per statistic
            by_momentum: dict[float, tuple[list, list]] = {}
            for b, mean, var in zip(_norms(self), stats[0::2], stats[1::2]):
                run, new = by_momentum.setdefault(float(b.momentum), ([], []))
                run += [b.running_mean, b.running_var]
                new += [mean.to(b.running_mean.dtype), var.to(b.running_var.dtype)]
                if b.num_batches_tracked is not None:
                    b.num_batches_tracked.add_(1)
            for momentum, (run, new) in by_momentum.items():
                torch._foreach_lerp_(run, new, momentum)
        return out
    return forward
