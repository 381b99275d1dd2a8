"""Files written whole or not at all: checkpoints, metrics, weights, tr-prepare's index."""
from __future__ import annotations

import os
from pathlib import Path

from tr_hydra.errors import disk_error


def write_atomic(path: Path, *parts: bytes, what: str = "checkpoint") -> Path:
    """``parts`` written to a temporary name, fsynced and renamed over ``path``: a reader, or
    a crash, sees the old file or the new one, never half of one. A write that fails removes
    the temporary file and raises ``DiskError("<what>: cannot write <path>: <cause>")``."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            for part in parts:
                f.write(part)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass  # a read-only directory: the open failed, so there is no temporary file
        raise disk_error(what, path, e) from None
    try:  # make the rename itself durable
        fd = os.open(path.parent, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
    except OSError:
        pass
    return path
