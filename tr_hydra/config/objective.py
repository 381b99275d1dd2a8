"""The number a run is judged by (``trainer.objective``): a validation metric, best over the
epochs that ran validation. tr-train's task returns it, so Hydra's sweepers (Optuna, Nevergrad,
Ax) can search for the configuration that makes it best."""
from __future__ import annotations

import math

from tr_hydra.errors import ConfigError

# name -> (record in an epoch's history, metric, "max" or "min")
OBJECTIVES: dict[str, tuple[str, str, str]] = {
    "val/top1": ("val", "top1", "max"),
    "val/top5": ("val", "top5", "max"),
    "val/loss": ("val", "loss", "min"),
    "val_ema/top1": ("val_ema", "top1", "max"),
    "val_ema/top5": ("val_ema", "top5", "max"),
    "val_ema/loss": ("val_ema", "loss", "min"),
}
SWEEPER_DIRECTION = {"max": "maximize", "min": "minimize"}


def check(name: str, ema: bool) -> None:
    """One line for an objective the run cannot report."""
    if name not in OBJECTIVES:
        raise ConfigError(f"trainer.objective: {name!r} is not one of {', '.join(OBJECTIVES)}")
    if OBJECTIVES[name][0] == "val_ema" and not ema:
        raise ConfigError(f"trainer.objective={name} needs ema=true (no EMA weights are validated)")


def direction(name: str) -> str:
    """``max`` or ``min``: which way is better."""
    return OBJECTIVES[name][2]


def best(history: list[dict], name: str) -> float:
    """The best value of ``name`` over the epochs of ``history`` (metrics.json's records) that
    ran validation; NaN where none did or every value is non-finite."""
    split, metric, way = OBJECTIVES[name]
    vals = [r[split][metric] for r in history if isinstance(r.get(split), dict) and metric in r[split]]
    vals = [float(v) for v in vals if v is not None and math.isfinite(float(v))]
    if not vals:
        return float("nan")
    return max(vals) if way == "max" else min(vals)


def check_sweeper_direction(name: str, sweeper_direction) -> None:
    """A search sweeper told to go the wrong way would look for the worst run: one line."""
    if sweeper_direction is None or name not in OBJECTIVES:
        return
    given = [str(d).lower().split(".")[-1] for d in (
        sweeper_direction if isinstance(sweeper_direction, (list, tuple)) else [sweeper_direction])]
    want = SWEEPER_DIRECTION[direction(name)]
    if len(given) == 1 and given[0] in SWEEPER_DIRECTION.values() and given[0] != want:
        raise ConfigError(f"trainer.objective={name} is {'maximised' if want == 'maximize' else 'minimised'}, "
                          f"but hydra.sweeper.direction={given[0]} would search for the worst run: "
                          f"set hydra.sweeper.direction={want}")
