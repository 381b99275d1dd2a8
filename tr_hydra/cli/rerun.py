"""Rerun a past run from its run dir: every value of its saved config becomes an explicit
override (so today's defaults cannot change it), and its own hydra.* overrides (output dirs)
come along."""
from __future__ import annotations

from pathlib import Path

from tr_hydra.errors import ConfigError

SKIP = {"recipe"}  # a recipe's values are already in the saved config


def _value(v) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, (list, tuple)):
        return "[" + ",".join(_value(x) for x in v) + "]"
    s = str(v).replace("\\", "\\\\").replace("'", "\\'")
    return f"'{s}'"


# Keys added after runs were saved, with the value that reproduces what those runs did (their
# default then); a saved config without the key reruns with it.
_BEFORE_KEY = (("runtime.stem", "conv"), ("runtime.stem_channels", "null"), ("runtime.maxpool", "native"))


def _has(config: dict, dotted: str) -> bool:
    node = config
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


def _leaves(d: dict, prefix: str = "") -> list[str]:
    out = []
    for k, v in d.items():
        if not prefix and k in SKIP:
            continue
        if isinstance(v, dict):
            out += _leaves(v, f"{prefix}{k}.")
        else:
            out.append(f"{prefix}{k}={_value(v)}")
    return out


def rerun_overrides(run_dir: str | Path) -> list[str]:
    import yaml
    hydra_dir = Path(run_dir) / ".hydra"
    cfg_path = hydra_dir / "config.yaml"
    if not cfg_path.is_file():
        raise ConfigError(f"--rerun: {cfg_path} not found (is {run_dir} a tr-train run dir?)")
    config = yaml.safe_load(cfg_path.read_text()) or {}
    overrides = _leaves(config)
    overrides += [f"{key}={value}" for key, value in _BEFORE_KEY if not _has(config, key)]
    hydra_yaml = hydra_dir / "hydra.yaml"
    if hydra_yaml.is_file():
        h = yaml.safe_load(hydra_yaml.read_text()) or {}
        overrides += list(((h.get("hydra") or {}).get("overrides") or {}).get("hydra") or [])
    return overrides
