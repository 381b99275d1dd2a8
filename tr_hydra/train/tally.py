"""What the trainer counts on the host: an epoch's train accumulators, and the whole run's images
and time. A checkpoint carries both (in its ``extra``), so a run stopped inside an epoch
(``trainer.max_steps``, a preemption signal, an error after a checkpoint) and resumed reports that
epoch, and its summary's throughput, as a run that never stopped would. The device's own
accumulator (``R_RESULT_ACCUMULATED``, the samples since the last read) is an arena region,
saved with the others."""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

EPOCH_KEY, RUN_KEY = "epoch_so_far", "run_so_far"  # their names in a checkpoint's extra


@dataclass
class EpochTally:
    """One epoch's train metrics so far: loss, top1 and top5 summed over samples (each read's
    mean times its count), the samples counted, the images stepped and the seconds they took;
    ``step``: the run's steps when it was saved; ``from_step``: where its train metrics start
    (after the epoch's start where a checkpoint without its tally was resumed inside it)."""
    epoch: int
    step: int = 0
    from_step: int = 0
    loss: float = 0.0
    top1: float = 0.0
    top5: float = 0.0
    count: float = 0.0
    images: int = 0
    seconds: float = 0.0

    def add(self, m: dict) -> None:
        """One read of the device's accumulator (``Executor.read_metrics``)."""
        for key in ("loss", "top1", "top5"):
            setattr(self, key, getattr(self, key) + m[key] * m["count"])
        self.count += m["count"]

    def train(self) -> dict:
        n = max(self.count, 1.0)
        return {k: getattr(self, k) / n for k in ("loss", "top1", "top5")} | {"count": self.count}

    def plus(self, images: int, seconds: float, step: int) -> EpochTally:
        """A copy with this process's ``images`` and ``seconds`` of the epoch added, at ``step``."""
        return dataclasses.replace(self, images=self.images + images, seconds=self.seconds + seconds, step=step)


@dataclass
class RunTally:
    """The run's images trained, seconds spent training them, and seconds in all (from the
    start of the epochs, over every process of the run)."""
    images: int = 0
    train_seconds: float = 0.0
    seconds: float = 0.0

    def plus(self, images: int, train_seconds: float, seconds: float) -> RunTally:
        return RunTally(self.images + images, self.train_seconds + train_seconds, self.seconds + seconds)


class Tallies:
    """What the host has counted of the run at any step of a fit: the epoch in progress, the last
    one cut short by max_steps, this process's images and train seconds, and the resumed
    checkpoint's part (``epoch_before``: the epoch it stopped inside, None where it predates
    the tallies or the resume goes on elsewhere; ``run_before``: the run's earlier processes,
    None where not known). ``extra`` is what a checkpoint saved at that step carries."""

    def __init__(self, log):
        self.log = log  # (the resume note of ``begin_epoch``)
        self.epoch_before: EpochTally | None = None
        self.run_before: RunTally | None = RunTally()
        self.images, self.train_seconds = 0, 0.0
        self._t_run: float | None = None
        self._running: tuple | None = None  # (its tally, its steps, its first step, its start time)
        self._cut_short: EpochTally | None = None

    def start(self) -> None:
        """A fit starts: this process's counts from zero, its clock from now."""
        self.images, self.train_seconds, self._t_run = 0, 0.0, time.perf_counter()

    def begin_epoch(self, epoch: int, step: int, sched: list, t0: float, history: list,
                    at_start: bool) -> EpochTally:
        """The tally ``epoch`` starts from at ``step`` (``at_start``: its first step), running
        ``sched`` from ``t0``: none at its start; resumed inside it, the checkpoint's, whose epoch
        record (written where max_steps cut the epoch short) this epoch's record replaces in
        ``history``; without one (an older checkpoint), a fresh tally marked with the step its
        train metrics start from."""
        if at_start:
            so_far = EpochTally(epoch)
        else:
            before, self.epoch_before = self.epoch_before, None
            if before is None:
                self.log(f"resume: the checkpoint has no tally of epoch {epoch + 1} before step {step}; "
                         f"that epoch's train metrics cover steps {step + 1} on")
                so_far = EpochTally(epoch, from_step=step)
            else:
                if history and (history[-1]["epoch"], history[-1]["step"]) == (epoch + 1, step):
                    history.pop()
                so_far = before
        self._running, self._cut_short = (so_far, sched, step, t0), None
        return so_far

    def end_epoch(self, complete: bool) -> EpochTally:
        """The epoch in progress ran all its steps (``complete``: to the epoch's end, else
        max_steps cut it short): its tally with the images and seconds added."""
        so_far, sched, step0, t0 = self._running
        n, dt = sum(s[2] for s in sched), time.perf_counter() - t0
        self.images, self.train_seconds = self.images + n, self.train_seconds + dt
        so_far = so_far.plus(n, dt, step0 + len(sched))
        self._running, self._cut_short = None, None if complete else so_far
        return so_far

    def extra(self, step: int) -> dict:
        """A checkpoint's tallies at ``step``: the epoch it stops inside (in progress, or cut
        short by max_steps), and the whole run's images and seconds."""
        images, secs, epoch = self.images, self.train_seconds, self._cut_short
        if self._running is not None:  # a stop inside the epoch in progress
            so_far, sched, step0, t0 = self._running
            n, dt = sum(s[2] for s in sched[:step - step0]), time.perf_counter() - t0
            images, secs, epoch = images + n, secs + dt, so_far.plus(n, dt, step)
        wall = time.perf_counter() - self._t_run if self._t_run is not None else 0.0
        # (after a resume from a checkpoint without them, the run's earlier part is not known)
        run = self.run_before.plus(images, secs, wall) if self.run_before is not None else None
        return to_extra(epoch, run)

    def whole_run(self) -> RunTally:
        """The run's images, train seconds and seconds so far: this process's, and its earlier
        processes' where known."""
        wall = time.perf_counter() - self._t_run if self._t_run is not None else 0.0
        return (self.run_before or RunTally()).plus(self.images, self.train_seconds, wall)


def check_extra(extra: dict) -> str | None:
    """What is wrong with the tallies in a checkpoint's ``extra`` (None: nothing, or none there)."""
    for key, cls in ((EPOCH_KEY, EpochTally), (RUN_KEY, RunTally)):
        if key not in extra:
            continue
        value = extra[key]
        if not isinstance(value, dict):
            return f"extra.{key} is {type(value).__name__}, not dict"
        for f in dataclasses.fields(cls):
            v = value.get(f.name)
            want = (int,) if f.type == "int" else (int, float)
            if not isinstance(v, want) or isinstance(v, bool):
                return f"extra.{key}.{f.name} is {'missing' if v is None else type(v).__name__}, not {f.type}"
    return None


def from_extra(extra: dict) -> tuple[EpochTally | None, RunTally | None]:
    """The tallies of a checkpoint (after ``check_extra``); None for each one it predates."""
    def made(key, cls):
        value = extra.get(key)
        return cls(**{f.name: value[f.name] for f in dataclasses.fields(cls)}) if value is not None else None
    return made(EPOCH_KEY, EpochTally), made(RUN_KEY, RunTally)


def to_extra(epoch: EpochTally | None, run: RunTally | None) -> dict:
    return {key: dataclasses.asdict(t) for key, t in ((EPOCH_KEY, epoch), (RUN_KEY, run)) if t is not None}
