"""CUDA: the graph pass that keeps 16-bit gradients in 16 bits, in Inductor's Triton backward."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_blocks_compiled_keep_16bit_gradients_on_cuda(dtype):
    """ResNet-50's first three blocks at layer 1's size (batch 32, 56x56) under autocast: without
    the pass Inductor's backward stores a float32 activation-sized gradient, with it none; the
    gradients stay as close to float64 as eager autocast's."""
    from tests.unit._upcast_check import run
    r = run("cuda", n=32, hw=56, dtype=dtype)
    assert r["plain_f32"], "this PyTorch stores no float32 gradient here: the check would show nothing"
    assert r["pass_f32"] == []
    assert r["pass"] <= 2 * max(r["eager"], r["plain"]), r
