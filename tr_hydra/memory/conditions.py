"""What decides the layout before any tensor is registered: which regions a plan populates
(optimizer state, AMP, EMA, BN folding), which regions lie on another's bytes, and which spans
one range op covers (so they must be adjacent)."""
from __future__ import annotations

from dataclasses import dataclass

from tr_hydra.errors import PlanError
from tr_hydra.memory.regions import MATRIX_KINDS, PARAM_KINDS, SERIES_KINDS, Region, region_for, \
    series_span

R = Region

# Optimizer -> optimizer-state series it needs.
OPTIMIZER_STATE: dict[str, tuple[str, ...]] = {
    "sgd": (), "momentum": ("M",), "nesterov": ("M",),
    "adam": ("M", "V"), "adamw": ("M", "V"), "lars": ("M", "N"),
}


@dataclass(frozen=True)
class PlanConditions:
    """What decides which regions are populated."""
    optimizer: str = "momentum"
    amp: bool = False
    ema: bool = False
    bn_folded: bool = False
    # the fp32 matrix gradient regions (G_FC_WEIGHT, G_FIRST_CONV, G_DEEP_CONV). Under AMP with
    # the fused kernels the weight update reads the 16-bit gradients directly, so nothing writes
    # or reads these: they are left empty. Without AMP they are the gradients themselves.
    matrix_grads_fp32: bool = True
    # AMP: the 16-bit gradient regions (G_*_FP16) lie on the bytes of their A twins. The step
    # writes the gradients only after the backward has returned, and the backward is the last
    # reader of the 16-bit weights; the weight update reads each gradient and then rewrites A
    # from the (updated or, on a skipped step, unchanged) fp32 master. So one set of bytes
    # serves both, and the gradients cost no memory through the forward.
    grad16_on_a: bool = False

    def __post_init__(self) -> None:
        if self.optimizer not in OPTIMIZER_STATE:
            raise PlanError(f"unknown optimizer {self.optimizer!r}; known: {', '.join(OPTIMIZER_STATE)}")
        if not self.amp and not self.matrix_grads_fp32:
            raise PlanError("without AMP the fp32 matrix gradients are the gradients: they cannot be left out")
        if self.grad16_on_a and not self.amp:
            raise PlanError("the 16-bit gradients can share the A regions only under AMP")

    @property
    def state_series(self) -> tuple[str, ...]:
        return OPTIMIZER_STATE[self.optimizer]


def shared_regions(c: PlanConditions) -> dict[Region, Region]:
    """Regions laid on another region's bytes: {region: the region whose bytes it uses}."""
    if not c.grad16_on_a:
        return {}
    return {region_for("G16", k): region_for("A", k) for k in MATRIX_KINDS}


def enabled_regions(c: PlanConditions) -> frozenset[Region]:
    """The condition table of DESIGN.md: which regions a configuration populates."""
    on: set[Region] = {R.B_PREV_MEAN, R.B_PREV_VAR}
    if c.ema:
        on |= {R.B_NEXT_MEAN, R.B_NEXT_VAR}
    if c.bn_folded:
        on |= {R.W_EQ_BIAS, R.W_EQ_SCALE}
    on |= {region_for("W", k) for k in PARAM_KINDS}
    on |= {region_for("G", k) for k in PARAM_KINDS
           if c.matrix_grads_fp32 or k not in MATRIX_KINDS}
    on.add(R.R_RESULT)
    if c.ema:
        on |= {region_for("E", k) for k in PARAM_KINDS}
        if c.amp:
            on |= {region_for("E16", k) for k in MATRIX_KINDS}
    if c.amp:
        on |= {region_for("A", k) for k in MATRIX_KINDS}
        on |= {region_for("G16", k) for k in MATRIX_KINDS}
        on |= {R.F_FEATURE_FP16, R.F_GRAD_SLOT_FP16, R.S_SCALAR_FP16}
    else:
        on |= {R.F_FEATURE_FP32, R.F_GRAD_SLOT_FP32}
    for s in c.state_series:
        on |= {region_for(s, k) for k in SERIES_KINDS[s]}
    on |= {R.I_A_LABEL, R.I_A_DATA, R.I_B_LABEL, R.I_B_DATA}
    on |= {R.S_SCALAR_FP32, R.S_SCALAR_INT32, R.S_SCALAR_INT8, R.S_MASK}
    on |= {R.T_TEMP_FP32, R.T_TEMP_FP16, R.T_TEMP_INT32, R.T_TEMP_INT8}
    on |= {R.R_PREDICTED_LABEL, R.R_RESULT_ACCUMULATED}
    return frozenset(on)


def range_op_spans(c: PlanConditions) -> list[tuple[Region, Region]]:
    """Every span a range op covers under these conditions (checked for contiguity)."""
    spans = [
        (R.B_PREV_MEAN, R.B_PREV_VAR),
        series_span("W", PARAM_KINDS), series_span("G", PARAM_KINDS),
        series_span("W", ("BN_BIAS", "BN_WEIGHT", "FC_BIAS")),
        series_span("W", MATRIX_KINDS), series_span("G", MATRIX_KINDS),
        (R.G_BN_BIAS, R.G_FIRST_CONV),  # all-reduce bucket 2
        (R.I_A_LABEL, R.I_B_DATA),
    ]
    if not c.grad16_on_a:  # one clear: grads + results (the 16-bit ones too, when they have own bytes)
        spans.append((R.G_BN_BIAS, R.G_DEEP_CONV_FP16 if c.amp else R.R_RESULT))
    if c.ema:
        spans += [(R.B_PREV_MEAN, R.B_NEXT_VAR), series_span("E", PARAM_KINDS)]
        if c.amp:
            spans.append(series_span("E16", MATRIX_KINDS))
    if c.amp:
        spans += [series_span("A", MATRIX_KINDS), series_span("G16", MATRIX_KINDS)]
    if c.bn_folded:
        spans.append((R.W_EQ_BIAS, R.W_EQ_SCALE))
    for s in c.state_series:
        spans.append(series_span(s, SERIES_KINDS[s]))
    return spans
