"""Learning-rate schedules with linear warm-up; evaluated on the host between steps, written to
the lr device scalar (nothing is re-captured). Which variant each step takes: ``config.epochs``."""
from __future__ import annotations

import bisect
import math

from tr_hydra.config.specs import OptimizerSpec


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
