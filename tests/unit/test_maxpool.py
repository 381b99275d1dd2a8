"""Max pooling with a backward that gathers each input element's gradient
from the windows holding it, against PyTorch's own max pooling (eager autograd, Inductor)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.helpers import assert_second_process_hits_aot_cache, small_config
from tr_hydra.ops.swaps import swaps_step_ops
from tr_hydra.ops.maxpool import (GatherMaxPool2d, eligible, gather_maxpools, indices_to_offsets,
                                  offsets_to_indices)
from tr_hydra.train.trainer import Trainer

GEOMETRIES = [((2, 5, 13, 11), (3, 2, 1)), ((3, 4, 8, 8), (2, 2, 0)), ((2, 3, 9, 10), (3, 1, 1)),
              ((1, 2, 7, 7), (5, 3, 2)), ((2, 6, 12, 12), (3, 3, 0))]


def _inputs(shape, ties: bool) -> torch.Tensor:
    x = torch.randn(shape, dtype=torch.float64)
    # after a ReLU a window is often all zeros; small integers make ties among positive values too
    return torch.randint(0, 3, shape).double() if ties else x.relu()


@pytest.mark.parametrize("shape,geom", GEOMETRIES)
@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("channels_last", [False, True])
def test_values_and_gradient_equal_pytorchs(shape, geom, ties, channels_last):
    """Forward values and the input's gradient equal F.max_pool2d's (float64, exactly), ties
    included: the gradient goes where PyTorch's indices send it."""
    torch.manual_seed(0)
    k, s, p = geom
    x = _inputs(shape, ties)
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = F.max_pool2d(a, k, s, p), GatherMaxPool2d(k, s, p)(b)
    g = torch.randn_like(ya)
    ya.backward(g)
    yb.backward(g)
    assert torch.equal(ya, yb)
    assert torch.equal(a.grad, b.grad)


def test_offsets_are_a_byte_per_output_and_give_pytorchs_indices_back():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 15, 13)
    for k, s, p in ((3, 2, 1), (2, 2, 0), (5, 1, 2)):
        _, idx = F.max_pool2d(x, k, s, p, return_indices=True)
        off = indices_to_offsets(idx, 13, k, s, p)
        assert off.dtype == torch.int8 and int(off.min()) >= 0 and int(off.max()) < k * k
        assert torch.equal(offsets_to_indices(off, 13, k, s, p), idx)


def test_without_grad_it_is_plain_max_pooling():
    x = torch.randn(2, 3, 9, 9)
    with torch.no_grad():
        assert torch.equal(GatherMaxPool2d(3, 2, 1)(x), F.max_pool2d(x, 3, 2, 1))
    assert torch.equal(GatherMaxPool2d(3, 2, 1)(x[0]), F.max_pool2d(x[0], 3, 2, 1))  # unbatched: PyTorch's


def test_only_the_poolings_it_covers_are_swapped():
    import torchvision
    m = torchvision.models.resnet18()
    assert gather_maxpools(m) == ["maxpool"] and isinstance(m.maxpool, GatherMaxPool2d)
    assert (m.maxpool.kernel_size, m.maxpool.stride, m.maxpool.padding) == (3, 2, 1)
    assert eligible(nn.MaxPool2d(2)) and eligible(nn.MaxPool2d((3, 3), (2, 2), (1, 1)))
    for other in (nn.MaxPool2d(3, 2, 1, ceil_mode=True), nn.MaxPool2d(3, 2, 1, dilation=2),
                  nn.MaxPool2d(3, 2, 1, return_indices=True), nn.MaxPool2d((3, 2), 2), nn.MaxPool2d(12),
                  nn.AvgPool2d(3), nn.MaxPool1d(3)):
        assert not eligible(other), other
    assert gather_maxpools(nn.Sequential(nn.Conv2d(3, 3, 3), nn.MaxPool2d(2, ceil_mode=True))) == []


def test_it_is_used_on_cuda_with_inductor_only():
    from tr_hydra.compiler.compile import inductor_wanted

    def used(device_type: str, compile: str) -> bool:
        return swaps_step_ops(device_type, inductor_wanted(small_config(compile=compile), device_type))
    assert used("cuda", "auto") and used("cuda", "inductor")
    assert not used("cuda", "none") and not used("cpu", "auto")
    assert not used("cpu", "inductor") and not used("cpu", "none")


def test_inductor_compiles_it_to_pytorchs_gradients():
    """The module under torch.compile (Inductor on the CPU: the op's PyTorch backward, traced
    through) gives the eager model's gradients, BatchNorm and ReLU before the pooling as in
    ResNet's stem."""
    def model():
        torch.manual_seed(0)
        return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
                             nn.MaxPool2d(3, 2, 1), nn.Conv2d(8, 4, 3), nn.Flatten(), nn.Linear(4 * 7 * 7, 5)).double()
    ref, m = model(), model()
    assert gather_maxpools(m) == ["3"]
    x = torch.randn(4, 3, 17, 17, dtype=torch.float64)
    torch._dynamo.reset()
    ref(x).square().sum().backward()
    torch.compile(m, dynamic=False)(x).square().sum().backward()
    for (k, a), (_, b) in zip(ref.named_parameters(), m.named_parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-9, atol=1e-12, msg=k)
    torch._dynamo.reset()


def test_the_kernel_matches_pytorchs_backward_in_the_triton_interpreter():
    pytest.importorskip("triton")
    root = Path(__file__).parents[2]
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH")) if p))
    out = subprocess.run([sys.executable, str(Path(__file__).with_name("_maxpool_check.py")), "cpu"],
                         capture_output=True, text=True, env=env, timeout=600, cwd=root)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stdout + out.stderr[-3000:]


def test_trainer_with_gather_trains_as_with_the_models_own_pooling(tmp_path, monkeypatch):
    """The gathering max pooling through the trainer (as on CUDA with Inductor; here eager on the
    CPU, resnet18 with its stem's pooling): three steps end where the model's own pooling's do,
    and the swap is logged."""
    from tr_hydra.ops import maxpool, reduced_linear, relu_mask, swaps
    # the last linear layer as a reduction sums in another order, which BatchNorm amplifies past
    # this comparison's tolerance in three steps: it is tested on its own (test_reduced_linear)
    monkeypatch.setattr(reduced_linear, "reduced_linears", lambda model, **_: [])
    out, logs = {}, []
    for mode in ("native", "gather"):
        torch.manual_seed(0)
        pc = small_config(model="resnet18", max_steps=3, res=32, val_res=32, lowres_res=32, batch=8,
                          train_size=24, val_size=8, val_batch=8)
        monkeypatch.setattr(swaps, "swaps_step_ops", lambda *a, _on=mode == "gather": _on)
        # the ReLUs it swaps too (ops.relu_mask) change the backward's summation order, which
        # BatchNorm over layer 4's 8 values per channel amplifies: that swap is tested on its own
        monkeypatch.setattr(relu_mask, "bitmask_relus", lambda model, **_: [])
        tr = Trainer(pc, tmp_path / mode, log=logs.append)
        tr.fit()
        out[mode] = tr.final_state_dict()
        assert any(isinstance(m, maxpool.GatherMaxPool2d) for m in tr.model.modules()) == (mode == "gather")
    assert any(str(ln).startswith("max pooling: maxpool's backward gathers") for ln in logs), logs
    assert out["gather"].keys() == out["native"].keys()
    for k, ref in out["native"].items():
        torch.testing.assert_close(out["gather"][k], ref, rtol=1e-5, atol=1e-6, msg=k)


_CACHE_PROBE = """
import torch, torch.nn as nn
from torch._dynamo.utils import counters
from tr_hydra.ops.maxpool import gather_maxpools
from tr_hydra.ops.relu_mask import bitmask_relus
torch.manual_seed(0)
m = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(3, 2, 1),
                  nn.Conv2d(8, 4, 3), nn.Flatten(), nn.Linear(4 * 7 * 7, 5))
assert gather_maxpools(m) == ["3"] and bitmask_relus(m) == ["2"]
torch.compile(m, dynamic=False)(torch.randn(4, 3, 17, 17).requires_grad_()).sum().backward()
print("AOT", sorted(counters["aot_autograd"]))
"""


def test_its_compile_is_cached_for_the_next_process(tmp_path):
    """A second process compiling the same model, with the gathering pooling and ReLU's packed
    mask (``ops.relu_mask``), loads AOTAutograd's cached result, as the parallel compiles'
    children and the trainer rely on. (With an ``autograd.Function`` the cache was bypassed, and
    the trainer redid each child's compile: measured on the H200.)"""
    assert_second_process_hits_aot_cache(_CACHE_PROBE, tmp_path)


def test_the_plan_counts_a_byte_per_pooled_output_where_the_runner_gathers():
    """tr-plan's activation estimate follows the swap: with the gathering backward (on CUDA with
    Inductor) the pooling keeps each maximum's place as one byte, where PyTorch's keeps 8-byte
    indices (eager on CUDA); the rest is the same. (On the H200 at batch 256 the measured peak
    fell by 392 MiB, the size of those indices.)"""
    from tr_hydra.compiler.compile import compile_plan
    est = {}
    for mode in ("auto", "none"):
        pc = small_config(model="resnet18", device="cuda", compile=mode, batch=8, res=64, val_res=64,
                          lowres_res=64, train_size=16, val_size=8, val_batch=8)
        est[mode] = compile_plan(pc, fused=False).shapes["train_base"].saved_activation_bytes
    pooled = 8 * 64 * 16 * 16  # 64x64 -> conv1 32x32 -> maxpool 16x16
    # and the ReLUs keep one bit per element (ops.relu_mask) where ReLU kept its output for
    # itself: the stem's (fp32, 8x64x32x32, read by the pooling only) and the last one's (8x512x2x2,
    # read by the average pooling only); the others' outputs the next convolution keeps anyway
    masks = 8 * (64 * 32 * 32 + 4 * 64 * 16 * 16 + 4 * 128 * 8 * 8 + 4 * 256 * 4 * 4 + 4 * 512 * 2 * 2) // 8
    assert est["none"] - est["auto"] == pooled * (8 - 1) + 8 * 64 * 32 * 32 * 4 + 8 * 512 * 2 * 2 * 4 - masks
