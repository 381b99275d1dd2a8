"""What the trainer counts on the host: an epoch's train accumulators, and the whole run's images
and time. A checkpoint carries both (in its ``extra``), so a run stopped inside an epoch
(``trainer.max_steps``, a preemption signal, an error after a checkpoint) and resumed reports that
epoch, and its summary's throughput, as a run that never stopped would. The device's own
accumulator (``R_RESULT_ACCUMULATED``, the samples since the last read) is an arena region,
saved with the others."""
from __future__ import annotations

import dataclasses
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
