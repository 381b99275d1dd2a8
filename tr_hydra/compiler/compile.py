"""Compile: PlanConfig -> model map, MemoryPlan (finalized), variant shapes, step program."""
from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from tr_hydra.compiler.analysis import ModelMap, ShapeReport, map_model, propagate
from tr_hydra.config.plan_config import PlanConfig
from tr_hydra.errors import ModelMappingError
from tr_hydra.memory.plan import MemoryPlan
from tr_hydra.memory.regions import SERIES_KINDS, region_for
from tr_hydra.models.registry import build_model


# What the BLAS libraries keep per (device, stream) once a matrix product has run: cuBLAS's
# workspace (32 MiB on Hopper, and with CUBLAS_WORKSPACE_CONFIG=:4096:8, which deterministic runs
# set), cuBLASLt's (32 MiB) and 1 MiB more; measured with the allocator's history
# (docs/memory.md). The step warms up and is captured on one stream, so a run holds one set.
BLAS_WORKSPACE_BYTES = 65 * 2**20


def compute_dtype(pc: PlanConfig) -> torch.dtype:
    if not pc.amp:
        return torch.float32
    return torch.bfloat16 if pc.amp_dtype == "bf16" else torch.float16


@dataclass
class Compiled:
    config: PlanConfig
    model_map: ModelMap
    plan: MemoryPlan
    shapes: dict[str, ShapeReport]
    compute_dtype: torch.dtype
    program: "object" = field(default=None)
    tuning: "object" = field(default=None)  # compiler.tuning.TuningChoice: runtime.tuning resolved
    blas: bool = True  # whether the step runs a cuBLAS matrix product (``ops.reduced_linear``)
    # the model as analysed (meta device, compute dtype, step ops swapped) where Inductor compiles
    # the step on CUDA: ``estimated_shapes`` traces its partition on first use
    meta_model: nn.Module | None = field(default=None, repr=False)

    @functools.cached_property
    def estimated_shapes(self) -> dict[str, ShapeReport]:
        """``shapes`` with the saved activations Inductor's partitioner keeps (``partitioned``)
        where Inductor compiles the step on CUDA; ``shapes`` elsewhere. A trace of some seconds
        of CPU: asked for by what reports the need (tr-plan, tr-bench) and by the memory check
        only where the bound does not fit."""
        if self.meta_model is None:
            return self.shapes
        return partitioned(self.shapes, self.meta_model, self.config, self.compute_dtype)

    @property
    def activation_estimate(self) -> int:
        """Bytes the step will keep for the backward in the largest training variant (the shared
        graph pool), with what the backward recomputes on top at its peak under
        ``runtime.recompute=pointwise``."""
        return max((r.activation_peak_bytes for r in self.estimated_shapes.values()), default=0)

    @property
    def activation_bound(self) -> int:
        """``activation_estimate`` as eager autograd would save it, found without a trace: the
        same figure off CUDA or without Inductor, at least as large elsewhere."""
        return max((r.activation_peak_bytes for r in self.shapes.values()), default=0)

    @property
    def gradient_transient(self) -> int:
        """Bytes of the gradients the backward returns (``torch.autograd.grad``: one per
        parameter, in its leaf's dtype), alive together before they are copied into the arena:
        the 16-bit matrix and fp32 BN/bias gradients under AMP, all fp32 otherwise."""
        from tr_hydra.memory.regions import BIAS_KINDS, MATRIX_KINDS, PARAM_KINDS, series_span
        spans = ([series_span("G16", MATRIX_KINDS), series_span("G", BIAS_KINDS)] if self.config.amp
                 else [series_span("G", PARAM_KINDS)])
        return sum(self.plan.region_range(a, b)[1] for a, b in spans)

    @property
    def library_workspace(self) -> int:
        """The BLAS workspaces a CUDA run holds (none when the plan runs on the CPU, or when
        its step calls no cuBLAS product)."""
        return 0 if device_type_of(self.config) == "cpu" or not self.blas else BLAS_WORKSPACE_BYTES

    @property
    def predicted_need(self) -> int:
        """Arena + saved activations + the backward's gradients before their copy + the BLAS
        workspaces."""
        return self.fixed_need + self.activation_estimate

    @property
    def fixed_need(self) -> int:
        """``predicted_need`` less the activations: arena, the backward's gradients before their
        copy, the BLAS workspaces."""
        return self.plan.total_bytes + self.gradient_transient + self.library_workspace


def twin_series(pc: PlanConfig) -> tuple[str, ...]:
    """Series twinned with the W masters, in the order they are registered."""
    s = []
    if pc.ema:
        s.append("E")
        if pc.amp:
            s.append("E16")
    if pc.amp:
        s.append("A")
    s.append("G")
    if pc.amp:
        s.append("G16")
    s += list(pc.conditions.state_series)
    return tuple(s)


def fused_kernels_used(pc: PlanConfig, fused: bool | None = None) -> bool:
    """Whether a run of ``pc`` uses the fused kernels: ``fused`` (the trainer knows), or for
    ``None`` as ``runtime.kernels`` says for a run on ``runtime.device``, ``auto`` counting as a
    CUDA machine with Triton, as tr-plan assumes."""
    if fused is None:
        fused = fused_wanted(pc.runtime.kernels, "cpu" if pc.runtime.device == "cpu" else "cuda")
    return fused


def fused_update_reads_16bit(pc: PlanConfig, fused: bool | None = None) -> bool:
    """Whether the weight update will read the 16-bit matrix gradients itself (AMP with the
    fused kernels: ``fused_kernels_used``), so that the fp32 matrix gradient regions stay
    empty."""
    return pc.amp and fused_kernels_used(pc, fused)


def fused_wanted(kernels: str, device_type: str) -> bool:
    """``runtime.kernels`` resolved for a run on ``device_type``: the step's fused Triton kernels
    (``triton``; ``auto``: on CUDA) rather than the plain-torch reference. Where Triton cannot be
    imported the runtime takes the reference all the same (``runtime.executor.fused_kernels``)."""
    return kernels == "triton" or (kernels == "auto" and device_type == "cuda")


def build_plan(pc: PlanConfig, model_map: ModelMap, fused: bool | None = None) -> MemoryPlan:
    plan = MemoryPlan(dataclasses.replace(
        pc.conditions, matrix_grads_fp32=not fused_update_reads_16bit(pc, fused)))
    for bn in model_map.bns:
        plan.alloc_bn_stats(f"{bn.module}.running_mean", f"{bn.module}.running_var", bn.channels)
    if pc.ema:
        for bn in model_map.bns:
            plan.alloc_bn_stats_next(f"{bn.module}.running_mean", f"{bn.module}.running_var", bn.channels)
    masters = []
    for p in model_map.params:
        if p.kind in ("FIRST_CONV", "DEEP_CONV"):
            o, i, kh, kw = p.shape
            t = (plan.alloc_first_conv if p.kind == "FIRST_CONV" else plan.alloc_deep_conv)(p.name, o, i, kh, kw)
        elif p.kind == "FC_WEIGHT":
            t = plan.alloc_fc_weight(p.name, *p.shape)
        else:
            alloc = {"FC_BIAS": plan.alloc_fc_bias, "BN_WEIGHT": plan.alloc_bn_weight,
                     "BN_BIAS": plan.alloc_bn_bias}[p.kind]
            t = alloc(p.name, math.prod(p.shape), p.shape)  # a vector: (C,), or (C, 1, 1) for a layer scale
        masters.append(t)
    if pc.bn_folded:
        eps = {bn.eps for bn in model_map.bns}
        if len(eps) > 1:
            raise ModelMappingError(f"plan.bn_folded: BatchNorm layers use different eps {sorted(eps)}")
        for bn in model_map.bns:
            plan.alloc_eq_scale(bn.module, bn.channels)
            plan.alloc_eq_bias(bn.module, bn.channels)
    for series in twin_series(pc):
        for t in masters:
            if t.kind in SERIES_KINDS[series] and region_for(series, t.kind) in plan.enabled:
                plan.alloc_twin(series, t)
    variants = {v.name: (v.batch, v.res, v.train) for v in pc.variants}
    plan.alloc_baseline_dtensors(variants, pc.data.channels, pc.model.num_classes)
    return plan.finalize()


def instantiate_model(pc: PlanConfig, device: str | torch.device = "cpu") -> nn.Module:
    return build_model(pc.model.name, pc.model.num_classes, zero_init_residual=pc.model.zero_init_residual,
                       width=pc.model.width, device=device)


def recomputes_pointwise(pc: PlanConfig, device_type: str) -> bool:
    """Whether the step's backward recomputes pointwise results (``runtime.recompute``: only with
    Inductor, which ``compile=auto`` picks on CUDA)."""
    return inductor_wanted(pc, device_type) and pc.runtime.recompute == "pointwise"


def device_type_of(pc: PlanConfig) -> str:
    """The device type a run of ``pc`` uses (``runtime.device=auto``: CUDA where there is one)."""
    if pc.runtime.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return str(pc.runtime.device)


def inductor_wanted(pc: PlanConfig, device_type: str) -> bool:
    """``runtime.compile`` resolved: Inductor compiles the model's step (``auto``: on CUDA). The
    one place that decides it: what depends on it (the swapped ops, the tuning, the recompute)
    is given its answer."""
    return pc.runtime.compile == "inductor" or (pc.runtime.compile == "auto" and device_type == "cuda")


# (model, dtype, batch, channels, res, recompute, the analysed model's module types: its swaps)
# -> bytes, or the estimate's words where the trace failed
_PARTITIONED: dict = {}


def partitioned(shapes: dict[str, ShapeReport], meta_model: nn.Module, pc: PlanConfig,
                dt: torch.dtype) -> dict[str, ShapeReport]:
    """``shapes`` with the training variants' saved activations as Inductor's partitioner keeps
    them (``internals.saved_set``): the largest variant traced, each other one scaled from its
    eager count by that variant's ratio (the saved set grows with batch and pixels alike). With
    the gate closed, or where the trace fails (the reason is kept in ``estimate``), the eager
    counts stay: a bound, not an estimate. A trace is done once per process and shape."""
    from tr_hydra import internals
    from tr_hydra.internals import recompute, saved_set
    train = [v for v in pc.variants if v.train and shapes[v.name].saved_activation_bytes]
    if not train or not internals.is_open():
        return shapes
    top = max(train, key=lambda v: shapes[v.name].saved_activation_bytes)
    key = (repr(pc.model), str(dt), top.batch, pc.data.channels, top.res, pc.runtime.recompute,
           repr(sorted(type(m).__name__ for m in meta_model.modules())))
    if key not in _PARTITIONED:
        try:
            _PARTITIONED[key] = saved_set.saved_bytes(meta_model, top.batch, pc.data.channels, top.res, dt,
                                                      recompute.partitioner_options(pc.runtime.recompute))
        except Exception as e:  # noqa: BLE001 - any failure of PyTorch's internals keeps the bound
            _PARTITIONED[key] = f"eager (the partitioner's trace failed: {type(e).__name__}: {str(e).splitlines()[0][:120]})"
    found = _PARTITIONED[key]
    if isinstance(found, str):
        return {n: dataclasses.replace(r, estimate=found) if r.saved_activation_bytes else r for n, r in shapes.items()}
    ratio = found / shapes[top.name].saved_activation_bytes
    out = dict(shapes)
    for v in train:
        r = shapes[v.name]
        out[v.name] = (dataclasses.replace(r, saved_activation_bytes=found, estimate="partitioner") if v is top else
                       dataclasses.replace(r, saved_activation_bytes=round(r.saved_activation_bytes * ratio),
                                           estimate="scaled"))
    return out


def compile_plan(pc: PlanConfig, fused: bool | None = None) -> Compiled:
    """Everything decided before the first step: runs on the meta device, needs no GPU.
    ``fused``: whether the run will use the fused kernels (see ``fused_kernels_used``); the
    step program is then the one they run (``fusion.fuse_updates``)."""
    from tr_hydra.compiler import tuning
    from tr_hydra.compiler.fusion import fuse_updates
    from tr_hydra.compiler.program import build_program

    meta_model = instantiate_model(pc, "meta")
    model_map = map_model(meta_model, pc.data.channels)
    device_type = device_type_of(pc)  # every process of the run compiles as chosen here
    pc, choice = tuning.resolve(pc, meta_model, device_type, inductor_wanted(pc, device_type))
    plan = build_plan(pc, model_map, fused)
    dt = compute_dtype(pc)
    meta_model.to(dtype=dt)
    from tr_hydra.ops.swaps import swap_step_ops, swaps_step_ops
    from tr_hydra.ops.reduced_linear import uses_blas
    if swaps_step_ops(device_type, inductor_wanted(pc, device_type)):
        swap_step_ops(meta_model)  # as the runner will: a byte per pooled output, a bit per ReLU output
    shapes = {v.name: propagate(meta_model, v.batch, pc.data.channels, v.res, dt, v.train,
                                recompute=recomputes_pointwise(pc, device_type))
              for v in pc.variants}
    compiled = Compiled(pc, model_map, plan, shapes, dt, tuning=choice, blas=uses_blas(meta_model),
                        meta_model=meta_model if inductor_wanted(pc, device_type) and device_type == "cuda" else None)
    program = build_program(compiled)
    compiled.program = fuse_updates(program) if fused_kernels_used(pc, fused) else program
    return compiled
