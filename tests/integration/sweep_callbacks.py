"""Hydra callbacks that tests name in a sweep's ``hydra.callbacks``: a module of their own, as
light to import as the callback (tr-train imports it in the sweep's process)."""
from __future__ import annotations

from pathlib import Path

from hydra.experimental.callback import Callback


class BlockTheSweepDir(Callback):
    """After job 0, the sweep dir refuses job 1's dir: ``how=readonly`` makes it read-only,
    ``how=file`` (where a mode does not stop this process: root) puts a file where that dir goes."""

    def __init__(self, how: str = "readonly"):
        self.how = how

    def on_job_end(self, config, job_return, **kwargs) -> None:
        if config.hydra.job.num == 0:
            sweep = Path(config.hydra.sweep.dir)
            if self.how == "file":
                (sweep / "1").write_text("")
            else:
                sweep.chmod(0o555)


def modes_bind(tmp: Path) -> bool:
    """Whether a read-only dir refuses this process a new entry (not for root with
    CAP_DAC_OVERRIDE)."""
    probe = tmp / "mode-probe"
    probe.mkdir()
    probe.chmod(0o555)
    try:
        (probe / "x").mkdir()
    except PermissionError:
        return True
    finally:
        probe.chmod(0o755)
    return False
