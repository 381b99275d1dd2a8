"""torchrun's environment (and SLURM's, through submitit): which rank this process is, read
without importing PyTorch, so that a command-line tool can tell before it imports it."""
from __future__ import annotations

import os

TORCHRUN_HINT = ("launch with torchrun, e.g. `torchrun --nproc_per_node=2 -m tr_hydra.cli.train dist=ddp ...`")


def _in_submitit_job() -> bool:
    """A task started by submitit: on SLURM (``SLURM_PROCID``), or by its local executor, which
    Hydra's ``submitit_local`` launcher uses and which sets the same kind of variables."""
    return "SLURM_PROCID" in os.environ or os.environ.get("SUBMITIT_EXECUTOR") == "local"


def env_world() -> tuple[int, int, int] | None:
    """(rank, world_size, local_rank) from torchrun's environment, or None. In a task that
    Hydra's submitit launcher started (SLURM, or its local executor; one task per rank, no
    torchrun) the variables are taken from the job's environment through submitit."""
    if "RANK" not in os.environ and _in_submitit_job():
        try:
            from submitit.helpers import TorchDistributedEnvironment
            TorchDistributedEnvironment().export(set_cuda_visible_devices=False)
        except Exception:  # not a submitit job: leave it to the torchrun check
            pass
    try:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0))
    except (KeyError, ValueError):
        return None


def submitit_job() -> str | None:
    """One line on the submitit job this process is a task of (None outside one): what the
    run's log keeps of where it ran."""
    if not _in_submitit_job():
        return None
    try:
        from submitit import JobEnvironment
        env = JobEnvironment()
        return (f"submitit: job {env.job_id} on {env.cluster}, task {env.global_rank} of {env.num_tasks} "
                f"(node {env.node} of {env.num_nodes}, local rank {env.local_rank}); "
                f"rank {os.environ.get('RANK', '?')} of {os.environ.get('WORLD_SIZE', '?')} "
                f"via {os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}")
    except Exception as e:  # noqa: BLE001 - the log line is not worth a failed run
        return f"submitit: the job's environment could not be read ({type(e).__name__}: {e})"
