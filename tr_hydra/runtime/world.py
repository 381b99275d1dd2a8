"""torchrun's environment (and SLURM's, through submitit): which rank this process is, read
without importing PyTorch, so that a command-line tool can tell before it imports it."""
from __future__ import annotations

import os

TORCHRUN_HINT = ("launch with torchrun, e.g. `torchrun --nproc_per_node=2 -m tr_hydra.cli.train dist=ddp ...`")


def env_world() -> tuple[int, int, int] | None:
    """(rank, world_size, local_rank) from torchrun's environment, or None. Under SLURM with
    Hydra's submitit launcher (one task per rank, no torchrun) the variables are taken from
    SLURM through submitit."""
    if "RANK" not in os.environ and "SLURM_PROCID" in os.environ:
        try:
            from submitit.helpers import TorchDistributedEnvironment
            TorchDistributedEnvironment().export(set_cuda_visible_devices=False)
        except Exception:  # not a submitit job: leave it to the torchrun check
            pass
    try:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0))
    except (KeyError, ValueError):
        return None
