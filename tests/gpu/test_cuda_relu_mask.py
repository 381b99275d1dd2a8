"""CUDA: ReLU's backward from a one-bit mask (``ops/relu_mask.py``) in Inductor's Triton step."""
from __future__ import annotations

import copy
import re

import pytest
import torch

from tests.unit.test_relu_mask import blocks, buffers
from tr_hydra.ops.relu_mask import bitmask_relus

pytestmark = pytest.mark.cuda


def test_blocks_compiled_on_cuda_read_the_bits():
    """Two Bottlenecks at layer 1's size under bf16 autocast: the forward keeps the packed masks
    and no unpacked one, the backward packs nothing and its kernels read the packed masks; the
    forward has no more kernels than with ``torch.relu`` (the packing and the output computed
    in the BatchNorm's kernel);
    the gradients are as close to float64 as with ``torch.relu``."""
    from torch._inductor.utils import run_and_get_code
    torch.manual_seed(0)
    model = blocks().cuda().to(memory_format=torch.channels_last)
    x = torch.randn(32, 64, 56, 56, device="cuda").to(memory_format=torch.channels_last)
    ref_model = copy.deepcopy(model).double()
    ref_model(x.double()).square().sum().backward()
    ref = [p.grad for p in ref_model.parameters()]

    def grads(m):
        m = copy.deepcopy(m)
        torch._dynamo.reset()
        f = torch.compile(m, dynamic=False, options={"fx_graph_cache": False})

        def step():
            with torch.autocast("cuda", torch.bfloat16):
                y = f(x)
            y.float().square().sum().backward()

        _, code = run_and_get_code(step)
        return [p.grad.double() for p in m.parameters()], code

    masked = copy.deepcopy(model)
    assert len(bitmask_relus(masked)) == 2
    plain, plain_code = grads(model)
    bits, code = grads(masked)
    forward, backward = code  # the generated modules: the forward, then the backward
    assert buffers(forward, "uint8") == 6 and buffers(forward, "bool") == 0
    assert buffers(backward, "uint8") == 0 and "'*u8'" in backward  # its kernels read the bytes

    def kernels(text):
        return len(set(re.findall(r"def (triton_\w+)\(", text)))

    plain_forward = plain_code[0]
    assert kernels(forward) <= kernels(plain_forward), (kernels(forward), kernels(plain_forward))

    def err(gs):
        return max(((a - r).abs().max() / r.abs().max()).item() for a, r in zip(gs, ref))

    assert err(bits) <= 2 * err(plain) + 16 * torch.finfo(torch.float32).eps, (err(bits), err(plain))
