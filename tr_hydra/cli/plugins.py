"""Hydra's optional plugins that tr-train documents, and the extra of tr_hydra that brings each:
asking for one that is not installed is one line naming what to install, not Hydra's "Could not
find 'hydra/sweeper/optuna'"."""
from __future__ import annotations

import importlib.util

import yaml

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
