"""Data parallel on torch.distributed, launched by torchrun (NCCL on GPUs, gloo on CPU).

Every rank compiles the same plan (checked by fingerprint at start); gradients are all-reduced by
region span inside the step (the loss gradient is pre-scaled by 1/world_size, so a SUM is the
mean); BN statistics are averaged over the B span before validation and checkpoints."""
from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from tr_hydra.errors import ConfigError


@dataclass(frozen=True)
class DistContext:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    backend: str = ""

    @property
    def enabled(self) -> bool:
        return self.world_size > 1 or bool(self.backend)

    @property
    def is_main(self) -> bool:
        return self.rank == 0


SINGLE = DistContext()

# torchrun's environment, read without PyTorch (tr-train reads it before importing it)
from tr_hydra.runtime.world import TORCHRUN_HINT, env_world  # noqa: E402,F401


def init(mode: str, device_type: str, timeout_s: int = 600) -> DistContext:
    """Join the process group (once per process) for dist=ddp; dist=none is a single process."""
    if mode == "none":
        return SINGLE
    world = env_world()
    if world is None or "MASTER_ADDR" not in os.environ:
        raise ConfigError(f"dist=ddp: RANK/WORLD_SIZE/MASTER_ADDR are not set; {TORCHRUN_HINT}")
    rank, size, local = world
    backend = "nccl" if device_type == "cuda" else "gloo"
    if device_type == "cuda":
        if local >= torch.cuda.device_count():
            raise ConfigError(f"dist=ddp: LOCAL_RANK {local} but only {torch.cuda.device_count()} GPUs")
        torch.cuda.set_device(local)
    if not dist.is_initialized():
        kw = {"device_id": torch.device("cuda", local)} if device_type == "cuda" else {}
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s), **kw)
    return DistContext(rank, size, local, backend)


def check_same_plan(ctx: DistContext, fingerprint: str, describe: dict) -> None:
    """Stop every rank with one clear message when the ranks compiled different plans."""
    if ctx.world_size <= 1:
        return
    got: list = [None] * ctx.world_size
    dist.all_gather_object(got, (fingerprint, describe))
    if any(g[0] != got[0][0] for g in got):
        odd = next(r for r, g in enumerate(got) if g[0] != got[0][0])
        diff = [f"{k} {got[0][1].get(k)!r} vs {got[odd][1].get(k)!r}" for k in got[0][1]
                if got[0][1].get(k) != got[odd][1].get(k)]
        raise ConfigError(f"dist: rank {odd} compiled another plan than rank 0 "
                          f"({'; '.join(diff) or 'fingerprints differ'}); every rank must run the same config")


def broadcast(ctx: DistContext, obj):
    if ctx.world_size <= 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def all_reduce_sum(ctx: DistContext, t: torch.Tensor) -> None:
    # with dist=ddp the collective runs even for one rank (torchrun --nproc_per_node=1 exercises
    # the same path, NCCL inside the captured graph included)
    if ctx.backend:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)


def all_reduce_mean(ctx: DistContext, t: torch.Tensor) -> None:
    if ctx.backend:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        t.div_(ctx.world_size)


def barrier(ctx: DistContext) -> None:
    if ctx.world_size > 1:
        dist.barrier()


def all_gather(ctx: DistContext, obj) -> list:
    """Every rank's ``obj``, in rank order."""
    if ctx.world_size <= 1:
        return [obj]
    got: list = [None] * ctx.world_size
    dist.all_gather_object(got, obj)
    return got


def any_rank(ctx: DistContext, flag: bool, device: torch.device) -> bool:
    """Whether ``flag`` is set on any rank; every rank gets the same answer (a collective:
    every rank must call it at the same point)."""
    if ctx.world_size <= 1:
        return flag
    t = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def weights_agree(ctx: DistContext, t: torch.Tensor) -> bool:
    """Whether every rank holds the same bytes (compared by a checksum of the span)."""
    if ctx.world_size <= 1:
        return True
    import hashlib
    digest = hashlib.sha256(t.detach().cpu().numpy().tobytes()).hexdigest()
    got: list = [None] * ctx.world_size
    dist.all_gather_object(got, digest)
    return len(set(got)) == 1


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
