"""A run's summary (``metrics.json``'s, TensorBoard's hparams, the last line of the log): the best
validation, the throughput and time, the objective. A resumed run's throughput and time are the
whole run's where its checkpoint carried the earlier processes' part (``tally.RunTally``), else
this process's, and the summary says so (``timed_since_resume``)."""
from __future__ import annotations

import json
import math
from pathlib import Path

from tr_hydra.config import objective


def made(history: list, *, objective_name: str, images: int, train_seconds: float, seconds: float,
         arena_bytes: int, peak_device_bytes: int, steps: int, resumed_at_step: int = 0,
         since_resume: bool = False) -> dict:
    """The summary of a run that trained ``images`` in ``train_seconds`` (``seconds`` in all);
    ``resumed_at_step``: where this process began (0: the run's start); ``since_resume``: the
    figures are this process's alone."""
    out = {**_val(history), "img_per_sec": images / train_seconds if train_seconds else 0.0,
           "total_seconds": seconds, "arena_bytes": arena_bytes, "peak_device_bytes": peak_device_bytes,
           "steps": steps}
    if resumed_at_step:
        out["resumed_at_step"] = resumed_at_step
        if since_resume:
            out["timed_since_resume"] = True
    return out | _objective(history, objective_name)


def kept(run_dir: Path, history: list, step: int, arena_bytes: int, objective_name: str) -> dict:
    """The summary of a run resumed after its last step: the one metrics.json holds for
    that step, or, without one, what the epochs' records say (their training time and
    throughput; this process trained nothing)."""
    try:
        old = json.loads((Path(run_dir) / "metrics.json").read_text()).get("summary") or {}
    except (OSError, ValueError):
        old = {}
    if old.get("steps") == step:
        return old
    n = sum(r["train"]["count"] for r in history)
    secs = sum(r["train"]["count"] / r["img_per_sec"] for r in history if r.get("img_per_sec"))
    return {**_val(history), "img_per_sec": n / secs if secs else 0.0, "total_seconds": secs,
            "arena_bytes": arena_bytes, "peak_device_bytes": 0, "steps": step,
            "from_history": True, **_objective(history, objective_name)}


def line(s: dict) -> str:
    """The log's summary line."""
    at = s.get("resumed_at_step")
    timed = ("" if not at else f" since the resume at step {at}" if s.get("timed_since_resume")
             else f" (the whole run, resumed at step {at})")
    return (f"summary: best val top1 {top1(s['best_val_top1'])}  total {s['total_seconds']:.1f}s  "
            f"{s['img_per_sec']:,.1f} img/s{timed}  arena {s['arena_bytes']:,} bytes  "
            f"peak device memory {s['peak_device_bytes'] / 2**20:,.1f} MiB"
            + (f"  objective {s['objective']} {s['objective_value']:.4f}" if s["objective"] != "val/top1" else ""))


def top1(v: float) -> str:
    """A top-1 figure for the log; n/a where no validation ran (NaN)."""
    return "n/a" if math.isnan(v) else f"{v:.2f}"


def _val(history: list) -> dict:
    vals = [r["val"]["top1"] for r in history if "val" in r]
    return {"best_val_top1": max(vals) if vals else float("nan"),
            "final_val_loss": next((r["val"]["loss"] for r in reversed(history) if "val" in r), float("nan"))}


def _objective(history: list, name: str) -> dict:
    """``trainer.objective`` and its best value over the epochs (NaN without validation)."""
    return {"objective": name, "objective_value": objective.best(history, name)}
