"""When a run stops at a step boundary: a preemption signal (SIGTERM, SIGINT), which every rank
agrees on, or training's numbers (``health``: non-finite steps, a collapsed fp16 loss scale).
The epoch loop asks after each step; a stop leaves the loop as ``Stop``, which the trainer turns
into a checkpoint at that step."""
from __future__ import annotations

from tr_hydra.config.plan_config import PlanConfig
from tr_hydra.runtime import distributed
from tr_hydra.runtime.guards import PreemptionGuard
from tr_hydra.train import health


class Stop(Exception):
    """Leaves the epoch loop at a step boundary: ``step``, the run's steps done; ``epoch``, the
    epoch it stops in; ``error``, what stopped it where not a signal (raised after the
    checkpoint)."""

    def __init__(self, step: int, epoch: int, error: Exception | None = None):
        super().__init__(step)
        self.step, self.epoch, self.error = step, epoch, error


class StopPolicy:
    """The stops of ``pc``'s run on the runtime ``rt``; signals are caught while it is entered
    (``with policy:``)."""

    def __init__(self, pc: PlanConfig, rt):
        self.pc, self.rt = pc, rt
        self.guard = PreemptionGuard()

    def __enter__(self) -> StopPolicy:
        self.guard = PreemptionGuard().__enter__()  # (a fit's signals, not an earlier fit's)
        return self

    def __exit__(self, *exc) -> bool:
        return self.guard.__exit__(*exc)

    @property
    def signal_name(self) -> str | None:
        """The signal that stopped the run (None: none came)."""
        return self.guard.stop.signal_name

    def preempted(self, at_log: bool) -> bool:
        """Whether a preemption signal stops the run at this step (``at_log``: a log interval's
        last). With one rank, at any step; with several, at log intervals only, where every rank
        learns whether any got one, so that none is left waiting in a collective."""
        requested = self.guard.stop.requested
        if self.rt.dist.world_size <= 1:
            return requested
        return at_log and distributed.any_rank(self.rt.dist, requested, self.rt.device)

    def after_step(self, step: int, epoch: int, at_log: bool) -> None:
        """Raise ``Stop`` at the run's ``step`` where a preemption signal stops it."""
        if self.preempted(at_log):
            raise Stop(step, epoch)

    def after_read(self, step: int, epoch: int) -> None:
        """Raise ``Stop`` carrying ``health``'s error where training's numbers stop the run
        (asked at each metrics read, never per step: they are device scalars)."""
        try:
            health.check(self.pc, self.rt, step)
        except Exception as e:
            raise Stop(step, epoch, error=e) from None
