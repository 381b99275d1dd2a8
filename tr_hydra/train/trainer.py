"""Trainer: build the runtime and the run's components, resume, get every variant ready, then
epochs of replayed steps. What happens around the steps is the components': ``checkpointer``
(resume, checkpoints, final weights), ``validator``, ``metrics_log`` (TensorBoard, progress bar,
epoch records, metrics.json, the summary), ``stop`` (preemption and health)."""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tr_hydra import startup
from tr_hydra.config.plan_config import PlanConfig
from tr_hydra.config.epochs import epoch_schedule, steps_before
from tr_hydra.errors import DiskError
from tr_hydra.runtime.distributed import all_gather, barrier
from tr_hydra.runtime.schedule import lr_at
from tr_hydra.train import summary as sm
from tr_hydra.train import tally
from tr_hydra.train.checkpointer import Checkpointer
from tr_hydra.train.metrics_log import MetricsLog
from tr_hydra.train.stop import Stop, StopPolicy
from tr_hydra.train.validator import Validator


@dataclass
class TrainResult:
    preempted: bool = False
    summary: dict = field(default_factory=dict)
    epochs: list[dict] = field(default_factory=list)
    steps: int = 0
    img_per_sec: float = 0.0
    arena_bytes: int = 0
    capture_seconds: float = 0.0
    start_wait_seconds: list[float] = field(default_factory=list)  # per rank, at the start barrier
    peak_device_bytes: int = 0
    final_path: str | None = None


class Trainer:
    """One training run of ``pc`` in ``run_dir``; ``fit()`` runs it."""

    def __init__(self, pc: PlanConfig, run_dir: str | Path = ".", log=print, telemetry: bool = True):
        self.pc, self.run_dir = pc, Path(run_dir)
        # before the data source, which may take the process's stderr through a filter
        tty = sys.stderr.isatty()
        self.rt, self._launcher = startup.build(pc, log)
        self.is_main, self.log = self.rt.is_main, self.rt.log
        self.telemetry = telemetry and self.is_main
        self.startup: startup.StartupReport | None = None
        self.lr_scale = pc.batch_size * pc.world_size / pc.dist.base_batch if pc.dist.lr_scaling == "linear" else 1.0
        self.steps_per_epoch = len(epoch_schedule(pc, pc.lowres_epochs))  # full-res epoch length
        # the schedule follows trainer.epochs; max_steps only stops early (so a run stopped and
        # resumed follows the same learning-rate curve as one that never stopped)
        self.total_steps = steps_before(pc, pc.trainer.epochs)
        self.tallies = tally.Tallies(self.log)  # what the checkpoints carry of the host's counts
        self.checkpointer = Checkpointer(pc, self.rt, self.run_dir, self.tallies)
        self.validator = Validator(pc, self.rt)
        self.metrics = MetricsLog(pc, self.rt, self.run_dir, progress=pc.trainer.progress and tty,
                                  telemetry=self.telemetry)
        self.stop = StopPolicy(pc, self.rt)

    # the runtime's parts a run is looked at through (tests, tr-train's first line)
    model = property(lambda self: self.rt.model)
    arena = property(lambda self: self.rt.arena)
    ex = property(lambda self: self.rt.ex)
    compiled = property(lambda self: self.rt.compiled)
    source = property(lambda self: self.rt.source)
    feeder = property(lambda self: self.rt.feeder)
    device = property(lambda self: self.rt.device)
    graphs = property(lambda self: self.rt.graphs)

    def run_steps(self, steps: list[tuple[str, int, int]], split: str, step0: int = 0, on_step=None,
                  epoch: int = 0) -> int:
        """``Runtime.run_steps`` with the learning rate of the schedule: ``steps[k]`` is the
        run's step ``step0 + k``."""
        def lr(k):
            return self.lr_scale * lr_at(self.pc.optimizer, step0 + k, self.steps_per_epoch, self.total_steps)
        return self.rt.run_steps(steps, split, lr=lr, on_step=on_step, epoch=epoch)

    def get_ready(self) -> startup.StartupReport:
        """Every variant compiled and captured (on CUDA), once."""
        if self.startup is None:
            launcher, self._launcher = self._launcher, None
            self.startup = startup.get_ready(self.rt, launcher, self.log)
        return self.startup

    def close(self) -> None:
        """Release the captured graphs and the data source (see ``Runtime.close``); the trainer
        cannot step afterwards."""
        if self._launcher is not None:
            self._launcher.close()
            self._launcher = None
        self.rt.close()

    def final_state_dict(self) -> dict[str, torch.Tensor]:
        """The run's weights as they stand, as a ``state_dict``."""
        return self.checkpointer.final_state_dict()

    # ------------------------------------------------------------------ the run
    def _start_together(self) -> list[float]:
        """Under ddp, every rank waits here until all have compiled and captured: the first
        all-reduce would wait anyway, but inside the clock of the first steps. Returns each
        rank's wait (the largest is the ranks' start-up skew)."""
        dist = self.rt.dist
        if dist.world_size <= 1:
            return []
        t = time.perf_counter()
        barrier(dist)
        waits = all_gather(dist, time.perf_counter() - t)
        self.log("all {} ranks ready; waited for the others: {}".format(
            len(waits), ", ".join(f"rank {r} {w:.1f}s" for r, w in enumerate(waits))))
        return waits

    def fit(self) -> TrainResult:
        res = TrainResult(arena_bytes=self.rt.compiled.plan.total_bytes)
        start_epoch, step, history = self.checkpointer.resume()
        # after the restore: startup puts back the resumed arena and random generators after
        # its warm-up, so the first step draws the masks the run that never stopped drew
        self.get_ready()
        res.capture_seconds = self.startup.capture_seconds
        res.start_wait_seconds = self._start_together()
        try:
            self.metrics.open(step)
            start_step = step
            self.tallies.start()
            self.rt.model.train()
            with self.stop:
                try:
                    step = self._epochs(start_epoch, step, history)
                except Stop as stop:
                    return self._stopped(res, stop, history)
            return self._finish(res, step, start_step, history)
        finally:
            self.metrics.close()  # (a no-op once closed; an error's path closes it here)

    def _epochs(self, start_epoch: int, step: int, history: list) -> int:
        pc, rt = self.pc, self.rt
        for epoch in range(start_epoch, pc.trainer.epochs):
            sched = self._schedule(epoch, step)
            if sched is None:
                break
            rt.sync()
            t0 = time.perf_counter()
            so_far = self.tallies.begin_epoch(epoch, step, sched, t0, history, step == steps_before(pc, epoch))
            self.metrics.begin_epoch(epoch, sched, t0)

            def on_step(k, _n=len(sched), _step0=step, _epoch=epoch):
                self.metrics.stepped()
                at_log = (k + 1) % pc.trainer.log_every == 0 or k + 1 == _n
                self.stop.after_step(_step0 + k + 1, _epoch, at_log)
                if at_log:  # the host reads the device accumulator once per log interval, never per step
                    so_far.add(self.metrics.read_train(_step0 + k + 1, k))
                    self.stop.after_read(_step0 + k + 1, _epoch)
            self.run_steps(sched, "train", step0=step, on_step=on_step, epoch=epoch)
            if not sched:
                so_far.add(rt.ex.read_metrics("train"))  # (the samples of its steps since the last read)
            self.metrics.end_epoch()
            rt.sync()
            step += len(sched)
            complete = step == steps_before(pc, epoch + 1)
            self._end_epoch(epoch, self.tallies.end_epoch(complete), complete, history)
        return step

    def _schedule(self, epoch: int, step: int) -> list | None:
        """The steps of ``epoch`` still to run at ``step``, within max_steps; None where the run
        ends before it."""
        pc = self.pc
        sched = epoch_schedule(pc, epoch)[step - steps_before(pc, epoch):]  # skip what is done
        if pc.trainer.max_steps:
            sched = sched[:max(pc.trainer.max_steps - step, 0)]
        # (done: resumed after the epoch's last step, before its record)
        done = self.tallies.epoch_before is not None and step == steps_before(pc, epoch + 1)
        return sched if sched or done else None

    def _end_epoch(self, epoch: int, so_far: tally.EpochTally, complete: bool, history: list) -> None:
        """``epoch`` ran its steps (``complete``: to its end): its EMA switch and validation where
        due, its record, its checkpoint where due, metrics.json."""
        pc, t, step = self.pc, self.pc.trainer, so_far.step
        if complete and t.sema_every and pc.ema and (epoch + 1) % t.sema_every == 0:
            self.rt.ex.sema_switch()
        validate = complete and ((epoch + 1) % t.val_every == 0 or epoch + 1 == t.epochs)
        self.metrics.record(epoch, so_far, self.validator.validate() if validate else {}, history)
        last = epoch + 1 == t.epochs or (t.max_steps and step >= t.max_steps)
        if t.checkpoint_every and ((epoch + 1) % t.checkpoint_every == 0 or last):
            self.checkpointer.save(epoch + 1 if complete else epoch, step, history)
        self.metrics.write(history)

    def _stopped(self, res: TrainResult, stop: Stop, history: list) -> TrainResult:
        """The loop stopped at a step boundary: a checkpoint there, then the error that stopped
        it, or the result of a preempted run."""
        self.rt.sync()
        try:
            path = self.checkpointer.save(stop.epoch, stop.step, history)
            self.metrics.write(history)
        except DiskError as e:
            if stop.error is None:
                raise
            # the error that stopped the run comes first; the last checkpoint written stays
            raise type(stop.error)(f"{stop.error}; no checkpoint at the stop ({e})") from None
        self.metrics.close()
        if stop.error is not None:
            self.log(f"checkpoint before stopping: {path}")
            raise stop.error from None  # (not chained to the Stop that carried it)
        self.log(f"stopped by {self.stop.signal_name} at step {stop.step}; checkpoint {path}; "
                 f"continue with resume=auto (same run dir)")
        res.epochs, res.steps, res.preempted = history, stop.step, True
        return res

    def _finish(self, res: TrainResult, step: int, start_step: int, history: list) -> TrainResult:
        """The epochs are done: the final weights, and the run's summary."""
        rt = self.rt
        res.epochs, res.steps = history, step
        if rt.device.type == "cuda":
            res.peak_device_bytes = torch.cuda.max_memory_allocated(rt.device)
        res.final_path = str(self.checkpointer.save_final())
        run = self.tallies.whole_run()  # (with the run's earlier processes, where known)
        res.img_per_sec = run.images / run.train_seconds if run.train_seconds else 0.0
        if step == start_step and step > 0 and not self.metrics.records:  # a resumed run that was already complete
            kept = sm.kept(self.run_dir, history, step, rt.compiled.plan.total_bytes, self.pc.trainer.objective)
            res.img_per_sec = kept.get("img_per_sec", 0.0)
            res.peak_device_bytes, res.summary = kept.get("peak_device_bytes", 0), kept
            self.metrics.finish(history, kept, f"nothing to train: the run was complete at step {step}; its "
                                f"summary is kept (best val top1 {sm.top1(kept['best_val_top1'])}, "
                                f"{res.img_per_sec:,.1f} img/s)", hparams=False)
            return res
        made = sm.made(history, objective_name=self.pc.trainer.objective, images=run.images,
                       train_seconds=run.train_seconds, seconds=run.seconds, arena_bytes=res.arena_bytes,
                       peak_device_bytes=res.peak_device_bytes, steps=step, resumed_at_step=start_step,
                       since_resume=self.tallies.run_before is None)
        if res.start_wait_seconds:
            made["start_wait_seconds"] = res.start_wait_seconds
        res.summary = made
        self.metrics.finish(history, made, sm.line(made))
        return res
