"""Shared by the CPU and CUDA tests of ``internals/upcast_per_use.py``: ResNet-50's first three blocks
(the first with the shortcut's BatchNorm) under 16-bit autocast, compiled by Inductor with
and without the pass, against eager PyTorch and a float64 reference."""
from __future__ import annotations

import copy
import math
import re

import torch
import torchvision
from torch._inductor.utils import run_and_get_code

from tr_hydra.internals.upcast_per_use import PASS


def blocks() -> torch.nn.Module:
    down = torch.nn.Sequential(torch.nn.Conv2d(64, 256, 1, bias=False), torch.nn.BatchNorm2d(256))
    return torch.nn.Sequential(torchvision.models.resnet.Bottleneck(64, 64, downsample=down),
                               torchvision.models.resnet.Bottleneck(256, 64),
                               torchvision.models.resnet.Bottleneck(256, 64))


def float32_activations(code: str, least: int) -> list[str]:
    """The float32 buffers of ``least`` elements or more that the generated code allocates."""
    found = re.findall(r"(buf\d+) = empty_strided_\w+\(\(([\d, ]+)\), \([\d, ]+\), torch\.float32\)", code)
    return [b for b, shape in found if math.prod(int(s) for s in shape.split(",") if s.strip()) >= least]


def run(device: str, n: int = 4, hw: int = 16, dtype=torch.bfloat16) -> dict:
    """Gradients of the blocks' parameters: float64 eager, ``dtype`` autocast eager,
    and compiled with and without the pass; and the float32 activation-sized buffers of each
    compiled backward."""
    torch.manual_seed(0)
    model = blocks().to(device).to(memory_format=torch.channels_last)
    x = torch.randn(n, 64, hw, hw, device=device).to(memory_format=torch.channels_last)
    g = torch.randn(n, 256, hw, hw, device=device).to(memory_format=torch.channels_last)

    def grads(m, inp, amp=True, options=None):
        m = copy.deepcopy(m)

        def step(t):
            with torch.autocast(device, dtype, enabled=amp):
                y = m(t)
            y.backward(g.to(y.dtype))
            return y

        code = []
        if options is None:
            step(inp)
        else:
            torch._dynamo.reset()
            _, code = run_and_get_code(torch.compile(step, dynamic=False, options=options), inp)
        out = [p.grad.double() for p in m.parameters()]
        return out, "\n".join(code)

    ref, _ = grads(model.double(), x.double(), amp=False)
    eager, _ = grads(model.float(), x)
    plain, plain_code = grads(model.float(), x, options={})
    passed, pass_code = grads(model.float(), x, options={"post_grad_custom_post_pass": PASS})

    def error(gs):  # the largest error against float64, relative to each gradient's largest value
        return max(((a - r).abs().max() / r.abs().max()).item() for a, r in zip(gs, ref))

    least = n * 64 * hw * hw
    return {"eager": error(eager), "plain": error(plain), "pass": error(passed),
            "plain_f32": float32_activations(plain_code, least), "pass_f32": float32_activations(pass_code, least)}
