"""Exceptions a user can act on. The CLIs print them as one line and exit 2."""
from __future__ import annotations


class TrHydraError(Exception):
    """Base class: a mistake in configuration, data or plan that the user can fix."""


class ConfigError(TrHydraError):
    """A config key has a wrong value."""


class PlanError(TrHydraError):
    """The memory plan cannot be built or broke one of its invariants."""


class PlanLockedError(PlanError):
    """Allocation after finalize()."""


class RegionOrderError(PlanError):
    pass


class ContiguityError(PlanError):
    pass


class LayerCorrespondenceError(PlanError):
    pass


class AlignmentError(PlanError):
    pass


class ModelMappingError(PlanError):
    """A model parameter or buffer fits no region."""


class RunDirError(TrHydraError):
    """The run dir cannot be made or written (a path through a file, no permission)."""


class DiskError(RunDirError):
    """A file of the run cannot be written (read-only file system, full disk, no permission):
    the message names the file and the cause."""


class DirInUse(RunDirError):
    """Another live process writes into the dir (``files.hold_dir``); the message names it."""


def disk_error(what: str, path, e: OSError, action: str = "write") -> DiskError:
    """``what: cannot <action> <path>: <cause>`` from an OSError (its strerror, not its repr)."""
    import os
    where = os.fsdecode(path) if path is not None else (os.fsdecode(e.filename) if e.filename else "?")
    return DiskError(f"{what}: cannot {action} {where}: {e.strerror or type(e).__name__}")
