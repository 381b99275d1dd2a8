"""The space-to-depth stem: the same convolution as PyTorch's (float64, forward and both
gradients), the same state_dict, and training with it equals training with the plain conv."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from tr_hydra.config.epochs import epoch_schedule
from tr_hydra.models.stem import (ImageConv2d, SpaceToDepthConv2d, eligible, image_input_recomputed,
                                   space_to_depth_stem)
from tr_hydra.train.trainer import Trainer

from tests.helpers import assert_folding_keeps_the_logits, small_config


@pytest.mark.parametrize("k,p", [(7, 3), (3, 1), (4, 1), (5, 2), (1, 0), (2, 0), (6, 3)])
@pytest.mark.parametrize("hw", [(16, 16), (17, 15), (9, 22)])
@pytest.mark.parametrize("bias", [False, True])
def test_space_to_depth_conv_equals_conv2d(k, p, hw, bias):
    torch.manual_seed(k * 100 + p * 10 + hw[0])
    ref = nn.Conv2d(3, 8, k, 2, p, bias=bias).double()
    s2d = nn.Conv2d(3, 8, k, 2, p, bias=bias).double()
    s2d.load_state_dict(ref.state_dict())
    assert space_to_depth_stem(nn.Sequential(s2d), ["0"]) == ["0"]
    assert type(s2d) is SpaceToDepthConv2d
    x = torch.randn(2, 3, *hw, dtype=torch.float64, requires_grad=True)
    y_ref, y = ref(x), s2d(x)
    assert y.shape == y_ref.shape
    torch.testing.assert_close(y, y_ref, rtol=1e-12, atol=1e-12)
    go = torch.randn_like(y_ref)
    g_ref = torch.autograd.grad(y_ref, [x, ref.weight], go)
    g = torch.autograd.grad(y, [x, s2d.weight], go)
    for a, b in zip(g, g_ref):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    assert s2d.state_dict().keys() == ref.state_dict().keys()
    assert s2d.weight.shape == (8, 3, k, k)


@pytest.mark.parametrize("stride,k,p", [(2, 7, 3), (2, 3, 1), (1, 3, 1)])
@pytest.mark.parametrize("multiple", [8, 16, 5])
def test_a_stem_reading_zero_padded_channels_equals_conv2d(stride, k, p, multiple, monkeypatch):
    """A channel multiple: the convolution over the image (folded, at stride 2) reads its input
    and kernel with zero channels up to the multiple; output and both gradients equal PyTorch's
    conv in float64, the weight keeps its shape, and the channels read are the padded count."""
    torch.manual_seed(stride * 100 + k * 10 + multiple)
    ref = nn.Conv2d(3, 8, k, stride, p, bias=True).double()
    m = nn.Conv2d(3, 8, k, stride, p, bias=True).double()
    m.load_state_dict(ref.state_dict())
    convert = space_to_depth_stem if stride == 2 else image_input_recomputed
    assert convert(nn.Sequential(m), ["0"], multiple) == ["0"]
    assert type(m) is (SpaceToDepthConv2d if stride == 2 else ImageConv2d) and m.channel_multiple == multiple
    c = 12 if stride == 2 else 3
    assert m.read_channels() == -(-c // multiple) * multiple  # 12 -> 16 or 15, 3 -> 8 or 16 or 5
    seen = []
    real = F.conv2d

    def spy(x, w, *a, **kw):  # both modules end in F.conv2d (ImageConv2d through _conv_forward)
        seen.append((x.shape[1], w.shape[1]))
        return real(x, w, *a, **kw)
    x = torch.randn(2, 3, 15, 17, dtype=torch.float64, requires_grad=True)
    y_ref = ref(x)
    monkeypatch.setattr(F, "conv2d", spy)
    y = m(x)
    monkeypatch.undo()
    assert seen == [(m.read_channels(), m.read_channels())]
    torch.testing.assert_close(y, y_ref, rtol=1e-12, atol=1e-12)
    go = torch.randn_like(y_ref)
    for a, b in zip(torch.autograd.grad(y, [x, m.weight, m.bias], go),
                    torch.autograd.grad(y_ref, [x, ref.weight, ref.bias], go)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    assert m.weight.shape == (8, 3, k, k) and m.state_dict().keys() == ref.state_dict().keys()


def test_only_thin_stride_two_convs_qualify():
    assert eligible(nn.Conv2d(3, 64, 7, 2, 3))
    assert eligible(nn.Conv2d(4, 64, 3, 2, 1))
    assert not eligible(nn.Conv2d(3, 64, 3, 1, 1))            # stride 1 (the CIFAR stem)
    assert not eligible(nn.Conv2d(16, 64, 3, 2, 1))           # not thin
    assert not eligible(nn.Conv2d(4, 64, 3, 2, 1, groups=2))
    assert not eligible(nn.Conv2d(3, 64, 3, 2, 1, dilation=2))
    assert not eligible(nn.Conv2d(3, 64, 3, 2, (1, 0)))
    assert not eligible(nn.Conv2d(3, 64, 3, 2, 1, padding_mode="reflect"))
    assert not eligible(nn.Conv2d(3, 64, (3, 5), 2, 1))


def _trainer(tmp_path, stem, model, stem_channels=None, log=lambda *_: None):
    """A CPU trainer whose stem is computed as on CUDA: ``stem`` ``space_to_depth`` (folded) or
    ``conv`` (the model's own), reading its input padded to ``stem_channels`` (None: as is)."""
    from tr_hydra.models import stem as stem_mod
    from tr_hydra.runtime import model_prep
    pc = small_config(model=model, batch=8, train_size=24, val_size=8, res=32, val_res=32, lowres_res=32)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(model_prep, "stem_folded", lambda _t: stem == "space_to_depth")
        mp.setattr(stem_mod, "stem_channel_multiple", lambda *_a: stem_channels)
        return Trainer(pc, tmp_path / f"{stem}{stem_channels or ''}", log=log)


def _one_step(tmp_path, stem, model, stem_channels=None, log=lambda *_: None):
    tr = _trainer(tmp_path, stem, model, stem_channels, log)
    before = {k: v.clone() for k, v in tr.final_state_dict().items()}
    tr.run_steps(epoch_schedule(tr.pc, 0)[:1], "train")
    return tr, before, tr.final_state_dict()


def test_a_step_with_the_space_to_depth_stem_equals_the_plain_conv(tmp_path):
    """One momentum step of resnet18 (stem 7x7 stride 2) in fp32: every tensor's change, BN
    statistics included, within 1e-3 of the change PyTorch's conv gives (measured: <= 5e-5; a fold
    off by one pixel gives O(1)). Later steps are not compared: on 8-image batches BN's bias
    gradients nearly cancel, and fp32 rounding alone then moves them by percents."""
    tr, before, got = _one_step(tmp_path, "space_to_depth", "resnet18")
    assert tr.rt.prepared.stem_s2d == ["conv1"] and type(tr.model.conv1) is SpaceToDepthConv2d
    ref_tr, ref_before, want = _one_step(tmp_path, "conv", "resnet18")
    assert ref_tr.rt.prepared.stem_s2d == [] and type(ref_tr.model.conv1) is ImageConv2d
    assert got.keys() == want.keys()
    moved = 0
    for key, w in want.items():
        assert torch.equal(before[key], ref_before[key]), key  # same initial weights
        if key.endswith("num_batches_tracked"):
            assert int(got[key]) == int(w) == 1
            continue
        change = (w.double() - before[key].double()).norm()
        if change == 0:
            continue
        moved += 1
        err = ((got[key].double() - w.double()).norm() / change).item()
        assert err <= 1e-3, f"{key}: {err:.2e} of its change"
    assert moved > 50 and "conv1.weight" in got and got["conv1.weight"].shape == (64, 3, 7, 7)


@pytest.mark.parametrize("model,stem,reads", [("resnet18", "space_to_depth", 16), ("resnet18_cifar", "conv", 8)])
def test_a_step_reading_the_image_in_padded_channels_equals_the_plain_step(tmp_path, model, stem, reads):
    """A stem reading its input in zero-padded channels (as on CUDA with 16-bit autocast) in a
    trainer: the stem (folded, or CIFAR's plain 3x3) reads them, and one fp32 step moves every
    tensor as the unpadded step does (zero channels add exact zeros: the same sums; measured
    equal or within fp32 rounding)."""
    tr, before, got = _one_step(tmp_path, stem, model, 8 if reads == 8 else 16)
    assert tr.model.conv1.read_channels() == reads and tr.model.conv1.weight.shape[1] == 3
    assert tr.rt.prepared.stem_channels == (8 if reads == 8 else 16)
    _, ref_before, want = _one_step(tmp_path, stem, model)
    for key, w in want.items():
        assert torch.equal(before[key], ref_before[key]), key
        change = (w.double() - before[key].double()).norm()
        if w.is_floating_point() and change > 0:
            assert ((got[key].double() - w.double()).norm() / change).item() <= 1e-4, key


def test_stem_channels_pad_to_eight_only_on_cuda_with_16_bit_autocast():
    """A multiple of 8 on CUDA with amp, so ResNet-50's 12-channel fold reads 16 and a 3-channel
    image 8; the image as it is on CPU and in fp32. The fold itself only on CUDA."""
    from tr_hydra.models.stem import extra_channels, stem_channel_multiple
    from tr_hydra.runtime.model_prep import stem_folded
    assert stem_channel_multiple("cuda", True) == 8
    assert stem_channel_multiple("cpu", True) is None
    assert stem_channel_multiple("cuda", False) is None
    assert stem_folded("cuda") and not stem_folded("cpu")
    m = stem_channel_multiple("cuda", True)
    assert (12 + extra_channels(12, m), 3 + extra_channels(3, m), 16 + extra_channels(16, m)) == (16, 8, 16)


def test_the_cpu_keeps_the_conv_and_a_stride_one_stem_stays(tmp_path):
    pc = small_config(model="resnet18", batch=8, train_size=24, val_size=8, res=32, val_res=32, lowres_res=32)
    tr = Trainer(pc, tmp_path / "cpu", log=lambda *_: None)
    assert tr.rt.prepared.stem_s2d == [] and type(tr.model.conv1) is ImageConv2d
    tr = _trainer(tmp_path, "space_to_depth", "resnet18_cifar")  # 3x3 stride 1: nothing to fold
    assert tr.rt.prepared.stem_s2d == [] and type(tr.model.conv1) is ImageConv2d


def test_bn_folding_and_validation_read_the_folded_stem(tmp_path):
    """Validation with BN folded into the convs (the stem included) gives the logits of the
    plain model, and the trainer's validation equals an eager pass of the same weights."""
    from tr_hydra.runtime import model_prep
    pc = small_config(model="resnet18", batch=8, train_size=24, val_size=8, val_batch=8, res=32, val_res=32,
                      lowres_res=32, bn_folded=True)
    with pytest.MonkeyPatch.context() as mp:  # folded as on CUDA
        mp.setattr(model_prep, "stem_folded", lambda _t: True)
        tr = Trainer(pc, tmp_path, log=lambda *_: None)
    tr.fit()
    assert type(tr.model.conv1) is SpaceToDepthConv2d
    x = torch.randn(4, 3, 32, 32)
    assert_folding_keeps_the_logits(tr, x)
    ref = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
    ref.load_state_dict({"weight": tr.model.conv1.weight.detach().clone()})
    with torch.no_grad():
        torch.testing.assert_close(tr.model.conv1(x), ref(x), rtol=1e-5, atol=1e-5)


def _saved_for_backward(model, x):
    """What AOTAutograd's min-cut partitioner (the one Inductor runs) keeps for the backward of
    ``model(x)`` under bf16 autocast on CPU: [(is a graph input, shape, dtype)], and the
    gradients of one step."""
    import torch._inductor.lowering  # noqa: F401 (the decompositions refer to it)
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch._inductor.decomposition import select_decomp_table
    saved = []

    def fw(gm, _inputs):
        outs = next(n for n in gm.graph.nodes if n.op == "output").args[0]
        for a in outs[1:]:
            v = a.meta.get("val")
            if isinstance(v, torch.Tensor):
                saved.append((a.op == "placeholder", tuple(v.shape), v.dtype))
        return make_boxed_func(gm)
    backend = aot_autograd(fw_compiler=fw, bw_compiler=lambda gm, _i: make_boxed_func(gm),
                           partition_fn=min_cut_rematerialization_partition,
                           decompositions=select_decomp_table())
    torch._dynamo.reset()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = torch.compile(model, backend=backend, dynamic=False)(x)
    y.float().square().mean().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return saved, grads


@pytest.mark.parametrize("cls,stride", [(SpaceToDepthConv2d, 2), (ImageConv2d, 1)])
def test_compiled_stem_keeps_the_input_buffer_not_its_copy(cls, stride):
    """Compiled, the convolution over the image keeps the input (a view of the arena's fp16
    input buffer, free to keep) for its weight gradient, not the bf16 copy it reads (folded, for
    space-to-depth), which the backward recomputes. The gradients, against the plain conv
    compiled the same way over the image laid out as the stem's copy is (contiguous: NCHW on the
    CPU; over the NHWC view the plain conv's copy keeps that layout, and how far the two
    layouts' kernels land apart is the CPU's: 7.6e-8 on BN's weight gradient with AVX-512's
    oneDNN, 4e-3..7e-3 on the conv's with AVX2's bf16 fallback, measured): ``ImageConv2d`` (the same
    convolution) the same numbers; space-to-depth (the same sums in another order) within one
    bf16 step of each element. And those of eager autograd up to bf16 rounding: no further from
    the fp32 gradients (autocast off) than 2x eager autocast's or the plain conv's distance."""
    torch.manual_seed(0)
    conv = nn.Conv2d(3, 16, 7 if stride == 2 else 3, stride, 3 if stride == 2 else 1, bias=False)
    model = nn.Sequential(conv, nn.BatchNorm2d(16), nn.ReLU(), nn.Conv2d(16, 8, 3, 1, 1))
    buf = torch.randn(2, 20, 20, 4).to(torch.float16)  # NHWC, padded to 4 channels as planned
    x = buf[..., :3].permute(0, 3, 1, 2)
    want, fp32 = {}, {}
    for grads, autocast in ((want, True), (fp32, False)):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            model(x if autocast else x.float()).float().square().mean().backward()
        grads.update({n: p.grad.clone() for n, p in model.named_parameters()})
        model.zero_grad(set_to_none=True)
    plain, plain_grads = _saved_for_backward(model, x.contiguous())
    copy = [s for s in plain if not s[0] and s[2] == torch.bfloat16 and s[1][0] == 2 and s[1][1] in (3, 12)]
    assert copy  # the plain conv keeps its bf16 copy of the image (the reference behaviour)
    conv.__class__ = cls
    saved, got = _saved_for_backward(model, x)
    assert (True, (2, 3, 20, 20), torch.float16) in saved  # the input buffer itself
    assert not [s for s in saved if not s[0] and s[2] == torch.bfloat16 and s[1][0] == 2 and s[1][1] in (3, 12)]
    assert got.keys() == want.keys()
    rel = lambda a, b: ((a - b).norm() / b.norm()).item()
    for k, ref in plain_grads.items():
        if cls is ImageConv2d:
            assert torch.equal(got[k], ref), (k, (got[k] - ref).abs().max().item())
        else:  # the folded form: the same sums in another order (exact in float64, above)
            _, e = torch.frexp(ref)
            step = rel(ref + torch.ldexp(torch.ones_like(ref), e - 8), ref)  # bf16: 8 significant bits
            assert rel(got[k], ref) <= step, (k, rel(got[k], ref), step)
        bf16 = max(rel(want[k], fp32[k]), rel(ref, fp32[k]))
        assert rel(got[k], fp32[k]) <= 2 * bf16, (k, rel(got[k], fp32[k]), bf16)


def _compiled_kernels(stride, multiple):
    """Inductor's generated kernels for a compiled forward and backward of a stem over a
    view of an fp16 NHWC input buffer padded to 4 channels, under bf16 autocast (CPU)."""
    import re
    import warnings
    from torch._inductor.utils import run_and_get_code
    torch._dynamo.reset()
    m = nn.Conv2d(3, 8, 7 if stride == 2 else 3, stride, 3 if stride == 2 else 1, bias=False)
    (space_to_depth_stem if stride == 2 else image_input_recomputed)(nn.Sequential(m), ["0"], multiple)
    x = torch.randn(2, 20, 20, 4, dtype=torch.float16)[..., :3].permute(0, 3, 1, 2)
    f = torch.compile(lambda a: m(a), dynamic=False)

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = f(x)
        y.float().sum().backward()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, codes = run_and_get_code(step)
    return [sorted(set(re.findall(r"cpp_fused_\w+", c))) for c in codes]


@pytest.mark.parametrize("stride,multiple", [(2, 16), (1, 8)])
def test_the_zero_channels_cost_no_kernel_of_their_own(stride, multiple):
    """Compiled, the zero channels are written by the kernels that already copy the image (cast,
    fold) and the kernel: the forward and the backward (which recomputes the copy) have as many
    kernels with the padding as without, and the padding is inside them."""
    plain, padded = _compiled_kernels(stride, None), _compiled_kernels(stride, multiple)
    assert len(padded) == len(plain) == 2  # a forward and a backward
    assert [len(k) for k in padded] == [len(k) for k in plain]
    if stride == 1:  # the plain form has no pad at all: here each copy took it in
        assert all("constant_pad_nd" in name for name in padded[0])
        assert not any("constant_pad_nd" in name for ks in plain for name in ks)
