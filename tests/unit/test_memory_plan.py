"""Slot rule, hand-computed layouts, the four validations, region counts against torchvision."""
from __future__ import annotations

import itertools

import pytest
import torch.nn as nn
import torchvision

from tr_hydra.compiler.analysis import map_model
from tr_hydra.compiler.compile import build_plan
from tr_hydra.errors import (AlignmentError, ContiguityError, LayerCorrespondenceError, PlanError,
                             PlanLockedError, RegionOrderError)
from tr_hydra.memory.dtensor import DType, slot_bytes_for
from tr_hydra.memory.plan import MemoryPlan, PlanConditions
from tr_hydra.memory.regions import ALL_REGIONS, MATRIX_KINDS, NUM_REGIONS, PARAM_KINDS, Region as R, series_span

from tests.helpers import small_config



def twin_elements(plan: MemoryPlan, series_a: str, series_b: str, kinds) -> tuple[int, int]:
    """Element counts of the same kinds' spans in two series (equal for fp32/16-bit twins)."""
    kinds = tuple(kinds)
    def elems(series):
        start, end = series_span(series, kinds)
        _, nbytes = plan.region_range(start, end)
        item = 2 if series in ("A", "G16", "E16") else 4
        return nbytes // item
    return elems(series_a), elems(series_b)

def test_region_enum_matches_design():
    assert len(ALL_REGIONS) == 68 and NUM_REGIONS == 69
    assert R.DEFAULT is R.B_PREV_MEAN
    assert R.B_PREV_MEAN.number == "001" and R.R_RESULT_ACCUMULATED.number == "068"
    assert R.R_RESULT.number == "031" and R.I_A_LABEL.number == "050" and R.S_MASK.number == "062"
    # R_RESULT sits between the fp32 and 16-bit gradients: one clear covers both and the results
    assert R.G_DEEP_CONV < R.R_RESULT < R.G_FC_WEIGHT_FP16


@pytest.mark.parametrize("shape,dtype,region,expected", [
    # 16-bit: align256(elems*2 + 16)
    ((1, 1, 1, 1), DType.FP16, R.A_FC_WEIGHT, 256),
    ((1, 1, 1, 120), DType.FP16, R.A_FC_WEIGHT, 256),        # 240 + 16 = 256
    ((1, 1, 1, 121), DType.FP16, R.A_FC_WEIGHT, 512),        # 242 + 16 = 258 -> 512
    ((64, 3, 3, 3), DType.FP16, R.A_FIRST_CONV, 3584),       # 1728*2+16 = 3472 -> 3584
    # fp32 / int32: exactly twice the 16-bit slot
    ((64, 3, 3, 3), DType.FP32, R.W_FIRST_CONV, 7168),
    ((1, 1, 1, 64), DType.FP32, R.W_BN_BIAS, 512),            # 2*align256(144)
    ((4, 1, 1, 1), DType.INT32, R.I_A_LABEL, 512),
    # int8: align256(elems + 16); S_MASK pads C to 8
    ((1, 1, 1, 300), DType.INT8, R.T_TEMP_INT8, 512),         # 316 -> 512
    ((1, 1, 1, 68), DType.INT8, R.S_MASK, 256),               # 72 + 16 = 88 -> 256
    ((16, 1, 1, 3), DType.INT8, R.S_MASK, 256),               # C 3->8: 128 + 16 = 144 -> 256
    # 16-bit input data pads C to 4; 16-bit F pads C to 8
    ((2, 8, 8, 3), DType.FP16, R.I_A_DATA, 1280),             # 2*8*8*4 = 512 el: 1040 -> 1280
    ((2, 8, 8, 3), DType.FP32, R.I_A_DATA, 2 * 1024),         # fp32 not padded: 384*2+16 -> 1024
])
def test_slot_rule_hand_computed(shape, dtype, region, expected):
    assert slot_bytes_for(shape, dtype, region) == expected


def test_slot_rule_f_region_pads_to_eight():
    # logits [32,1,1,10] 16-bit in F: C 10 -> 16: 512 el * 2 + 16 = 1040 -> 1280
    assert slot_bytes_for((32, 1, 1, 10), DType.FP16, R.F_FEATURE_FP16) == 1280
    # the same tensor fp32 in F_FEATURE_FP32 is not padded: 2 * align256(320*2+16) = 2*768
    assert slot_bytes_for((32, 1, 1, 10), DType.FP32, R.F_FEATURE_FP32) == 1536


def test_small_plan_offsets_hand_computed():
    p = MemoryPlan(PlanConditions(optimizer="momentum"))
    p.alloc_bn_stats("bn.running_mean", "bn.running_var", 8)       # B_PREV_MEAN / B_PREV_VAR
    w_bias = p.alloc_bn_bias("bn.bias", 8)                          # W_BN_BIAS
    w_wt = p.alloc_bn_weight("bn.weight", 8)                        # W_BN_WEIGHT
    conv = p.alloc_first_conv("conv.weight", 8, 3, 3, 3)            # W_FIRST_CONV: 216 el
    deep = p.alloc_deep_conv("deep.weight", 16, 8, 3, 3)            # W_DEEP_CONV: 1152 el
    for t in (w_bias, w_wt, conv, deep):
        p.alloc_twin("G", t)
    for t in (w_bias, w_wt, conv, deep):
        p.alloc_twin("M", t)
    p.finalize()
    vec = 2 * 256                         # 8 fp32: 2*align256(16+16)
    conv_slot = 2 * 512                   # 216*2+16 = 448 -> 512, x2
    deep_slot = 2 * 2560                  # 1152*2+16 = 2320 -> 2560, x2
    assert p["bn.running_mean"].offset == 0
    assert p["bn.running_var"].offset == vec
    assert p["bn.bias"].offset == 2 * vec
    assert p["bn.weight"].offset == 3 * vec
    assert p["conv.weight"].offset == 4 * vec
    assert p["deep.weight"].offset == 4 * vec + conv_slot
    g0 = 4 * vec + conv_slot + deep_slot
    assert p["grad.bn.bias"].offset == g0
    assert p["grad.deep.weight"].offset == g0 + 2 * vec + conv_slot
    m0 = g0 + 2 * vec + conv_slot + deep_slot
    assert p["m.bn.bias"].offset == m0
    assert p.total_bytes == m0 + 2 * vec + conv_slot + deep_slot
    assert p.region_range(R.G_BN_BIAS, R.G_DEEP_CONV) == (g0, 2 * vec + conv_slot + deep_slot)
    # empty regions in between take no bytes
    assert p.region_size[R.E_BN_BIAS] == 0 and p.region_base[R.E_BN_BIAS] == g0
    with pytest.raises(PlanLockedError):
        p.alloc_bn_bias("late", 4)


def test_disabled_region_refuses_allocation():
    p = MemoryPlan(PlanConditions(optimizer="sgd"))
    t = p.alloc_fc_weight("fc.weight", 10, 4)
    with pytest.raises(PlanError, match="M_FC_WEIGHT is not populated"):
        p.alloc_twin("M", t)


def _tiny_plan(**cond) -> MemoryPlan:
    p = MemoryPlan(PlanConditions(**cond))
    ts = [p.alloc_bn_bias("bn.bias", 8), p.alloc_fc_weight("fc.weight", 10, 8),
          p.alloc_deep_conv("c.weight", 8, 8, 3, 3)]
    for s in ("G", "M"):
        for t in ts:
            p.alloc_twin(s, t)
    return p


def test_region_order_validation_fires():
    p = _tiny_plan(optimizer="momentum").finalize()
    p.region_base[R.W_FC_WEIGHT] = p.region_base[R.W_FC_BIAS] - 256
    with pytest.raises(RegionOrderError, match="W_FC_WEIGHT"):
        p.validate()


def test_contiguity_validation_fires():
    p = _tiny_plan(optimizer="momentum").finalize()
    p["grad.c.weight"].offset += 256  # a gap inside G_DEEP_CONV
    with pytest.raises(ContiguityError, match="G_DEEP_CONV.*grad.c.weight"):
        p.validate()


def test_layer_correspondence_validation_fires():
    p = MemoryPlan(PlanConditions(optimizer="momentum"))
    w = p.alloc_deep_conv("c.weight", 8, 8, 3, 3)
    p.alloc_twin("G", w)
    with pytest.raises(LayerCorrespondenceError, match="M_DEEP_CONV: 0 tensors"):
        p.finalize()
    p2 = MemoryPlan(PlanConditions(optimizer="sgd"))
    w = p2.alloc_deep_conv("c.weight", 8, 8, 3, 3)
    p2._alloc(R.G_DEEP_CONV, "grad.c.weight", (8, 3, 3, 4), DType.FP32, kind="DEEP_CONV")
    with pytest.raises(LayerCorrespondenceError, match="G_DEEP_CONV: tensor grad.c.weight has shape"):
        p2.finalize()


def test_alignment_validation_fires():
    p = _tiny_plan(optimizer="momentum").finalize()
    p["m.fc.weight"].offset += 4
    with pytest.raises(AlignmentError, match="M_FC_WEIGHT: tensor m.fc.weight offset"):
        from tr_hydra.memory.plan import validate_alignment
        validate_alignment(p)


def _independent_counts(model: nn.Module) -> dict[str, int]:
    """Counts from torchvision's module list alone: convs (stem = model.conv1), BN, Linear."""
    convs = [m for m in model.modules() if isinstance(m, nn.Conv2d)]
    bns = [m for m in model.modules() if isinstance(m, nn.BatchNorm2d)]
    fcs = [m for m in model.modules() if isinstance(m, nn.Linear)]
    return {"FIRST_CONV": 1, "DEEP_CONV": len(convs) - 1, "BN_WEIGHT": len(bns), "BN_BIAS": len(bns),
            "FC_WEIGHT": len(fcs), "FC_BIAS": sum(1 for f in fcs if f.bias is not None), "BN": len(bns)}


@pytest.mark.parametrize("optimizer,amp,ema", list(itertools.product(
    ["sgd", "momentum", "nesterov", "adam", "adamw", "lars"], [False, True], [False, True])))
def test_resnet50_region_counts(optimizer, amp, ema):
    model = torchvision.models.resnet50()
    expected = _independent_counts(model)
    assert expected["DEEP_CONV"] == 52 and expected["BN"] == 53
    pc = small_config(model="resnet50", amp=amp, ema=ema,
                      optimizer=small_config().optimizer.__class__(name=optimizer))
    import torch
    with torch.device("meta"):
        meta = torchvision.models.resnet50(num_classes=10)
    plan = build_plan(pc, map_model(meta))
    state = {"sgd": [], "momentum": ["M"], "nesterov": ["M"], "adam": ["M", "V"],
             "adamw": ["M", "V"], "lars": ["M", "N"]}[optimizer]
    series = ["W", "G"] + state + (["A", "G16"] if amp else []) + (["E"] if ema else []) \
        + (["E16"] if ema and amp else [])
    for s in ["W", "G", "M", "V", "E"]:
        for k in PARAM_KINDS:
            r = R[f"{s}_{k}"]
            n = len(plan.tensors_in(r))
            assert n == (expected[k] if s in series else 0), (r.name, n)
    for s in ["A", "G16", "E16", "N"]:
        for k in MATRIX_KINDS:
            r = R[f"{s[0]}_{k}_FP16"] if s in ("G16", "E16") else R[f"{s}_{k}"]
            assert len(plan.tensors_in(r)) == (expected[k] if s in series else 0), r.name
    assert len(plan.tensors_in(R.B_PREV_MEAN)) == expected["BN"]
    assert len(plan.tensors_in(R.B_NEXT_VAR)) == (expected["BN"] if ema else 0)
    if amp:  # fp32 and 16-bit twin spans hold equal element counts
        a, b = twin_elements(plan, "W", "A", MATRIX_KINDS)
        assert a == b
        a, b = twin_elements(plan, "G", "G16", MATRIX_KINDS)
        assert a == b
        if ema:
            assert twin_elements(plan, "E", "E16", MATRIX_KINDS)[0] == twin_elements(plan, "E", "E16", MATRIX_KINDS)[1]


def test_each_region_in_named_order():
    import torch
    with torch.device("meta"):
        meta = torchvision.models.resnet18(num_classes=10)
    plan = build_plan(small_config(model="resnet18"), map_model(meta))
    convs = [n for n, p in meta.named_parameters() if p.dim() == 4][1:]
    assert [t.name for t in plan.tensors_in(R.W_DEEP_CONV)] == convs
    assert [t.name for t in plan.tensors_in(R.G_DEEP_CONV)] == ["grad." + c for c in convs]


def test_fused_amp_plan_leaves_the_fp32_matrix_gradients_out():
    """Under AMP with the fused kernels the update reads the 16-bit gradients: the fp32 matrix
    gradient regions are empty, the arena shrinks by exactly their slots (slot rule by hand:
    2 * align256(2 * numel + 16) per fp32 tensor, over torchvision's own conv and fc weights), and
    no other region moves in size."""
    import torch
    with torch.device("meta"):
        meta = torchvision.models.resnet50(num_classes=10)
    pc = small_config(model="resnet50", amp=True)
    ref = build_plan(pc, map_model(meta), fused=False)
    fused = build_plan(pc, map_model(meta), fused=True)
    matrices = [p for p in meta.parameters() if p.dim() in (2, 4)]
    slots = sum(2 * ((2 * p.numel() + 16 + 255) // 256 * 256) for p in matrices)
    gone = {R.G_FC_WEIGHT, R.G_FIRST_CONV, R.G_DEEP_CONV}
    assert sum(ref.region_size[r] for r in gone) == slots
    assert ref.total_bytes - fused.total_bytes == slots
    for r in R:
        assert fused.region_size[r] == (0 if r in gone else ref.region_size[r]), r.name
    # without AMP the fp32 gradients are the gradients: the fused kernels change nothing
    fp32 = small_config(model="resnet50")
    assert build_plan(fp32, map_model(meta), fused=True).total_bytes == build_plan(fp32, map_model(meta), fused=False).total_bytes
    with pytest.raises(PlanError, match="cannot be left out"):
        PlanConditions(amp=False, matrix_grads_fp32=False)


def test_a_plan_and_its_run_read_runtime_kernels_alike():
    """runtime.kernels is decided once (``fused_wanted``): the plan made before a device is known
    (tr-plan; device=auto counts as CUDA) and the run's kernels (none on the CPU but asked-for
    Triton) follow the same answer."""
    import dataclasses

    from tr_hydra.compiler.compile import fused_update_reads_16bit, fused_wanted
    from tr_hydra.runtime.executor import fused_kernels
    for kernels, device, fused in (("auto", "auto", True), ("auto", "cuda", True), ("auto", "cpu", False),
                                   ("triton", "cpu", True), ("torch", "cuda", False)):
        pc = small_config(amp=True)
        pc = dataclasses.replace(pc, runtime=dataclasses.replace(pc.runtime, kernels=kernels, device=device))
        assert fused_update_reads_16bit(pc) is fused, (kernels, device)
        assert fused_wanted(kernels, "cpu" if device == "cpu" else "cuda") is fused
    assert fused_kernels("auto", "cpu") is None and fused_kernels("torch", "cuda") is None


def test_executor_refuses_a_plan_without_the_gradients_it_would_write(tmp_path, monkeypatch):
    from tr_hydra.runtime import build
    real = build.compile_plan
    monkeypatch.setattr(build, "compile_plan", lambda pc, fused=None: real(pc, fused=True))
    pc = small_config(amp=True)  # on the CPU: the plain-torch kernels, which write them
    with pytest.raises(RuntimeError, match="leaves the fp32 matrix gradients out.*no fused kernels"):
        build.Runtime(pc, log=lambda *_: None, source=False)


def test_16bit_gradients_lie_on_the_16bit_weights_bytes():
    """``plan.share_grad16`` (the default under AMP): every G_*_FP16 tensor sits at the offset
    of its A twin, the arena is smaller by exactly the 16-bit slots (by hand: align256(2 * numel
    + 16) per conv/fc weight of torchvision's ResNet-50), no other region changes size, the
    G16 span resolves to the A span, and a span that would mix own and shared bytes is refused."""
    import torch
    with torch.device("meta"):
        meta = torchvision.models.resnet50(num_classes=10)
    shared = build_plan(small_config(model="resnet50", amp=True), map_model(meta), fused=True)
    own = build_plan(small_config(model="resnet50", amp=True, share_grad16=False), map_model(meta), fused=True)
    assert shared.conditions.grad16_on_a and not own.conditions.grad16_on_a
    matrices = [p for p in meta.parameters() if p.dim() in (2, 4)]
    slots16 = sum((2 * p.numel() + 16 + 255) // 256 * 256 for p in matrices)
    assert own.total_bytes - shared.total_bytes == slots16
    for r in R:
        assert shared.region_size[r] == own.region_size[r], r.name
    for k in MATRIX_KINDS:
        a, g = shared.tensors_in(R[f"A_{k}"]), shared.tensors_in(R[f"G_{k}_FP16"])
        assert [t.offset for t in g] == [t.offset for t in a] and len(a) == len([
            p for p in own.tensors_in(R[f"A_{k}"])])
    assert shared.region_range(R.G_FC_WEIGHT_FP16, R.G_DEEP_CONV_FP16) == shared.region_range(R.A_FC_WEIGHT, R.A_DEEP_CONV)
    with pytest.raises(PlanError, match="mixes"):
        shared.region_range(R.R_RESULT, R.G_FC_WEIGHT_FP16)
    assert shared.series_bytes()["G16"] == 0 and own.series_bytes()["G16"] == slots16
    # the regions after A's twins keep their order; the arena still ends at its last region
    assert shared.total_bytes == shared.region_base[R.R_RESULT_ACCUMULATED] + shared.region_size[R.R_RESULT_ACCUMULATED]
    # without AMP there are no 16-bit gradients and nothing is shared
    fp32 = build_plan(small_config(model="resnet50"), map_model(meta))
    assert not fp32.shared
    with pytest.raises(PlanError, match="only under AMP"):
        PlanConditions(amp=False, grad16_on_a=True)
    # the training bytes by series: nothing counted twice
    assert sum(shared.series_bytes().values()) == shared.total_bytes
