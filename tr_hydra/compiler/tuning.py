"""``runtime.tuning``: how much compile effort the run's length pays for.

Inductor's coordinate descent (``coordinate_descent_tuning``) benchmarks the neighbours of a
Triton kernel's block sizes at its first launch and keeps the fastest; tr_hydra gives it only the
kernels large enough to gain (``internals/tuned_kernels.py``). It makes ResNet-50's step
5-10% faster and costs about a minute more before the first step: worth it for an ImageNet run
of 37 epochs, a loss for a short one. ``auto`` weighs the two for each variant (each is a compile
of its own) before anything compiles:

- the run's steps per variant come from the plan (epochs, the low-resolution epochs, last
  batches, validation, ``trainer.max_steps``);
- each step's time is estimated from the model's multiply-adds at the variant's shape (counted on
  the meta device, a training step as three forwards) at ``STEP_FLOPS_PER_S``;
- the saving is ``GAIN`` of those seconds; the cost ``TUNE_SECONDS_PER_NORM`` per BatchNorm
  layer for a training variant (the kernels that are tuned are mostly BatchNorm's and ReLU's),
  ``VAL_SHARE`` of it for a validation one (its forward alone).

A variant is tuned when its saving exceeds its cost: in an ImageNet run the full training batch,
not the one partial batch per epoch nor validation, whose tuning would take the GPU from the
training batch's in the parallel compiles for seconds of gain. Each kernel of a tuned variant is
then weighed on the same terms, from its own time at its first launch and the run's steps of the
variant (``PlanConfig.tuned_steps``; ``internals/tuned_kernels.py``). The constants are measured
(``docs/performance.md``, "Compile effort"). The choice depends on the plan alone, so a rerun of
the same config chooses the same; tuned kernels are kept in Inductor's cache and in the saved
store, and a later run of the same plan loads them without tuning again.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from tr_hydra.config.epochs import epoch_schedule, val_schedule
from tr_hydra.internals.tuned_kernels import KERNEL_GAIN, KERNEL_SECONDS

# The constants below are calibrated on ResNet-50 (bf16) and are where the measurements they come
# from are kept: docs/performance.md, "Compile effort: runtime.tuning".
# the step's sustained FLOP rate, to turn a variant's forward FLOPs into seconds a step
STEP_FLOPS_PER_S = 1.8e14
# the share of step time coordinate descent saves (the least measured)
GAIN = 0.05
# coordinate descent's seconds per BatchNorm layer of the model, candidates compiled ahead
TUNE_SECONDS_PER_NORM = 1.3
# a validation variant's coordinate descent against a training variant's of the same plan
VAL_SHARE = 0.17


@dataclass(frozen=True)
class VariantEstimate:
    steps: int              # the run's steps of the variant
    seconds: float          # their estimated time
    saving: float           # GAIN of it
    cost: float             # the tuning's estimated seconds

    @property
    def tune(self) -> bool:
        return self.saving > self.cost


@dataclass(frozen=True)
class TuningChoice:
    asked: str                      # runtime.tuning as given: auto | none | full
    reason: str
    variants: tuple[str, ...] = ()  # the variants whose kernels coordinate descent tunes
    estimates: dict = field(default_factory=dict)  # auto: per variant, a VariantEstimate
    # auto: each tuned variant's steps, over which each of its kernels' tuning must pay
    steps: tuple[int, ...] | None = None

    @property
    def tune(self) -> bool:
        return bool(self.variants)

    def describe(self) -> str:
        what = f"coordinate descent on {', '.join(self.variants)}" if self.tune else "no tuning"
        return f"runtime.tuning={self.asked}: {what} ({self.reason})"

    def to_json(self) -> dict:
        return {"tune": self.tune, "asked": self.asked, "reason": self.reason, "variants": list(self.variants),
                "steps": list(self.steps) if self.steps is not None else None,
                "estimates": {k: dataclasses.asdict(e) | {"tune": e.tune} for k, e in self.estimates.items()}}


def forward_flops(model: torch.nn.Module, channels: int, res: int) -> int:
    """FLOPs (two per multiply-add) of one image's forward at ``res``², counted on the meta
    device by PyTorch's FLOP counter (convolutions and matrix products)."""
    from torch.utils.flop_counter import FlopCounterMode
    x = torch.empty(1, channels, res, res, device="meta", dtype=next(model.parameters()).dtype)
    was = model.training
    model.eval()  # no running-statistics update on the meta device; the FLOPs are the same
    try:
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            model(x.contiguous(memory_format=torch.channels_last))
    finally:
        model.train(was)
    return int(counter.get_total_flops())


def run_steps(pc) -> dict[str, int]:
    """Steps of each variant over the whole run, as the trainer takes them: per epoch its
    schedule (``config.epochs``); after each whole epoch that ``trainer.val_every`` names, and
    after the last, a validation (twice with EMA: the live and the EMA weights);
    ``trainer.max_steps`` training steps at most."""
    t = pc.trainer
    counts: dict[str, int] = {}
    left = t.max_steps if t.max_steps else None
    passes = 2 if pc.ema else 1
    val = val_schedule(pc)
    for epoch in range(t.epochs):
        steps = epoch_schedule(pc, epoch)
        taken = steps if left is None else steps[:left]
        if left is not None:
            left -= len(taken)
        for name, _, _ in taken:
            counts[name] = counts.get(name, 0) + 1
        if len(taken) == len(steps) and ((epoch + 1) % max(t.val_every, 1) == 0 or epoch + 1 == t.epochs):
            for name, _, _ in val:
                counts[name] = counts.get(name, 0) + passes
        if left == 0:
            break
    return counts


def estimates(pc, flops_by_res: dict[int, int], norm_layers: int) -> dict[str, VariantEstimate]:
    """Per variant of ``pc`` that the run takes: its steps, their seconds, the saving and the cost
    of tuning it. ``flops_by_res``: one image's forward FLOPs per resolution."""
    out = {}
    for name, n in run_steps(pc).items():
        v = pc.variant(name)
        seconds = n * (3 if v.train else 1) * flops_by_res[v.res] * v.batch / STEP_FLOPS_PER_S
        cost = TUNE_SECONDS_PER_NORM * norm_layers * (1.0 if v.train else VAL_SHARE)
        out[name] = VariantEstimate(n, seconds, GAIN * seconds, cost)
    return out


def choose(pc, device_type: str, inductor: bool, flops_by_res: dict[int, int], norm_layers: int) -> TuningChoice:
    """``runtime.tuning`` resolved for a run of ``pc`` on ``device_type`` (``inductor``: whether
    Inductor compiles the step). ``flops_by_res``: one image's forward FLOPs per resolution."""
    asked = pc.runtime.tuning
    if device_type != "cuda" or not inductor:
        where = "on the CPU" if device_type != "cuda" else "without Inductor (runtime.compile=none)"
        return TuningChoice(asked, f"no Triton kernels to tune {where}")
    if asked == "none":
        return TuningChoice(asked, "as asked")
    if asked == "full":  # every variant, or those an earlier resolution of the plan chose
        chosen = pc.tuned_variants if pc.tuned_variants is not None else tuple(v.name for v in pc.variants)
        return TuningChoice(asked, "as asked", chosen, steps=pc.tuned_steps)
    est = estimates(pc, flops_by_res, norm_layers)
    tuned = tuple(k for k, e in est.items() if e.tune)
    parts = []
    for name, e in est.items():
        sign = "above" if e.tune else "below"
        parts.append(f"{name}: {e.steps:,} steps of about {e.seconds:,.0f} s, {GAIN:.0%} saved "
                     f"{e.saving:,.0f} s {sign} the tuning's {e.cost:,.0f} s")
    each = (f"; of those, each kernel where {KERNEL_GAIN:.0%} of its launches' time over the run exceeds "
            f"the {KERNEL_SECONDS:.0f} s its tuning takes" if tuned else "")
    why = "; ".join(parts) + each + "; runtime.tuning=full or none to choose"
    return TuningChoice(asked, why, tuned, est, tuple(est[k].steps for k in tuned))


def resolve(pc, meta_model: torch.nn.Module, device_type: str, inductor: bool):
    """``(pc with runtime.tuning as chosen, the choice)``: ``full`` with the tuned variants in
    ``pc.tuned_variants``, or ``none``, so that every process of the run (the parallel compiles
    receive it) compiles, tunes and keys its saved compiles alike. ``meta_model``: the plan's
    model on the meta device; ``device_type`` and ``inductor``: the run's device type and
    whether Inductor compiles its step."""
    counting = device_type == "cuda" and inductor and pc.runtime.tuning == "auto"
    flops = {r: forward_flops(meta_model, pc.data.channels, r) for r in {v.res for v in pc.variants}} if counting else {}
    norms = sum(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in meta_model.modules())
    choice = choose(pc, device_type, inductor, flops, norms)
    tuned = dataclasses.replace(pc.runtime, tuning="full" if choice.tune else "none")
    return dataclasses.replace(pc, runtime=tuned, tuned_variants=choice.variants, tuned_steps=choice.steps), choice
