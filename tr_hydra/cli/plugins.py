"""Hydra's optional plugins that tr-train documents, and the extra of tr_hydra that brings each:
asking for one that is not installed is one line naming what to install, not Hydra's "Could not
find 'hydra/sweeper/optuna'". And an error a sweeper raises once the sweep began (Hydra's traceback,
without the sweep's summary) is the end of the sweep: its summary and one line."""
from __future__ import annotations

import contextlib
import importlib.util
import os
from pathlib import Path

import yaml

from tr_hydra.cli._common import one_line
from tr_hydra.config.locate import config_dir
from tr_hydra.errors import ConfigError

# (config group, option) -> (the plugin's module, tr_hydra's extra, the package on PyPI)
PLUGINS = {
    ("hydra/sweeper", "optuna"): ("hydra_plugins.hydra_optuna_sweeper", "search", "hydra-optuna-sweeper"),
    ("hydra/launcher", "submitit_local"): ("hydra_plugins.hydra_submitit_launcher", "slurm", "hydra-submitit-launcher"),
    ("hydra/launcher", "submitit_slurm"): ("hydra_plugins.hydra_submitit_launcher", "slurm", "hydra-submitit-launcher"),
}
GROUPS = {"hydra/sweeper", "hydra/launcher"}


def _search_config_choices(name: str) -> list[tuple[str, str]]:
    """The plugins a config of conf/hparams_search/ selects (``override /hydra/sweeper: optuna``)."""
    path = config_dir() / "hparams_search" / f"{name}.yaml"
    try:
        doc = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError):
        return []  # Hydra names a missing or broken config itself
    out = []
    for entry in doc.get("defaults") or []:
        for key, value in (entry.items() if isinstance(entry, dict) else ()):
            group = str(key).replace("override", "").strip().lstrip("/")
            if group in GROUPS:
                out.append((group, str(value)))
    return out


def asked_for(overrides: list[str]) -> list[tuple[str, str, str]]:
    """(group, option, the override that asks) for every plugin choice on the command line,
    directly (``hydra/sweeper=optuna``) or through a search config (``hparams_search=optuna``)."""
    out = []
    for o in overrides:
        key, _, value = o.partition("=")
        key = key.lstrip("+~")
        if key in GROUPS:
            out.append((key, value, o))
        elif key == "hparams_search" and value not in ("", "null"):
            out += [(g, v, o) for g, v in _search_config_choices(value)]
    return out


def check_plugins(overrides: list[str]) -> None:
    """A plugin asked for but not installed: one line naming the extra that brings it."""
    for group, option, via in asked_for(overrides):
        known = PLUGINS.get((group, option))
        if known and importlib.util.find_spec(known[0]) is None:
            module, extra, package = known
            raise ConfigError(f"{via}: {group}={option} needs {package}, an optional extra of tr_hydra: "
                              f"pip install 'tr_hydra[{extra}]' (in a checkout: pip install -e '.[{extra}]')")


def search_sweeper(hydra_cfg) -> bool:
    """True when the sweep is driven by a sweeper other than Hydra's basic one (a search)."""
    target = str((hydra_cfg.get("sweeper") or {}).get("_target_", ""))
    return bool(target) and not target.endswith("BasicSweeper")


class SweepStopped(BaseException):
    """A sweeper's error once the sweep has begun (its jobs may have run), raised past Hydra's
    report of it (a traceback and exit 1) to tr-train, which ends the sweep with its summary and
    one line. A BaseException: Hydra's ``run_and_report`` catches Exception only."""

    def __init__(self, sweep_dir: str, error: Exception):
        super().__init__(str(error))
        self.sweep_dir, self.error = sweep_dir, error


@contextlib.contextmanager
def sweep_stops():
    """Within it, an error the sweeper raises from ``sweep()`` (optuna's ``No trials are completed
    yet`` when every trial failed, a sweep dir that refuses a job's dir) is a SweepStopped. Hydra
    has no hook there: its ``Hydra.multirun`` calls the sweeper and skips the callbacks' end when
    it raises, so the sweeper Hydra instantiates gets a guarded ``sweep``. With HYDRA_FULL_ERROR=1
    Hydra's own traceback stays."""
    from hydra.core.plugins import Plugins
    real = Plugins.instantiate_sweeper

    def instantiate_sweeper(self, **kwargs):
        sweeper = real(self, **kwargs)
        sweep, sweep_dir = sweeper.sweep, str(kwargs["config"].hydra.sweep.dir)

        def guarded(*args, **kw):
            try:
                return sweep(*args, **kw)
            except Exception as e:  # noqa: BLE001 - every sweeper's error ends the sweep the same way
                raise SweepStopped(sweep_dir, e) from e
        sweeper.sweep = guarded
        return sweeper

    if os.environ.get("HYDRA_FULL_ERROR") == "1":
        yield
        return
    Plugins.instantiate_sweeper = instantiate_sweeper
    try:
        yield
    finally:
        Plugins.instantiate_sweeper = real


def stopped(sweep_dir: Path, error: Exception) -> str:
    """A sweep its sweeper stopped with ``error``: the summary of what ran (stdout), and the one
    line that ends it. A search whose every trial failed (optuna's ``No trials are completed
    yet`` when it looks for the best) says so; a disk error names the file and its cause."""
    from tr_hydra.telemetry.sweep import summarize
    sweep_dir = Path(sweep_dir)
    disk = isinstance(error, OSError)
    rows = summarize(sweep_dir, say_unwritten=not disk)
    n = len(rows)
    if isinstance(error, ValueError) and rows and all(r["failed"] for r in rows):
        return (f"every trial of the search failed ({n} of {n}, rows 'failed:' in the summary): "
                f"no best trial, no optimization_results.yaml")
    ran = f"the sweep stopped after {n} job{'s' if n != 1 else ''}"
    if disk:
        where = f"{error.filename}: " if error.filename else ""
        inside = error.filename and Path(str(error.filename)).resolve().is_relative_to(sweep_dir.resolve())
        cause = error.strerror or one_line(error)
        return f"{ran}: hydra.sweep.dir={sweep_dir}: {where}{cause}" if inside else f"{ran}: {where}{cause}"
    return f"{ran}: {one_line(error)}"
