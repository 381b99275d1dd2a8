"""Files written whole or not at all (checkpoints, metrics, weights, tr-prepare's index), the
dirs they go into, and dirs that one process at a time writes into (a run dir, a sweep dir,
tr-prepare's output)."""
from __future__ import annotations

import os
from pathlib import Path

from tr_hydra.errors import DirInUse, disk_error


def jsonable(x):
    """Plain JSON types (tuples to lists, non-finite floats kept as floats): what metrics.json
    and a checkpoint's config and history hold."""
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    return x


def make_dir(d: Path, what: str) -> None:
    """``d`` and its missing parents; a ``DiskError("<what>: cannot create <d>: <cause>")``
    where they cannot be made."""
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise disk_error(what, d, e, "create") from None


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


def _holder(fd: int) -> str:
    """The pid holding a lock on ``fd``'s inode, from /proc/locks ("pid unknown" elsewhere)."""
    st = os.fstat(fd)
    inode = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    try:
        with open("/proc/locks") as f:
            for line in f:
                parts = line.split()
                if len(parts) > 5 and parts[1] == "FLOCK" and parts[5] == inode:
                    return f"pid {parts[4]}"
    except OSError:
        pass
    return "pid unknown"


def hold_dir(path, what: str) -> int:
    """An exclusive lock on the dir ``path`` (which exists) for as long as this process lives:
    a second process asking for it gets ``DirInUse("<what>: <path> is in use by another run
    (pid N) ...")`` at once. The lock is on the dir itself, so holding it writes nothing there;
    the kernel drops it when the process ends, however it ends. Returns the descriptor (kept open,
    not inherited by child programs)."""
    import fcntl
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _holder(fd)
        os.close(fd)
        raise DirInUse(f"{what}: {os.fsdecode(path)} is in use by another run ({holder}); "
                       f"wait for it to end, or pick another dir") from None
    except OSError:  # a file system without locks: run unlocked rather than not at all
        pass
    return fd
