"""The run dir a run (or a sweep's job) writes into: it can be made and written into, and it
holds no other run's results, unless the run resumes that same run. Checked before Hydra
writes anything there."""
from __future__ import annotations

import os
from pathlib import Path

from tr_hydra.errors import ConfigError
from tr_hydra.files import hold_dir

_HELD: list[int] = []  # the dirs this process owns (their locks' descriptors), until it ends

RESULTS = ("metrics.json", "model_final.pt")


def results_in(run_dir) -> list[str]:
    """What of a run a dir holds: metrics.json, model_final.pt, checkpoints (empty: none)."""
    d = Path(run_dir)
    found = [n for n in RESULTS if (d / n).is_file()]
    n = len(list((d / "checkpoints").glob("ckpt_e*_s*.pt"))) if (d / "checkpoints").is_dir() else 0
    if n:
        found.append(f"{n} checkpoint{'s' if n != 1 else ''}")
    return found


def _saved_describe(run_dir) -> dict | None:
    import json
    try:
        d = json.loads((Path(run_dir) / "metrics.json").read_text()).get("describe")
    except (OSError, ValueError, AttributeError):
        return None
    return d if isinstance(d, dict) else None


def _saved_model(run_dir) -> dict:
    """The model section of the config saved in the run dir (.hydra/config.yaml: still the
    earlier run's before this one writes its own record)."""
    from tr_hydra.cli.record import saved_config
    m = (saved_config(run_dir) or {}).get("model")
    return m if isinstance(m, dict) else {}


def check_run_dir(key: str, run_dir, pc) -> None:
    """A run never writes into another run's results. A dir that holds metrics.json,
    model_final.pt or checkpoints is taken only by a resume (``resume=auto`` or a checkpoint)
    of that same run: one of the same plan, as the dir records it: metrics.json's
    ``describe`` (model, classes, optimizer, precision, EMA, folding, variant shapes) and the
    model section of the saved .hydra/config.yaml (width, zero_init_residual: the rest of the
    plan's fingerprint); the resume itself then checks the checkpoint's fingerprint. Anything
    else is refused before anything is written there."""
    found = results_in(run_dir)
    if not found:
        return
    where = f"{key}={run_dir}" if key == "hydra.run.dir" else f"the job's dir {run_dir}"
    held = f"{where} already holds a run's results ({', '.join(found)})"
    if not pc.resume:
        raise ConfigError(f"{held}; a run never writes over another's: leave {key} out (a new dir), "
                          f"pick another, or add resume=auto to continue that run")
    saved = _saved_describe(run_dir) or {}
    diffs = [f"{k} {saved[k]!r} there, {v!r} here" for k, v in pc.describe().items() if k in saved and saved[k] != v]
    model = _saved_model(run_dir)
    diffs += [f"model.{k} {model[k]!r} there, {v!r} here" for k, v in vars(pc.model).items()
              if k not in ("name", "num_classes", "init_from") and k in model and model[k] != v
              and not (isinstance(model[k], str) and "${" in model[k])]  # saved unresolved
    if diffs:
        raise ConfigError(f"{held} of another plan ({'; '.join(diffs)}); a resume continues only "
                          f"that same run: pick another {key}")


def check_writable(key: str, path) -> None:
    """``path`` (a run or sweep dir) can be made and written into; refused naming the path and
    the cause otherwise. The dirs made for the check are removed again (Hydra makes them)."""
    import tempfile
    p = Path(path)
    made = _missing(p)
    q = made[-1].parent if made else p
    if os.path.lexists(q) and not q.is_dir():
        kind = "a file, not a directory" if q.is_file() else "not a directory"
        raise ConfigError(f"{key}={path}: cannot make the dir: {q} is {kind}")
    try:
        p.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=p, prefix=".tr_hydra_write_check")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        bad = e.filename if e.filename and Path(e.filename) != p and not str(e.filename).startswith(
            str(p / ".tr_hydra_write_check")) else None
        what = f"cannot make {p}" if made else f"cannot write into {p}"
        raise ConfigError(f"{key}={path}: {what}: {e.strerror or e}" + (f" ({bad})" if bad else "")) from None
    finally:
        _remove(made)


def _missing(p: Path) -> list[Path]:
    """``p`` and those of its parents that do not exist, deepest first."""
    made, q = [], p
    while not os.path.lexists(q) and q != q.parent:
        made.append(q)
        q = q.parent
    return made


def _remove(made: list[Path]) -> None:
    """The dirs ``_missing`` named, deepest first, where they are (still) empty."""
    for d in made:
        try:
            d.rmdir()
        except OSError:
            pass


def take_dir(key: str, path, check) -> None:
    """Make ``path`` (a run or sweep dir) this process's: made where missing, locked
    (``files.hold_dir``: a second tr-train on it is refused naming this one's pid), then
    ``check()`` under the lock (it holds no other run's results, now that no other run can start
    there). Refused, the dirs made for it are removed again: a refused run leaves nothing."""
    p = Path(path)
    made = _missing(p)
    p.mkdir(parents=True, exist_ok=True)  # check_writable said it can be made
    fd = None
    try:
        fd = hold_dir(p, key)
        check()
    except BaseException:
        if fd is not None:
            os.close(fd)
        _remove(made)
        raise
    _HELD.append(fd)
