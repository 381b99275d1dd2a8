"""Learning-rate schedules with linear warm-up; evaluated on the host between steps, written to
the lr device scalar (nothing is re-captured)."""
from __future__ import annotations

import bisect
import math

from tr_hydra.config.plan_config import OptimizerSpec, PlanConfig


def lr_at(opt: OptimizerSpec, step: int, steps_per_epoch: int, total_steps: int) -> float:
    warm = int(round(opt.warmup_epochs * steps_per_epoch))
    if warm and step < warm:
        return opt.lr * (step + 1) / warm
    if opt.schedule == "constant":
        return opt.lr
    if opt.schedule == "step":
        epoch = step / max(steps_per_epoch, 1)
        return opt.lr * opt.gamma ** bisect.bisect_right(list(opt.milestones), epoch)
    span = max(total_steps - warm, 1)
    t = min(max(step - warm, 0) / span, 1.0)
    if opt.schedule == "cosine":
        return opt.min_lr + (opt.lr - opt.min_lr) * 0.5 * (1.0 + math.cos(math.pi * t))
    if opt.schedule == "poly":
        return opt.min_lr + (opt.lr - opt.min_lr) * (1.0 - t) ** opt.poly_power
    raise ValueError(f"unknown schedule {opt.schedule}")


def epoch_schedule(pc: PlanConfig, epoch: int) -> list[tuple[str, int, int]]:
    """(variant, batch index, batch size) of every step of an epoch, in order."""
    low = epoch < pc.lowres_epochs
    base, last = ("train_lowres", "train_lowres_last") if low else ("train_base", "train_last")
    full = pc.train_size // pc.batch_size
    steps = [(base, i, pc.batch_size) for i in range(full)]
    if pc.has_variant(last):
        steps.append((last, full, pc.variant(last).batch))
    return steps


def val_schedule(pc: PlanConfig) -> list[tuple[str, int, int]]:
    """(variant, batch index, batch size) of every validation step; the partial last batch is
    val_last's."""
    if not pc.has_variant("val_base"):
        return []
    vb = pc.variant("val_base").batch
    steps = [("val_base", i, vb) for i in range(pc.val_size // vb)]
    if pc.has_variant("val_last"):
        steps.append(("val_last", len(steps), pc.variant("val_last").batch))
    return steps


def steps_before(pc: PlanConfig, epoch: int) -> int:
    """The run's steps in the epochs before ``epoch``."""
    return sum(len(epoch_schedule(pc, e)) for e in range(epoch))
