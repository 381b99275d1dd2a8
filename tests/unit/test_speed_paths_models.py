"""The ResNet-derived speed paths on torchvision models beyond ResNets: each applies exactly where
the model has its pattern and is off elsewhere, says which in ``prepare``'s notes, and keeps the
numbers. ``prepare`` is called as on CUDA with Inductor (the only place it applies the paths) on
a CPU model: every swapped op has a CPU form (the pooling's gather and the masks' packing run
as plain torch there)."""
from __future__ import annotations

import copy

import pytest
import torch
import torchvision
from torch import nn

from tr_hydra.compiler.analysis import find_first_convs
from tr_hydra.models.stem import ImageConv2d, SpaceToDepthConv2d
from tr_hydra.ops.maxpool import GatherMaxPool2d
from tr_hydra.ops.reduced_linear import ReducedLinear
from tr_hydra.ops.relu_mask import BitmaskReLU
from tr_hydra.runtime.model_prep import NCHWConv2d, nchw_compute_on_cpu, prepare


def relus(model, keep=lambda name: True):
    return [n for n, m in model.named_modules() if type(m) is nn.ReLU and keep(n)]


def regnet_relus(model):
    """Every ReLU but the squeeze-excitation ones whose input has channels not a multiple of 8."""
    thin = {f"{n}.activation" for n, m in model.named_modules()
            if isinstance(m, torchvision.ops.SqueezeExcitation) and m.fc1.out_channels % 8}
    assert thin  # regnet_y_1_6gf has both kinds
    return relus(model, lambda n: n not in thin)


RESNET = dict(stem=["conv1"], pools=["maxpool"], relus=relus, linears=["fc"])
# hand-derived from torchvision's definitions: (stem convolutions in space-to-depth form, max
# poolings, ReLUs, linear layers as reductions)
EXPECTED = {
    "resnet101": RESNET, "resnet152": RESNET, "resnext50_32x4d": RESNET, "wide_resnet50_2": RESNET,
    # 3x3 stride-2 stem + BN + ReLU; squeeze-excitation ReLUs over (N, C, 1, 1)
    "regnet_y_1_6gf": dict(stem=["stem.0"], pools=[], relus=regnet_relus, linears=["fc"]),
    # ReLU6 only (not nn.ReLU), no pooling; Dropout before the classifier's linear layer
    "mobilenet_v2": dict(stem=["features.0.0"], pools=[], relus=[], linears=["classifier.1"]),
    # Hardswish stem; in-place ReLUs in its blocks, ReLUs in squeeze-excitation; two linear layers
    "mobilenet_v3_large": dict(stem=["features.0.0"], pools=[], relus=relus, linears=["classifier.3"]),
    # SiLU everywhere
    "efficientnet_b0": dict(stem=["features.0.0"], pools=[], relus=[], linears=["classifier.1"]),
    "efficientnet_v2_s": dict(stem=["features.0.0"], pools=[], relus=[], linears=["classifier.1"]),
    # MaxPool2d(3, 2, 1) at the stem; in-place ReLUs after each BatchNorm
    "densenet121": dict(stem=["features.conv0"], pools=["features.pool0"], relus=relus, linears=["classifier"]),
    # 4x4 stride-4 stem, GELU, the blocks' linear layers over (N, H, W, C)
    "convnext_tiny": dict(stem=[], pools=[], relus=[], linears=["classifier.2"]),
}
OFF = {  # the notes of the paths each family has no pattern for
    "regnet_y_1_6gf": ["max pooling: off, no nn.MaxPool2d in the model"],
    "mobilenet_v2": ["max pooling: off, no nn.MaxPool2d in the model", "ReLU: off, no nn.ReLU in the model"],
    "efficientnet_b0": ["ReLU: off, no nn.ReLU in the model"],
    "convnext_tiny": ["stem: off, no stride-2 convolution over the image (features.0.0: 4x4 stride 4): plain "
                      "convolution, its input zero-padded to a multiple of 8 channels (16-bit autocast)",
                      "max pooling: off, no nn.MaxPool2d in the model", "ReLU: off, no nn.ReLU in the model"],
}


def prepared_as_on_cuda(model):
    """``prepare``'s CUDA set-up of ``model``, here on the CPU, the convolutions then computed in
    NCHW as ``prepare`` has them on the CPU: the packed ReLU's output has channels-last strides,
    and PyTorch's CPU channels-last convolutions round worse than its NCHW ones
    (``nchw_compute_on_cpu``), which would be measured instead of the swaps."""
    first = find_first_convs(copy.deepcopy(model).to("meta"), 3)
    out = prepare(model, first, torch.device("cuda"), True, True, False, log=lambda *_: None)
    nchw_compute_on_cpu(model)
    return out


def grads(model, x, g):
    x = x.clone().requires_grad_()
    y = model(x)
    y.backward(g)
    return [y.detach(), x.grad] + [p.grad for p in model.parameters()]


def rel(a, b):
    return ((a.double() - b).norm() / b.norm().clamp_min(1e-300)).item()


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_each_path_where_the_model_has_its_pattern_and_the_same_numbers(name):
    torch.manual_seed(0)
    plain = getattr(torchvision.models, name)(num_classes=10).eval()
    model = copy.deepcopy(plain)
    out = prepared_as_on_cuda(model)
    want = EXPECTED[name]
    want_relus = want["relus"](plain) if callable(want["relus"]) else want["relus"]
    assert out.stem_s2d == want["stem"]
    assert out.maxpools == want["pools"]
    assert out.relus == want_relus and want_relus == [n for n, m in model.named_modules() if type(m) is BitmaskReLU]
    assert out.linears == want["linears"]
    kinds = {GatherMaxPool2d: want["pools"], ReducedLinear: want["linears"]}
    for cls, names in kinds.items():
        assert [n for n, m in model.named_modules() if type(m) is cls] == names
    first = find_first_convs(copy.deepcopy(plain).to("meta"), 3)
    assert first and all(type(m) in (SpaceToDepthConv2d, ImageConv2d) for n, m in model.named_modules() if n in first)
    # every other module is left as it was
    plain_types = {n: type(m) for n, m in plain.named_modules()}
    changed = set(out.stem_s2d) | set(out.maxpools) | set(out.relus) | set(out.linears)
    assert all(type(m) is plain_types[n] or type(m) is NCHWConv2d for n, m in model.named_modules()
               if n in plain_types and n not in changed and not isinstance(m, ImageConv2d)), name
    notes = [line for _, line in out.notes]
    assert len(notes) == 4 and all(on == bool(line.split(": ", 1)[1][:4] != "off,") for on, line in out.notes)
    for line in OFF.get(name, []):
        assert line in notes, notes
    if name == "mobilenet_v3_large":
        assert "classifier.0 (more than 16 outputs) stays a cuBLAS product" in notes[-1], notes

    # the same numbers: the swapped model's fp32 forward and gradients as close to float64 as the
    # plain model's (the same computation in fp32), up to summation order
    x = torch.randn(2, 3, 32, 32)
    g = torch.randn(2, 10)
    ref = grads(copy.deepcopy(plain).double(), x.double(), g.double())
    base = grads(plain, x, g)
    mine = grads(model, x, g)
    eps = torch.finfo(torch.float32).eps
    for i, (a, b, r) in enumerate(zip(mine, base, ref)):
        if r is None:
            assert a is None and b is None
            continue
        assert rel(a, r) <= 8 * rel(b, r) + 64 * eps, (name, i, rel(a, r), rel(b, r))


class _ReadTwice(nn.Module):
    """An in-place ReLU whose input is read again after it: the in-place write is seen."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, 2, 1, bias=False)
        self.bn = nn.BatchNorm2d(8)
        self.relu = nn.ReLU(inplace=True)
        self.relu2 = nn.ReLU(inplace=True)
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        y = self.bn(self.conv(x))
        z = y[:, :8]  # a view of y, read after y's ReLU
        out = self.relu(y)
        out = out + z
        return self.fc(self.relu2(out).mean((2, 3)))


class _LinearOverPixels(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 4, 4)
        self.pool = nn.MaxPool2d(3, 2, 1, ceil_mode=True)
        self.mix = nn.Linear(8, 8)  # over (N, H, W, C): not a classifier's head
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        y = self.mix(self.pool(self.conv(x)).permute(0, 2, 3, 1))
        return self.fc(y.mean((1, 2)))


def test_a_module_the_path_cannot_handle_is_left_alone_and_named():
    torch.manual_seed(0)
    plain = _ReadTwice().eval()
    model = copy.deepcopy(plain)
    out = prepared_as_on_cuda(model)
    assert out.relus == ["relu2"] and type(model.relu) is nn.ReLU
    assert out.skipped["relu"] == {"relu": "in place, its input read elsewhere"}
    assert "ReLU: 1 modules' backward reads a one-bit mask; relu (in place, its input read elsewhere) keeps torch.relu" \
        in [line for _, line in out.notes]
    x = torch.randn(2, 3, 16, 16)
    torch.testing.assert_close(model(x), plain(x))  # the in-place write seen, as in the plain model

    model = _LinearOverPixels()
    out = prepared_as_on_cuda(model)
    assert out.stem_s2d == [] and out.maxpools == [] and out.linears == ["fc"]
    assert out.skipped["linear"] == {"mix": "input not 2-D"} and out.skipped["maxpool"] == {"pool": "ceil_mode"}
    notes = [line for _, line in out.notes]
    assert "max pooling: off, pool (ceil_mode): PyTorch's backward" in notes, notes
    assert "stem: off, no stride-2 convolution over the image (conv: 4x4 stride 4): plain convolution, its input " \
           "zero-padded to a multiple of 8 channels (16-bit autocast)" in notes, notes
