"""Find the config tree (conf/ and recipes/) from any working directory."""
from __future__ import annotations

from pathlib import Path

import tr_hydra


def config_dir() -> Path:
    here = Path(tr_hydra.__file__).resolve().parent
    for candidate in (here / "conf", here.parent / "conf"):  # installed wheel, source checkout
        if (candidate / "config.yaml").is_file():
            return candidate
    raise FileNotFoundError(f"tr_hydra config tree not found next to {here}")
