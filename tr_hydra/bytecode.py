"""Python's compiled bytecode for tr_hydra's processes, where the environment keeps none.

Container images often set ``PYTHONDONTWRITEBYTECODE=1`` and install packages without their
``.pyc`` files. Every Python process then compiles each module it imports from source: PyTorch,
Dynamo and Inductor are about 3,000 modules, and that takes several times longer per process
than with their bytecode cached. A run with parallel compiles starts several such
processes (the launcher, the children, Inductor's compile workers), and the launcher's imports
delay every child. So the command-line tools keep the bytecode in tr_hydra's cache instead
(Python's ``sys.pycache_prefix``), for their own process and, through the environment, for every
process they start; nothing is written next to the installed sources.

``TR_HYDRA_BYTECODE_CACHE`` chooses: unset or ``auto`` keeps it in ``$TR_HYDRA_CACHE/bytecode``
(``~/.cache/tr_hydra/bytecode``) when Python writes none and PyTorch's installation has none;
a path keeps it there whenever Python writes none; ``off`` leaves Python as it is. A prefix the
user set (``PYTHONPYCACHEPREFIX``) is always left alone. Standard library only: this runs before
PyTorch is imported."""
from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

ENV = "TR_HYDRA_BYTECODE_CACHE"
KEPT_ENV = "TR_HYDRA_BYTECODE_KEPT"  # set for the processes started: the folder was tr_hydra's choice
OFF = ("off", "0", "false", "no", "none")

_KEPT: dict[str, str] = {}  # "path": where this process keeps it, once keep() has chosen to


def cache_root() -> Path:
    """tr_hydra's own cache: ``$TR_HYDRA_CACHE``, else ``~/.cache/tr_hydra``."""
    return Path(os.environ.get("TR_HYDRA_CACHE", Path.home() / ".cache" / "tr_hydra"))


def installed_with_bytecode(package: str = "torch") -> bool:
    """Whether ``package``'s ``__init__`` has its bytecode beside it (as ``pip install`` leaves
    it by default). Locates the package without importing it; True where it cannot be found,
    so that nothing is changed for it."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return True
    origin = getattr(spec, "origin", None)
    if not origin or not origin.endswith(".py"):
        return True
    prefix = sys.pycache_prefix
    try:
        sys.pycache_prefix = None  # where an installation keeps it, not a prefix's tree
        return os.path.exists(importlib.util.cache_from_source(origin))
    finally:
        sys.pycache_prefix = prefix


def keep(environ=None) -> str | None:
    """Keep bytecode in tr_hydra's cache if this environment keeps none (see the module's text);
    the folder chosen, or None where Python is left as it is. Sets it for this process (imports
    from now on) and in ``environ`` (``os.environ``: every process started from here on)."""
    environ = os.environ if environ is None else environ
    inherited = environ.get(KEPT_ENV)
    if inherited and sys.pycache_prefix == inherited:  # a tool started by one that chose it
        _KEPT["path"] = inherited
        return inherited
    choice = environ.get(ENV, "auto").strip()
    if choice.lower() in OFF or sys.pycache_prefix or environ.get("PYTHONPYCACHEPREFIX"):
        return None
    if not sys.dont_write_bytecode:  # Python writes it beside the sources, or tries to
        return None
    if choice.lower() in ("", "auto"):
        if installed_with_bytecode():
            return None
        path = cache_root() / "bytecode"
    else:
        path = Path(choice).expanduser()
    try:
        path.mkdir(parents=True, exist_ok=True)
        if not os.access(path, os.W_OK):
            return None
    except OSError:
        return None
    path = str(path.resolve())
    sys.pycache_prefix = path
    sys.dont_write_bytecode = False
    environ["PYTHONPYCACHEPREFIX"] = path
    environ[KEPT_ENV] = path
    environ.pop("PYTHONDONTWRITEBYTECODE", None)
    _KEPT["path"] = path
    return path


def kept() -> str | None:
    """The folder ``keep()`` chose in this process, if it chose one."""
    return _KEPT.get("path")


def note_once() -> str:
    """The log line saying where this process keeps bytecode, the first time it is asked for
    (a sweep's jobs share the process); empty otherwise."""
    path = _KEPT.get("path")
    if not path or _KEPT.get("noted"):
        return ""
    _KEPT["noted"] = "1"
    return (f"Python bytecode: this environment keeps none (PYTHONDONTWRITEBYTECODE), so it is kept in "
            f"{path} for this run's processes ({ENV}=off: not)")
