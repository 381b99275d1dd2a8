"""ReLU with a one-bit mask for its backward (``ops/relu_mask.py``), against ``torch.relu``
(eager autograd in float64, Inductor on the CPU)."""
from __future__ import annotations

import copy
import re

import pytest
import torch
import torchvision
from torch import nn
from torch._inductor.utils import run_and_get_code

from tests.helpers import triton_code_on_cpu
from tr_hydra.ops.relu_mask import BitmaskReLU, applies, bitmask_relus, pack, unpack


def cl(*shape, dtype=torch.float64):
    return torch.randn(*shape, dtype=dtype).to(memory_format=torch.channels_last)


def test_pack_and_unpack_by_hand():
    mask = torch.zeros(1, 16, 1, 2, dtype=torch.bool).to(memory_format=torch.channels_last)
    mask[0, [0, 3, 9, 15], 0, 1] = True
    packed = pack(mask)
    assert packed.dtype == torch.uint8 and packed.shape == (1, 1, 2, 2)
    assert packed[0, 0, 0].tolist() == [0, 0]
    assert packed[0, 0, 1].tolist() == [1 + 8, 2 + 128]  # channels 0 and 3; 9 and 15
    assert torch.equal(unpack(packed, mask.shape), mask)
    many = torch.rand(3, 24, 5, 7).to(memory_format=torch.channels_last) > 0.5
    assert torch.equal(unpack(pack(many), many.shape), many)


@pytest.mark.parametrize("channels_last", [True, False])
def test_same_output_and_gradient_as_relu_in_float64_with_nan(channels_last):
    torch.manual_seed(0)
    x = cl(2, 16, 5, 6) if channels_last else torch.randn(2, 16, 5, 6, dtype=torch.float64)
    x[0, 3, 1, 1] = float("nan")
    x[1, 8, 2, 2] = 0.0
    g = cl(2, 16, 5, 6)
    a = x.clone().requires_grad_()
    b = x.clone().requires_grad_()
    assert applies(b)
    ya, yb = torch.relu(a), BitmaskReLU()(b)
    assert torch.equal(ya.nan_to_num(7.0), yb.nan_to_num(7.0))
    ya.backward(g)
    yb.backward(g)
    assert torch.equal(a.grad.nan_to_num(7.0), b.grad.nan_to_num(7.0))


@pytest.mark.parametrize("case", ["channels", "no_grad", "3d"])
def test_other_inputs_take_torch_relu(case):
    x = {"channels": cl(2, 12, 4, 4), "no_grad": cl(2, 16, 4, 4), "3d": torch.randn(2, 16, 4)}[case]
    if case != "no_grad":
        x.requires_grad_()
    assert not applies(x)
    assert torch.equal(BitmaskReLU()(x), torch.relu(x))


def test_swaps_every_relu_and_keeps_the_state_dict():
    m = torchvision.models.resnet18()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    names = bitmask_relus(m)
    assert names == ["relu"] + [f"layer{i}.{j}.relu" for i in range(1, 5) for j in range(2)]
    assert not any(type(x) is nn.ReLU for x in m.modules())
    after = m.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


def blocks() -> nn.Module:
    down = nn.Sequential(nn.Conv2d(64, 256, 1, bias=False), nn.BatchNorm2d(256))
    return nn.Sequential(torchvision.models.resnet.Bottleneck(64, 64, downsample=down),
                         torchvision.models.resnet.Bottleneck(256, 64))


def compiled_grads(model, x, options):
    m = copy.deepcopy(model)
    torch._dynamo.reset()
    f = torch.compile(m, dynamic=False, options=options)

    def step():
        y = f(x)
        (y * y).sum().backward()

    _, code = run_and_get_code(step)
    return [p.grad.double() for p in m.parameters()], code


def buffers(module: str, dtype: str) -> int:
    """The buffers of ``dtype`` that a generated module's ``call`` allocates."""
    start = module.rfind("def call")  # the wrapper's, after any kernel's own
    end = min(i for i in (module.find("def get_args", start), module.find("def benchmark_compiled_module", start),
                          len(module)) if i >= 0)
    return len(re.findall(rf"empty_strided\w*\([^\n]*torch\.{dtype}\)", module[start:end]))


def test_blocks_compiled_on_cpu_keep_the_bits_and_the_gradients():
    """Two Bottlenecks under Inductor on the CPU: the backward gets the packed masks from the
    forward (it packs nothing itself), and the gradients are as close to float64 as with
    ``torch.relu``."""
    torch.manual_seed(0)
    model = blocks().to(memory_format=torch.channels_last)
    x = cl(4, 64, 16, 16, dtype=torch.float32)
    ref_model = copy.deepcopy(model).double()
    ref_model(x.double()).square().sum().backward()
    ref = [p.grad for p in ref_model.parameters()]
    masked = copy.deepcopy(model)
    assert len(bitmask_relus(masked)) == 2
    opts = {"fx_graph_cache": False}
    plain, _ = compiled_grads(model, x, opts)
    bits, code = compiled_grads(masked, x, opts)
    forward, backward = code  # the generated modules: the forward, then the backward
    # the forward packs each call's mask into a uint8 buffer of its own and keeps no unpacked
    # mask (a bool buffer); the backward reads the packed masks and packs nothing
    assert buffers(forward, "uint8") == 6 and buffers(forward, "bool") == 0
    assert buffers(backward, "uint8") == 0 and "uint8_t" in backward

    def err(gs):
        return max(((a - r).abs().max() / r.abs().max()).item() for a, r in zip(gs, ref))

    assert err(bits) <= 2 * err(plain) + 16 * torch.finfo(torch.float32).eps, (err(bits), err(plain))


def launches(module: str) -> int:
    """Kernel launches in a generated Triton module's ``call``."""
    return len(re.findall(r"\btriton_\w+\.run\(", module[module.rfind("def call"):]))


def test_the_triton_forward_packs_in_the_batchnorm_kernel():
    """Inductor's Triton code, the code CUDA runs, generated on the CPU (not run): with the masks
    the forward launches as many kernels as with ``torch.relu`` (BatchNorm, the packing and the
    output in one), keeps a uint8 buffer per call and no bool one, and the backward packs
    nothing."""
    model = blocks().to(memory_format=torch.channels_last)
    x = cl(8, 64, 16, 16, dtype=torch.float32)

    def code(m):
        with triton_code_on_cpu() as codes:
            torch._dynamo.reset()
            f = torch.compile(m, dynamic=False)
            with torch.autocast("cpu", torch.bfloat16):
                y = f(x)
            y.float().square().sum().backward()
        torch._dynamo.reset()
        return codes

    plain = code(copy.deepcopy(model))
    masked = copy.deepcopy(model)
    bitmask_relus(masked)
    forward, backward = code(masked)
    assert launches(forward) == launches(plain[0]) > 0, (launches(forward), launches(plain[0]))
    assert buffers(forward, "uint8") == 6 and buffers(forward, "bool") == 0
    assert buffers(backward, "uint8") == 0 and "'*u8'" in backward


def test_the_trainer_swaps_them_where_the_step_is_compiled_on_cuda(tmp_path, monkeypatch):
    """Through the trainer (as on CUDA with Inductor; here eager on the CPU): resnet18's nine
    ReLU modules are swapped, the swap is logged, and a step trains."""
    from tests.helpers import small_config
    from tr_hydra.ops import swaps
    from tr_hydra.ops.relu_mask import BitmaskReLU
    from tr_hydra.train.trainer import Trainer
    monkeypatch.setattr(swaps, "swaps_step_ops", lambda *a: True)
    logs = []
    pc = small_config(model="resnet18", max_steps=1, res=32, val_res=32, lowres_res=32, batch=8,
                      train_size=24, val_size=8, val_batch=8)
    tr = Trainer(pc, tmp_path, log=logs.append)
    before = {k: v.clone() for k, v in tr.model.state_dict().items()}
    tr.fit()
    assert sum(isinstance(m, BitmaskReLU) for m in tr.model.modules()) == 9
    assert "ReLU: 9 modules' backward reads a one-bit mask" in logs, logs
    after = tr.final_state_dict()
    assert all(torch.isfinite(v).all() for v in after.values() if v.is_floating_point())
    assert not torch.equal(after["conv1.weight"], before["conv1.weight"])
