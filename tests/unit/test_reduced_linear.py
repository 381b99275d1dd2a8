"""A linear layer of few outputs as a reduction (``ops/reduced_linear.py``), against ``nn.Linear``
(eager autograd in float64 and under bf16 autocast, Inductor on the CPU)."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch._inductor.utils import run_and_get_code

from tests.helpers import small_config
from tr_hydra.compiler.compile import BLAS_WORKSPACE_BYTES, compile_plan
from tr_hydra.ops.reduced_linear import ReducedLinear, reduced_linears, uses_blas


def pair(bias: bool, dtype=torch.float64):
    torch.manual_seed(0)
    plain = nn.Linear(48, 10, bias=bias).to(dtype)
    holder = nn.Sequential(copy.deepcopy(plain))
    assert reduced_linears(holder) == ["0"]
    return plain, holder[0]


def sum_bound(x, w):
    """How far two float64 sums of the same products may differ: the shared dimension's length
    times float64's epsilon times the sum of the products' magnitudes."""
    return x.shape[-1] * torch.finfo(torch.float64).eps * (x.abs() @ w.abs().t())


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(7, 48), (3, 5, 48)])
def test_same_output_and_gradients_as_linear_in_float64(bias, shape):
    plain, reduced = pair(bias)
    x = torch.randn(*shape, dtype=torch.float64)
    g = torch.randn(*shape[:-1], 10, dtype=torch.float64)
    outs = []
    for m in (plain, reduced):
        xi = x.clone().requires_grad_()
        y = m(xi)
        y.backward(g)
        outs.append((y.detach(), xi.grad, m.weight.grad, m.bias.grad if bias else None))
    (y0, gx0, gw0, gb0), (y1, gx1, gw1, gb1) = outs
    assert y1.dtype == y0.dtype and y1.shape == y0.shape
    assert ((y1 - y0).abs() <= 2 * sum_bound(x, plain.weight.detach())).all()
    assert ((gx1 - gx0).abs() <= 2 * sum_bound(g, plain.weight.detach().t())).all()
    g2, x2 = g.reshape(-1, 10), x.reshape(-1, 48)
    assert ((gw1 - gw0).abs() <= 2 * sum_bound(g2.t(), x2.t())).all()
    if bias:
        assert torch.allclose(gb1, gb0, rtol=0, atol=g2.shape[0] * torch.finfo(torch.float64).eps * g2.abs().sum())


def test_under_bf16_autocast_as_close_to_float64_as_linear():
    """Under CPU bf16 autocast both return bf16, each within one bf16 rounding of the float64 result
    more than the other's error."""
    plain, reduced = pair(True, torch.float32)
    x = torch.randn(64, 48)
    ref = nn.functional.linear(x.double(), plain.weight.double(), plain.bias.double())
    with torch.autocast("cpu", torch.bfloat16):
        a, b = plain(x), reduced(x)
    assert a.dtype == b.dtype == torch.bfloat16
    err = lambda y: ((y.double() - ref).abs() / ref.abs().max()).max().item()  # noqa: E731
    assert err(b) <= err(a) + torch.finfo(torch.bfloat16).eps, (err(b), err(a))


def test_swaps_only_linears_of_few_outputs_and_keeps_the_state_dict():
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Sequential(nn.Linear(64, 10)))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    params = list(model.parameters())
    assert uses_blas(model)
    assert reduced_linears(model) == ["2.0"]
    assert type(model[0]) is nn.Linear and type(model[2][0]) is ReducedLinear
    assert list(model.parameters()) == params  # the same tensors, not copies
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert uses_blas(model)  # the 64-output layer is left to cuBLAS
    assert reduced_linears(model, max_out=64) == ["0"] and not uses_blas(model)


def test_inductor_on_cpu_calls_no_matrix_product():
    """Compiled by Inductor on the CPU, forward and backward: with ``nn.Linear`` the generated
    code calls the library's matrix products, with ``ReducedLinear`` none, and the gradients are
    as close to float64 as ``nn.Linear``'s."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 10))
    x = torch.randn(32, 4, 4, 4)
    ref = copy.deepcopy(model).double()
    ref(x.double()).square().sum().backward()

    def compiled(m):
        m = copy.deepcopy(m)
        torch._dynamo.reset()
        f = torch.compile(m, dynamic=False, options={"fx_graph_cache": False})

        def step():
            f(x).square().sum().backward()
        _, code = run_and_get_code(step)
        return [p.grad.double() for p in m.parameters()], "\n".join(code)

    reduced = copy.deepcopy(model)
    assert reduced_linears(reduced) == ["1"]
    plain_grads, plain_code = compiled(model)
    grads, code = compiled(reduced)
    products = ("extern_kernels.mm(", "extern_kernels.addmm(")
    assert any(p in plain_code for p in products), "this PyTorch's code names no matrix product: the check shows nothing"
    assert not any(p in code for p in products)

    def err(gs):
        return max(((a - r.grad).abs().max() / r.grad.abs().max()).item() for a, r in zip(gs, ref.parameters()))
    assert err(grads) <= 2 * err(plain_grads) + 16 * torch.finfo(torch.float32).eps, (err(grads), err(plain_grads))


def test_the_plan_holds_no_blas_workspace_when_the_step_calls_no_product():
    """On CUDA with Inductor a 10-class classifier's step calls no cuBLAS product: the plan counts
    no BLAS workspace; with 1,000 classes, or without Inductor, it counts one set."""
    for classes, compile_mode, lib in ((10, "inductor", 0), (1000, "inductor", BLAS_WORKSPACE_BYTES),
                                        (10, "none", BLAS_WORKSPACE_BYTES)):
        c = compile_plan(small_config(device="cuda", amp=True, compile=compile_mode, num_classes=classes))
        assert c.library_workspace == lib, (classes, compile_mode)
        assert c.predicted_need == c.plan.total_bytes + c.activation_estimate + c.gradient_transient + lib


def test_prepared_for_cuda_with_inductor_only():
    """``prepare`` swaps it in where Inductor compiles the step on CUDA, and says so; not on the CPU."""
    from tr_hydra.compiler.analysis import find_first_convs
    from tr_hydra.models.registry import build_model
    from tr_hydra.runtime.model_prep import prepare
    for device, swapped in (("cuda", ["fc"]), ("cpu", [])):
        model, logs = build_model("resnet18_cifar", 10), []
        with torch.device("meta"):
            first = find_first_convs(build_model("resnet18_cifar", 10), 3)
        prepared = prepare(model, first, torch.device(device), True, True, False, log=logs.append)
        assert prepared.linears == swapped and uses_blas(model) == (not swapped)
        assert any(ln == "linear: fc computed as a reduction Inductor compiles: the step calls no cuBLAS "
                   "product and holds no cuBLAS workspace" for ln in logs) == bool(swapped), logs
