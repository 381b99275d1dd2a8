"""MemoryPlan: the only authority on arena layout.

Tensors are registered through semantic methods that hard-code their region; ``finalize()`` walks
the regions in order with one cursor and then runs the four validations. After finalize the plan is
locked.
"""
from __future__ import annotations


from tr_hydra.errors import (
    AlignmentError, ContiguityError, LayerCorrespondenceError, PlanError, PlanLockedError,
    RegionOrderError,
)
from tr_hydra.memory.conditions import (  # noqa: F401 (PlanConditions: part of the plan's interface)
    PlanConditions, enabled_regions, range_op_spans, shared_regions,
)
from tr_hydra.memory.dtensor import ALIGN, DTensor, DType, slot_bytes_for
from tr_hydra.memory.regions import ALL_REGIONS, SERIES_KINDS, Region, region_for

R = Region

class MemoryPlan:
    """Registers DTensors region by region, then lays them out with one cursor pass."""

    def __init__(self, conditions: PlanConditions | None = None):
        self.conditions = conditions or PlanConditions()
        self.enabled = enabled_regions(self.conditions)
        self.shared = shared_regions(self.conditions)
        self.dtensors: list[DTensor] = []
        self._by_name: dict[str, DTensor] = {}
        self._grad_slots: dict[tuple[int, DType], DTensor] = {}
        # per-variant logical shapes of tensors whose shape depends on the variant
        self.variant_shapes: dict[str, dict[str, tuple[int, int, int, int]]] = {}
        self.region_base: dict[Region, int] = {}
        self.region_size: dict[Region, int] = {}
        self.total_bytes = 0
        self.locked = False

    # ---------------------------------------------------------------- registration core
    def _alloc(self, region: Region, name: str, shape, dtype: DType, *, torch_shape=None,
               kind: str | None = None) -> DTensor:
        if self.locked:
            raise PlanLockedError(f"plan is finalized; cannot allocate {name} in {region.name}")
        if region not in self.enabled:
            raise PlanError(f"region {region.name} is not populated for {self.conditions}; "
                            f"cannot allocate {name}")
        if name in self._by_name:
            raise PlanError(f"region {region.name}: a tensor named {name!r} already exists")
        t = DTensor(id=len(self.dtensors), name=name, shape=tuple(shape), dtype=dtype,
                    region=region, torch_shape=tuple(torch_shape) if torch_shape else None, kind=kind)
        self.dtensors.append(t)
        self._by_name[name] = t
        return t

    def _alloc_series(self, series: str, kind: str, name: str, shape, torch_shape=None) -> DTensor:
        dtype = DType.FP16 if series in ("A", "G16", "E16") else DType.FP32
        prefix = {"W": "", "E": "ema.", "E16": "ema16.", "A": "amp.", "G": "grad.", "G16": "grad16.",
                  "M": "m.", "V": "v.", "N": "norm."}[series]
        if series == "N":
            shape, torch_shape = (1, 1, 1, 4), None  # |w|, |g|, trust ratio, spare
        return self._alloc(region_for(series, kind), prefix + name, shape, dtype,
                           torch_shape=torch_shape, kind=kind)

    def _alloc_variant(self, region: Region, name: str, shapes: dict[str, tuple], dtype: DType) -> DTensor:
        """A tensor whose shape depends on the variant: its slot is the max over variants."""
        if not shapes:
            raise PlanError(f"region {region.name}: {name} has no variant shapes")
        biggest = max(shapes.values(), key=lambda s: slot_bytes_for(tuple(s), dtype, region))
        t = self._alloc(region, name, biggest, dtype)
        self.variant_shapes[name] = {v: tuple(s) for v, s in shapes.items()}
        return t

    # ---------------------------------------------------------------- semantic methods
    # master weights and BN statistics (one method per kind; the region is fixed by the method)
    def alloc_bn_weight(self, name, c, torch_shape=None):
        return self._alloc_series("W", "BN_WEIGHT", name, (1, 1, 1, c), tuple(torch_shape or (c,)))

    def alloc_bn_bias(self, name, c, torch_shape=None):
        return self._alloc_series("W", "BN_BIAS", name, (1, 1, 1, c), tuple(torch_shape or (c,)))

    def alloc_fc_bias(self, name, c, torch_shape=None):
        return self._alloc_series("W", "FC_BIAS", name, (1, 1, 1, c), tuple(torch_shape or (c,)))

    def alloc_fc_weight(self, name, out_f, in_f):
        return self._alloc_series("W", "FC_WEIGHT", name, (out_f, 1, 1, in_f), (out_f, in_f))

    def alloc_first_conv(self, name, o, i, kh, kw):
        return self._alloc_series("W", "FIRST_CONV", name, (o, kh, kw, i), (o, i, kh, kw))

    def alloc_deep_conv(self, name, o, i, kh, kw):
        return self._alloc_series("W", "DEEP_CONV", name, (o, kh, kw, i), (o, i, kh, kw))

    def alloc_bn_stats(self, name_mean, name_var, c):
        """Live running statistics (B_PREV_*); with EMA also their EMA twins (B_NEXT_*)."""
        out = [self._alloc(R.B_PREV_MEAN, name_mean, (1, 1, 1, c), DType.FP32, torch_shape=(c,)),
               self._alloc(R.B_PREV_VAR, name_var, (1, 1, 1, c), DType.FP32, torch_shape=(c,))]
        return out

    def alloc_bn_stats_next(self, name_mean, name_var, c):
        return [self._alloc(R.B_NEXT_MEAN, "ema." + name_mean, (1, 1, 1, c), DType.FP32, torch_shape=(c,)),
                self._alloc(R.B_NEXT_VAR, "ema." + name_var, (1, 1, 1, c), DType.FP32, torch_shape=(c,))]

    def alloc_eq_scale(self, name, c):
        return self._alloc(R.W_EQ_SCALE, "eq_scale." + name, (1, 1, 1, c), DType.FP32, torch_shape=(c,))

    def alloc_eq_bias(self, name, c):
        return self._alloc(R.W_EQ_BIAS, "eq_bias." + name, (1, 1, 1, c), DType.FP32, torch_shape=(c,))

    def alloc_twin(self, series: str, master: DTensor) -> DTensor:
        """The tensor of ``series`` (E, E16, A, G, G16, M, V, N) that twins a master weight."""
        if master.kind is None or master.region is not region_for("W", master.kind):
            raise PlanError(f"{master.name} is not a master weight")
        return self._alloc_series(series, master.kind, master.name, master.shape, master.torch_shape)

    # inputs, features, results, scalars, temporaries
    def alloc_input(self, buffer: str, label_shapes: dict, data_shapes: dict, data_dtype: DType):
        if buffer not in ("A", "B"):
            raise PlanError(f"input buffer must be A or B, not {buffer!r}")
        lab = self._alloc_variant(Region[f"I_{buffer}_LABEL"], f"input_{buffer}.label", label_shapes, DType.INT32)
        dat = self._alloc_variant(Region[f"I_{buffer}_DATA"], f"input_{buffer}.data", data_shapes, data_dtype)
        return lab, dat

    def alloc_feature(self, name: str, shapes: dict, dtype: DType) -> DTensor:
        region = R.F_FEATURE_FP16 if dtype is DType.FP16 else R.F_FEATURE_FP32
        return self._alloc_variant(region, name, shapes, dtype)

    def alloc_grad_slot(self, shapes: dict, dtype: DType, slot_idx: int) -> DTensor:
        """One of four fixed backward slots; taking a slot again with the same shapes returns it."""
        if not 0 <= slot_idx <= 3:
            raise PlanError(f"grad slot index must be 0..3, got {slot_idx}")
        key = (slot_idx, dtype)
        region = R.F_GRAD_SLOT_FP16 if dtype is DType.FP16 else R.F_GRAD_SLOT_FP32
        if key in self._grad_slots:
            t = self._grad_slots[key]
            if self.variant_shapes[t.name] != {v: tuple(s) for v, s in shapes.items()}:
                raise PlanError(f"region {region.name}: grad slot {slot_idx} is taken with other shapes")
            return t
        t = self._alloc_variant(region, f"grad_slot{slot_idx}", shapes, dtype)
        self._grad_slots[key] = t
        return t

    def alloc_scalar(self, name: str, dtype: DType = DType.FP32, length: int = 1) -> DTensor:
        region = {DType.FP32: R.S_SCALAR_FP32, DType.FP16: R.S_SCALAR_FP16,
                  DType.INT32: R.S_SCALAR_INT32, DType.INT8: R.S_SCALAR_INT8}[dtype]
        return self._alloc(region, "scalar." + name, (1, 1, 1, length), dtype)

    def alloc_mask(self, name: str, length: int) -> DTensor:
        return self._alloc(R.S_MASK, "mask." + name, (1, 1, 1, length), DType.INT8)

    def alloc_temp(self, name: str, shapes: dict, dtype: DType) -> DTensor:
        region = {DType.FP32: R.T_TEMP_FP32, DType.FP16: R.T_TEMP_FP16,
                  DType.INT32: R.T_TEMP_INT32, DType.INT8: R.T_TEMP_INT8}[dtype]
        return self._alloc_variant(region, "temp." + name, shapes, dtype)

    def alloc_result(self, length: int = 4) -> DTensor:
        return self._alloc(R.R_RESULT, "result.step", (1, 1, 1, length), DType.FP32)

    def alloc_result_accumulated(self, name: str, length: int = 4) -> DTensor:
        return self._alloc(R.R_RESULT_ACCUMULATED, "result." + name, (1, 1, 1, length), DType.FP32)

    def alloc_predicted_label(self, shapes: dict) -> DTensor:
        return self._alloc_variant(R.R_PREDICTED_LABEL, "predicted_label", shapes, DType.INT32)

    def alloc_baseline_dtensors(self, variants: dict[str, tuple[int, int, bool]], channels: int,
                                num_classes: int) -> None:
        """The training infrastructure; see the module-level function of the same name."""
        alloc_baseline_dtensors(self, variants, channels, num_classes)

    # ---------------------------------------------------------------- layout
    def finalize(self) -> "MemoryPlan":
        if self.locked:
            raise PlanLockedError("plan already finalized")
        by_region: dict[Region, list[DTensor]] = {r: [] for r in ALL_REGIONS}
        for t in self.dtensors:
            by_region[t.region].append(t)
        cursor = 0
        for r in ALL_REGIONS:  # enum order is physical order
            if r in self.shared:  # on its twin's bytes (laid out earlier: twins come first)
                self._lay_on(r, self.shared[r], by_region)
                continue
            self.region_base[r] = cursor
            for t in by_region[r]:
                t.offset = cursor
                cursor += t.slot_bytes
            self.region_size[r] = cursor - self.region_base[r]
        self.total_bytes = cursor
        self.locked = True
        self.validate()
        return self

    def _lay_on(self, r: Region, twin: Region, by_region) -> None:
        mine, theirs = by_region[r], by_region[twin]
        if [t.slot_bytes for t in mine] != [t.slot_bytes for t in theirs]:
            raise LayerCorrespondenceError(
                f"region {r.name} shares {twin.name}'s bytes but its tensors do not match them "
                f"one for one ({len(mine)} against {len(theirs)} tensors)")
        for t, u in zip(mine, theirs):
            t.offset = u.offset
        self.region_base[r] = self.region_base[twin]
        self.region_size[r] = self.region_size[twin]

    def own_bytes(self, r: Region) -> int:
        """The bytes a region adds to the arena (none for a region on another's bytes)."""
        return 0 if r in self.shared else self.region_size.get(r, 0)

    def validate(self) -> None:
        validate_region_order(self)
        validate_contiguity(self)
        validate_layer_correspondence(self)
        validate_alignment(self)

    # ---------------------------------------------------------------- queries
    def region_range(self, start: Region, end: Region | None = None) -> tuple[int, int]:
        """(offset, nbytes) of the span start..end inclusive."""
        self._need_locked()
        end = start if end is None else end
        if end < start:
            raise PlanError(f"empty span {start.name}..{end.name}")
        inside = [Region(i) in self.shared for i in range(start, end + 1)]
        if any(inside) and not all(inside):
            raise PlanError(f"span {start.name}..{end.name} mixes regions on their own bytes with "
                            f"regions on other regions' bytes")
        off = self.region_base[start]
        return off, self.region_base[end] + self.region_size[end] - off

    def is_region_populated(self, region: Region) -> bool:
        return region in self.enabled

    def tensors_in(self, region: Region) -> list[DTensor]:
        return [t for t in self.dtensors if t.region is region]

    def __getitem__(self, name: str) -> DTensor:
        try:
            return self._by_name[name]
        except KeyError:
            raise PlanError(f"no DTensor named {name!r} in the plan") from None

    def __contains__(self, name: str) -> bool:
        return name in self._by_name

    def shape_in(self, t: DTensor, variant: str | None) -> tuple[int, int, int, int]:
        if variant is None or t.name not in self.variant_shapes:
            return t.shape
        try:
            return self.variant_shapes[t.name][variant]
        except KeyError:
            raise PlanError(f"{t.name} has no shape for variant {variant!r}") from None

    def series_bytes(self) -> dict[str, int]:
        from tr_hydra.memory.regions import series_of
        out: dict[str, int] = {}
        for r in ALL_REGIONS:  # the arena's bytes: a region on another's bytes adds none
            out[series_of(r)] = out.get(series_of(r), 0) + self.own_bytes(r)
        return out

    def _need_locked(self) -> None:
        if not self.locked:
            raise PlanError("plan is not finalized yet")


# -------------------------------------------------------------------- validations
def validate_region_order(plan: MemoryPlan) -> None:
    prev = -1
    for r in ALL_REGIONS:
        base = plan.region_base[r]
        if r in plan.shared:
            twin = plan.shared[r]
            if (base, plan.region_size[r]) != (plan.region_base[twin], plan.region_size[twin]):
                raise RegionOrderError(f"region {r.name} is laid on {twin.name}'s bytes but does "
                                       f"not cover them exactly")
        else:
            if base < prev:
                raise RegionOrderError(f"region {r.name}: base offset {base} is below the previous "
                                       f"region's base {prev}")
            prev = base
        for t in plan.tensors_in(r):
            if not base <= t.offset < base + max(plan.region_size[r], 1):
                raise RegionOrderError(f"region {r.name}: tensor {t.name} offset {t.offset} lies "
                                       f"outside the region [{base}, {base + plan.region_size[r]})")


def validate_contiguity(plan: MemoryPlan) -> None:
    for start, end in range_op_spans(plan.conditions):
        for i in range(start, end):
            a, b = Region(i), Region(i + 1)
            if plan.region_base[a] + plan.region_size[a] != plan.region_base[b]:
                raise ContiguityError(
                    f"span {start.name}..{end.name}: region {b.name} starts at "
                    f"{plan.region_base[b]}, not right after {a.name} "
                    f"(ends at {plan.region_base[a] + plan.region_size[a]})")
        # tensors inside each region must tile it with no gap
        for i in range(start, end + 1):
            r = Region(i)
            cursor = plan.region_base[r]
            for t in plan.tensors_in(r):
                if t.offset != cursor:
                    raise ContiguityError(f"region {r.name}: tensor {t.name} at offset {t.offset}, "
                                          f"expected {cursor} (gap or overlap)")
                cursor += t.slot_bytes


def _kind_shapes(plan: MemoryPlan, series: str, kind: str) -> list[tuple]:
    return [t.shape for t in plan.tensors_in(region_for(series, kind))]


def validate_layer_correspondence(plan: MemoryPlan) -> None:
    c = plan.conditions
    twins = ["G"] + (["G16", "A"] if c.amp else []) + (["E"] if c.ema else []) \
        + (["E16"] if c.ema and c.amp else []) + list(c.state_series)
    for series in twins:
        for kind in SERIES_KINDS[series]:
            if region_for(series, kind) not in plan.enabled:
                continue  # left empty by the conditions (fp32 matrix gradients under fused AMP)
            ref = _kind_shapes(plan, "W", kind)
            got = _kind_shapes(plan, series, kind)
            region = region_for(series, kind)
            if len(ref) != len(got):
                raise LayerCorrespondenceError(
                    f"region {region.name}: {len(got)} tensors, but {region_for('W', kind).name} "
                    f"holds {len(ref)}")
            if series == "N":
                continue  # norms: one small record per tensor, count is what matters
            for i, (a, b) in enumerate(zip(ref, got)):
                if a != b:
                    t = plan.tensors_in(region)[i]
                    raise LayerCorrespondenceError(
                        f"region {region.name}: tensor {t.name} has shape {b}, but its master in "
                        f"{region_for('W', kind).name} has {a}")


def validate_alignment(plan: MemoryPlan) -> None:
    for t in plan.dtensors:
        if t.offset % ALIGN:
            raise AlignmentError(f"region {t.region.name}: tensor {t.name} offset {t.offset} is not "
                                 f"{ALIGN}-aligned")
    for r in ALL_REGIONS:
        if plan.region_base[r] % ALIGN:
            raise AlignmentError(f"region {r.name}: base offset {plan.region_base[r]} is not "
                                 f"{ALIGN}-aligned")


# Device scalars of the training infrastructure (S regions). Hyper-parameters live here so that
# schedules change values without re-capturing the step.
FP32_SCALARS = ("lr", "momentum", "beta1_complement", "beta2_complement", "eps", "weight_decay",
                "bias_weight_decay", "trust_coefficient", "step", "loss_scale", "inv_loss_scale", "found_inf",
                "ema_decay", "nonfinite", "skipped", "nonfinite_step")
INT32_SCALARS = ("growth_tracker", "step_count")
RESULT_FIELDS = ("loss_sum", "correct1", "correct5", "count")


def alloc_baseline_dtensors(plan: MemoryPlan, variants: dict[str, tuple[int, int, bool]],
                            channels: int, num_classes: int) -> None:
    """Training infrastructure: A/B input buffers, logits and their gradient, the soft-max label
    temporary, predicted labels, device scalars and the result records.

    ``variants`` maps a variant name to (batch, resolution, is_train).
    """
    amp = plan.conditions.amp
    data_dtype = DType.FP16 if amp else DType.FP32
    labels = {v: (b, 1, 1, 1) for v, (b, r, _) in variants.items()}
    images = {v: (b, r, r, channels) for v, (b, r, _) in variants.items()}
    logits = {v: (b, 1, 1, num_classes) for v, (b, r, _) in variants.items()}
    train_logits = {v: s for v, s in logits.items() if variants[v][2]}
    for buf in ("A", "B"):
        plan.alloc_input(buf, labels, images, data_dtype)
    plan.alloc_feature("logits", logits, data_dtype)
    if train_logits:
        plan.alloc_grad_slot(train_logits, data_dtype, 0)  # d loss / d logits
    plan.alloc_temp("label_dist", logits, DType.FP32)       # soft-max / smoothed-label temporary
    if amp:  # the 16-bit gradients' sum of squares, taken by the non-finite check: (running, last)
        plan.alloc_temp("grad16_sumsq", {v: (1, 1, 1, 2) for v in variants}, DType.FP32)
    # B_PREV_MEAN..B_PREV_VAR (slots whole) before the forward moves them, put back on a skipped
    # step; trainer.max_nonfinite on the device: (limit, reached, steps skipped since, spare)
    bn = sum(t.slot_bytes for r in (R.B_PREV_MEAN, R.B_PREV_VAR) for t in plan.tensors_in(r)) // 4
    if bn:
        plan.alloc_temp("bn_stats", {v: (1, 1, 1, bn) for v in variants}, DType.FP32)
    plan.alloc_temp("nonfinite_limit", {v: (1, 1, 1, 4) for v in variants}, DType.FP32)
    plan.alloc_predicted_label(labels)
    for name in FP32_SCALARS:
        plan.alloc_scalar(name, DType.FP32)
    for name in INT32_SCALARS:
        plan.alloc_scalar(name, DType.INT32)
    plan.alloc_mask("nonfinite_regions", len(ALL_REGIONS))  # which region held a NaN/inf
    plan.alloc_mask("nonfinite_flags", len(ALL_REGIONS))    # this step's per-region flags (scratch)
    plan.alloc_result(len(RESULT_FIELDS))
    for name in ("train", "val", "val_ema"):
        plan.alloc_result_accumulated(name, len(RESULT_FIELDS))
