"""Summary table of a multirun sweep, printed when the sweep ends (a Hydra callback).

Every job of the sweep is a row: a finished one with its figures, a failed one (tr-train's task
writes ``failed.txt``, one line, into the job's dir and the sweep goes on) as
``failed: <reason>``, one that stopped without finishing (preempted) as ``not finished``."""
from __future__ import annotations

import json
from pathlib import Path

from hydra.experimental.callback import Callback

FAILED = "failed.txt"  # a job's one-line reason, in its dir
LAST: dict = {}  # the last summary's rows in this process (tr-train's exit code counts the failed ones)


def _overrides(job: Path) -> str:
    path = job / ".hydra" / "overrides.yaml"
    if not path.is_file():
        return ""
    import yaml
    try:
        return " ".join(str(o) for o in (yaml.safe_load(path.read_text()) or []))
    except (OSError, yaml.YAMLError):
        return ""


def _summary(metrics: Path) -> dict:
    try:
        return json.loads(metrics.read_text()).get("summary") or {}
    except (OSError, ValueError, AttributeError):
        return {}


def _reason(failed: Path) -> str:
    try:
        return " ".join(failed.read_text().split()) or "unknown error"
    except OSError as e:
        return f"unknown error ({failed}: {e.strerror})"


def sweep_rows(sweep_dir: Path) -> list[dict]:
    """One row per job dir (0, 1, ...): ``failed`` holds a failed job's reason, ``unfinished``
    marks one that stopped before its end, the figures are a finished job's."""
    rows = []
    jobs = [p for p in Path(sweep_dir).iterdir() if p.is_dir() and p.name.isdigit()]
    for job in sorted(jobs, key=lambda p: int(p.name)):
        metrics, failed = job / "metrics.json", job / FAILED
        if not (metrics.is_file() or failed.is_file() or (job / ".hydra").is_dir()):
            continue
        s = {} if failed.is_file() else _summary(metrics)
        rows.append({"job": job.name, "overrides": _overrides(job),
                     "failed": _reason(failed) if failed.is_file() else None,
                     "unfinished": not failed.is_file() and not s,
                     "best_val_top1": s.get("best_val_top1"), "final_val_loss": s.get("final_val_loss"),
                     "img_per_sec": s.get("img_per_sec"), "steps": s.get("steps")})
    return rows


def _num(v, spec: str, width: int) -> str:
    return f"{v:>{width}{spec}}" if isinstance(v, (int, float)) else f"{'n/a':>{width}}"


def format_table(rows: list[dict]) -> str:
    if not rows:
        return "sweep: no jobs ran"
    width = max(len("overrides"), *(len(r["overrides"]) for r in rows))
    lines = [f"{'job':>4}  {'overrides':<{width}}  {'best val top1':>13}  {'val loss':>9}  {'img/s':>10}"]
    for r in rows:
        head = f"{r['job']:>4}  {r['overrides']:<{width}}  "
        if r.get("failed"):
            lines.append(head + f"failed: {r['failed']}")
        elif r.get("unfinished"):
            lines.append(head + "not finished (stopped before its end: resume=auto in its dir continues it)")
        else:
            lines.append(head + f"{_num(r['best_val_top1'], '.2f', 13)}  {_num(r['final_val_loss'], '.4f', 9)}  "
                         f"{_num(r['img_per_sec'], ',.1f', 10)}")
    return "\n".join(lines)


class SweepSummary(Callback):
    def on_multirun_end(self, config, **kwargs) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        rows = sweep_rows(sweep_dir) if sweep_dir.is_dir() else []
        LAST["rows"] = rows
        table = format_table(rows)
        print(f"\nsweep summary ({sweep_dir}):\n{table}", flush=True)
        try:
            (sweep_dir / "summary.txt").write_text(table + "\n")
        except OSError as e:
            import sys
            print(f"tr-train: summary.txt not written: {sweep_dir / 'summary.txt'}: {e.strerror}",
                  file=sys.stderr, flush=True)
