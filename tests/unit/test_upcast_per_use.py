"""The graph pass that keeps 16-bit gradients in 16 bits (``internals/upcast_per_use.py``)."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from tr_hydra.internals.upcast_per_use import PASS, upcast_per_use

CONVERT = torch.ops.prims.convert_element_type.default


def graph_of(src_dtype, to_dtype=torch.float32, readers=3):
    """x (``src_dtype``) converted to ``to_dtype`` once and read by ``readers`` nodes."""
    g = torch.fx.Graph()
    x = g.placeholder("x")
    with FakeTensorMode():
        x.meta["val"] = torch.empty(2, 3, dtype=src_dtype)
    c = g.call_function(CONVERT, (x, to_dtype))
    outs = [g.call_function(torch.ops.aten.mul.Tensor, (c, float(i + 1))) for i in range(readers - 1)]
    outs.append(g.call_function(torch.ops.aten.add.Tensor, (c, c)))  # one reader that reads it twice
    g.output(tuple(outs))
    return g


def converts(g):
    return [n for n in g.nodes if n.op == "call_function" and n.target is CONVERT]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_each_reader_gets_its_own_conversion(dtype):
    g = graph_of(dtype)
    x = torch.randn(2, 3).to(dtype)
    before = torch.fx.GraphModule(torch.nn.Module(), g)(x)
    assert upcast_per_use(g) == 2
    g.lint()
    cs = converts(g)
    assert len(cs) == 3 and all(len(c.users) == 1 for c in cs)
    assert all(c.args == (cs[0].args[0], torch.float32) for c in cs)
    after = torch.fx.GraphModule(torch.nn.Module(), g)(x)
    assert all(torch.equal(a, b) and a.dtype == torch.float32 for a, b in zip(before, after))


@pytest.mark.parametrize("src, to, readers", [(torch.float32, torch.float32, 3),  # not a 16-bit source
                                              (torch.float32, torch.bfloat16, 3),  # a narrowing
                                              (torch.bfloat16, torch.float64, 3),  # not to float32
                                              (torch.bfloat16, torch.float32, 1)])  # one reader
def test_other_conversions_are_left_alone(src, to, readers):
    g = graph_of(src, to, readers)
    assert upcast_per_use(g) == 0 and len(converts(g)) == 1


def test_blocks_compiled_keep_16bit_gradients_on_cpu():
    """Inductor on the CPU: without the pass the backward of ResNet-50's first three blocks under
    bf16 autocast stores a float32 activation-sized gradient, with it none; the gradients stay
    as close to float64 as eager bf16's (PyTorch's own error, measured here, is the yardstick)."""
    from tests.unit._upcast_check import run
    r = run("cpu")
    assert r["plain_f32"], "this PyTorch stores no float32 gradient here: the check would show nothing"
    assert r["pass_f32"] == []
    assert r["pass"] <= 2 * max(r["eager"], r["plain"]), r


def test_pass_has_a_stable_identity():
    """Inductor's caches key the pass by its uuid, and the saved store by the options' repr: both
    are the same in another process, and the pass equals itself across copies."""
    code = "from tr_hydra.internals.upcast_per_use import PASS; print(repr(PASS), PASS.uuid())"
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert other == [repr(PASS), PASS.uuid()]
    assert "0x" not in repr(PASS)
    assert type(PASS)() == PASS and hash(type(PASS)()) == hash(PASS)
