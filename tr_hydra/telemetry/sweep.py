"""Summary table of a multirun sweep, printed when the sweep ends (a Hydra callback, which also
makes a search's optuna log lines plain when the sweep starts).

Every job of the sweep is a row: a finished one with its figures, a failed one (tr-train's task
writes ``failed.txt``, one line, into the job's dir and the sweep goes on) as
``failed: <reason>``, one that stopped without finishing (preempted) as ``not finished``."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from hydra.experimental.callback import Callback

FAILED = "failed.txt"  # a job's one-line reason, in its dir
LAST: dict = {}  # the last summary's rows in this process (tr-train's exit code counts the failed ones)


def _overrides(job: Path) -> list[tuple[str, str]]:
    """The job's overrides as (key, value) pairs, as Hydra saved them for it."""
    path = job / ".hydra" / "overrides.yaml"
    if not path.is_file():
        return []
    import yaml
    try:
        items = [str(o) for o in (yaml.safe_load(path.read_text()) or [])]
    except (OSError, yaml.YAMLError):
        return []
    return [(k, v) for k, _, v in (o.partition("=") for o in items)]


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
    try:
        jobs = [p for p in Path(sweep_dir).iterdir() if p.is_dir() and p.name.isdigit()]
    except OSError:  # an unreadable sweep dir: no rows
        return []
    for job in sorted(jobs, key=lambda p: int(p.name)):
        metrics, failed = job / "metrics.json", job / FAILED
        if not (metrics.is_file() or failed.is_file() or (job / ".hydra").is_dir()):
            continue
        s = {} if failed.is_file() else _summary(metrics)
        rows.append({"job": job.name, "overrides": _overrides(job),
                     "failed": _reason(failed) if failed.is_file() else None,
                     "unfinished": not failed.is_file() and not s,
                     "objective": s.get("objective", "val/top1" if "best_val_top1" in s else None),
                     "objective_value": s.get("objective_value", s.get("best_val_top1")),
                     "img_per_sec": s.get("img_per_sec"), "steps": s.get("steps")})
    return rows


def split_overrides(rows: list[dict]) -> tuple[list[str], list[str]]:
    """(the overrides every job shares, as ``key=value``; the keys whose values differ: the
    swept ones), each in the order the jobs name them."""
    keys: list[str] = []
    for r in rows:
        keys += [k for k, _ in r["overrides"] if k not in keys]
    values = [dict(r["overrides"]) for r in rows]
    fixed = [k for k in keys if all(k in v for v in values) and len({v[k] for v in values}) == 1]
    return [f"{k}={values[0][k]}" for k in fixed], [k for k in keys if k not in fixed]


def _short(v: str) -> str:
    """A long float as a search sweeper writes it (0.30233257263183977) in 6 digits."""
    try:
        f = float(v)
    except ValueError:
        return v
    return f"{f:.6g}" if len(v) > 8 and any(c in v for c in ".e") else v


def _num(v, spec: str, width: int) -> str:
    return f"{v:>{width}{spec}}" if isinstance(v, (int, float)) and v == v else f"{'n/a':>{width}}"


def format_table(rows: list[dict]) -> str:
    """The overrides all jobs share on one line, then a row per job: a column per swept key,
    the objective (best over the job's epochs) and img/s; the best job marked."""
    if not rows:
        return "sweep: no jobs ran"
    from tr_hydra.config.objective import OBJECTIVES, direction
    fixed, swept = split_overrides(rows)
    name = next((r["objective"] for r in rows if r.get("objective")), "val/top1")
    spec = ".4f" if name.endswith("loss") else ".2f"
    done = [r for r in rows if not r["failed"] and not r["unfinished"] and isinstance(r["objective_value"], (int, float))
            and r["objective_value"] == r["objective_value"] and r.get("objective") == name]
    pick = max if name in OBJECTIVES and direction(name) == "max" else min
    best = pick(done, key=lambda r: r["objective_value"]) if done else None
    cols = [(k, max(len(k), *(len(_short(dict(r["overrides"]).get(k, "-"))) for r in rows))) for k in swept]
    title = f"best {name}"
    obj_w = max(len(title), 9)
    lines = [f"fixed: {' '.join(fixed)}"] if fixed else []
    lines.append("  ".join([f"{'job':>4}"] + [f"{k:<{w}}" for k, w in cols] + [f"{title:>{obj_w}}", f"{'img/s':>10}"]))
    for r in rows:
        vals = dict(r["overrides"])
        head = "  ".join([f"{r['job']:>4}"] + [f"{_short(vals.get(k, '-')):<{w}}" for k, w in cols]) + "  "
        if r["failed"]:
            lines.append(head + f"failed: {r['failed']}")
        elif r["unfinished"]:
            lines.append(head + "not finished (stopped before its end: resume=auto in its dir continues it)")
        else:
            lines.append(head + f"{_num(r['objective_value'], spec, obj_w)}  {_num(r['img_per_sec'], ',.1f', 10)}"
                         + ("  <- best" if r is best and len(done) > 1 else ""))
    return "\n".join(lines)


def summarize(sweep_dir: Path, say_unwritten: bool = True) -> list[dict]:
    """The table of the jobs the sweep dir holds (as far as it reads), on stdout and in its
    summary.txt; its rows (also ``LAST["rows"]``). ``say_unwritten``: a summary.txt not written
    is a line on stderr (not where the line that ends the sweep names the dir's error)."""
    sweep_dir = Path(sweep_dir)
    rows = sweep_rows(sweep_dir) if sweep_dir.is_dir() else []
    LAST["rows"] = rows
    table = format_table(rows)
    print(f"\nsweep summary ({sweep_dir}):\n{table}", flush=True)
    try:
        (sweep_dir / "summary.txt").write_text(table + "\n")
    except OSError as e:
        if say_unwritten:
            print(f"tr-train: summary.txt not written: {sweep_dir / 'summary.txt'}: {e.strerror}",
                  file=sys.stderr, flush=True)
    return rows


def plain_optuna_logging() -> None:
    """Optuna's messages through Hydra's logging, as plain as the sweeper's own lines: optuna
    2.x writes them to stderr through its own colorlog handler, ANSI codes even into a pipe or a
    CI log. And alembic's ``setup plugin ...`` lines (INFO, when optuna imports its RDB storage)
    stay below Hydra's INFO. Called before the sweeper imports optuna (the sweep's start)."""
    import logging
    logging.getLogger("alembic").setLevel(logging.WARNING)
    import optuna
    optuna.logging.disable_default_handler()
    optuna.logging.enable_propagation()


class SweepSummary(Callback):
    def on_multirun_start(self, config, **kwargs) -> None:
        if "hydra_optuna_sweeper" in str((config.hydra.get("sweeper") or {}).get("_target_", "")):
            plain_optuna_logging()

    def on_multirun_end(self, config, **kwargs) -> None:
        summarize(Path(config.hydra.sweep.dir))
