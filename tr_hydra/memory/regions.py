"""The 68 semantic regions of the arena, in physical order (low to high addresses).

People number regions 001-068; code uses the 0-based enum value. ``DEFAULT`` aliases the first
region and ``NUM_REGIONS`` counts one sentinel slot after the last.
"""
from __future__ import annotations

import enum


class Region(enum.IntEnum):
    # B: BN running statistics (live = PREV, EMA copy = NEXT)
    B_PREV_MEAN = 0
    DEFAULT = 0
    B_PREV_VAR = 1
    B_NEXT_MEAN = 2
    B_NEXT_VAR = 3
    # W: fp32 master weights
    W_EQ_BIAS = 4
    W_EQ_SCALE = 5
    W_BN_BIAS = 6
    W_BN_WEIGHT = 7
    W_FC_BIAS = 8
    W_FC_WEIGHT = 9
    W_FIRST_CONV = 10
    W_DEEP_CONV = 11
    # E: EMA weights
    E_BN_BIAS = 12
    E_BN_WEIGHT = 13
    E_FC_BIAS = 14
    E_FC_WEIGHT = 15
    E_FIRST_CONV = 16
    E_DEEP_CONV = 17
    E_FC_WEIGHT_FP16 = 18
    E_FIRST_CONV_FP16 = 19
    E_DEEP_CONV_FP16 = 20
    # A: 16-bit compute weights (AMP)
    A_FC_WEIGHT = 21
    A_FIRST_CONV = 22
    A_DEEP_CONV = 23
    # G: fp32 gradients
    G_BN_BIAS = 24
    G_BN_WEIGHT = 25
    G_FC_BIAS = 26
    G_FC_WEIGHT = 27
    G_FIRST_CONV = 28
    G_DEEP_CONV = 29
    # per-step results, inside the gradient span so one clear zeroes both
    R_RESULT = 30
    # G: 16-bit gradients (AMP)
    G_FC_WEIGHT_FP16 = 31
    G_FIRST_CONV_FP16 = 32
    G_DEEP_CONV_FP16 = 33
    # M: first moment / momentum
    M_BN_BIAS = 34
    M_BN_WEIGHT = 35
    M_FC_BIAS = 36
    M_FC_WEIGHT = 37
    M_FIRST_CONV = 38
    M_DEEP_CONV = 39
    # V: second moment
    V_BN_BIAS = 40
    V_BN_WEIGHT = 41
    V_FC_BIAS = 42
    V_FC_WEIGHT = 43
    V_FIRST_CONV = 44
    V_DEEP_CONV = 45
    # N: LARS per-tensor norms
    N_FC_WEIGHT = 46
    N_FIRST_CONV = 47
    N_DEEP_CONV = 48
    # I: double-buffered input
    I_A_LABEL = 49
    I_A_DATA = 50
    I_B_LABEL = 51
    I_B_DATA = 52
    # F: buffers written by tr_hydra itself (logits, gradient of the logits)
    F_FEATURE_FP32 = 53
    F_GRAD_SLOT_FP32 = 54
    F_FEATURE_FP16 = 55
    F_GRAD_SLOT_FP16 = 56
    # S: device scalars and masks
    S_SCALAR_FP32 = 57
    S_SCALAR_FP16 = 58
    S_SCALAR_INT32 = 59
    S_SCALAR_INT8 = 60
    S_MASK = 61
    # T: temporaries
    T_TEMP_FP32 = 62
    T_TEMP_FP16 = 63
    T_TEMP_INT32 = 64
    T_TEMP_INT8 = 65
    # R: results
    R_PREDICTED_LABEL = 66
    R_RESULT_ACCUMULATED = 67

    @property
    def number(self) -> str:
        """The 1-based number people use: 001..068."""
        return f"{self.value + 1:03d}"

    @property
    def series(self) -> str:
        return series_of(self)


NUM_REGIONS = 69
ALL_REGIONS: tuple[Region, ...] = tuple(Region(i) for i in range(NUM_REGIONS - 1))

# Series label of every region, for per-series totals and telemetry.
_SERIES_BY_PREFIX = {
    "B": "B", "W": "W", "E": "E", "A": "A", "M": "M", "V": "V", "N": "N",
    "I": "I", "F": "F", "S": "S", "T": "T", "R": "R",
}


def series_of(region: Region) -> str:
    if region.name.startswith("G_"):
        return "G16" if region.name.endswith("_FP16") else "G"
    if region.name.startswith("E_") and region.name.endswith("_FP16"):
        return "E16"
    return _SERIES_BY_PREFIX[region.name[0]]


SERIES_ORDER = ("B", "W", "E", "E16", "A", "G", "R", "G16", "M", "V", "N", "I", "F", "S", "T")


def span(start: Region, end: Region) -> tuple[Region, ...]:
    """Regions start..end inclusive, in physical order."""
    if end < start:
        raise ValueError(f"empty span {start.name}..{end.name}")
    return tuple(Region(i) for i in range(start, end + 1))


# The parameter kinds that each weight-like series lays out in the same order.
# A span of one series and the same span of another are element-for-element twins.
PARAM_KINDS = ("BN_BIAS", "BN_WEIGHT", "FC_BIAS", "FC_WEIGHT", "FIRST_CONV", "DEEP_CONV")
BIAS_KINDS = ("BN_BIAS", "BN_WEIGHT", "FC_BIAS")      # no weight decay with wd_exclude_bn_bias
MATRIX_KINDS = ("FC_WEIGHT", "FIRST_CONV", "DEEP_CONV")  # have 16-bit twins under AMP

# series -> the kinds it holds; the region is f"{series}_{kind}" (+ "_FP16" for 16-bit twins)
SERIES_KINDS: dict[str, tuple[str, ...]] = {
    "W": PARAM_KINDS, "E": PARAM_KINDS, "G": PARAM_KINDS, "M": PARAM_KINDS, "V": PARAM_KINDS,
    "A": MATRIX_KINDS, "G16": MATRIX_KINDS, "E16": MATRIX_KINDS, "N": MATRIX_KINDS,
}


def region_for(series: str, kind: str) -> Region:
    """Region of a parameter kind in a series, e.g. ('M', 'DEEP_CONV') -> M_DEEP_CONV."""
    if kind not in SERIES_KINDS[series]:
        raise KeyError(f"series {series} holds no {kind}")
    if series in ("G16", "E16"):
        return Region[f"{series[0]}_{kind}_FP16"]
    return Region[f"{series}_{kind}"]


def series_span(series: str, kinds: tuple[str, ...]) -> tuple[Region, Region]:
    """(first, last) region of ``kinds`` within ``series`` (kinds must be consecutive)."""
    return region_for(series, kinds[0]), region_for(series, kinds[-1])
