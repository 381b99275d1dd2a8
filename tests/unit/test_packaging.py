"""Every folder of the package is in pyproject.toml's package list: an install that is not
editable would otherwise lack it."""
from __future__ import annotations

import pathlib
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_every_package_folder_is_installed():
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    folders = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "tr_hydra").rglob("__init__.py")}
    assert folders - listed == set()
