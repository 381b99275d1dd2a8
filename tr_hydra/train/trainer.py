"""Trainer: build the runtime, resume, get every variant ready, then epochs of replayed steps,
validation, metrics and checkpoints."""
from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tr_hydra import startup
from tr_hydra.config.plan_config import PlanConfig
from tr_hydra.errors import DiskError, disk_error
from tr_hydra.config.epochs import epoch_schedule, val_schedule
from tr_hydra.runtime.schedule import lr_at
from tr_hydra.train import checkpoint as ck
from tr_hydra.train import health, tally
from tr_hydra.train import summary as sm


def _jsonable(x):
    """Plain JSON types (tuples to lists, non-finite floats kept as floats)."""
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    return x


def _mkdir(d: Path, what: str) -> None:
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise disk_error(what, d, e, "create") from None


class _Stop(Exception):
    """Leaves the epoch loop at a step boundary (preemption, or an error after a checkpoint)."""

    def __init__(self, step: int, epoch: int, error: Exception | None = None):
        super().__init__(step)
        self.step, self.epoch, self.error = step, epoch, error


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
        self._tty = sys.stderr.isatty()
        self.rt, self._launcher = startup.build(pc, log)
        self.is_main, self.log = self.rt.is_main, self.rt.log
        self.telemetry = telemetry and self.is_main
        self.startup: startup.StartupReport | None = None
        self.lr_scale = pc.batch_size * pc.world_size / pc.dist.base_batch if pc.dist.lr_scaling == "linear" else 1.0
        self.steps_per_epoch = len(epoch_schedule(pc, pc.lowres_epochs))  # full-res epoch length
        # the schedule follows trainer.epochs; max_steps only stops early (so a run stopped and
        # resumed follows the same learning-rate curve as one that never stopped)
        self.total_steps = sum(len(epoch_schedule(pc, e)) for e in range(pc.trainer.epochs))
        # what the checkpoints carry of the host's counts (``tally``): the resumed checkpoint's
        # epoch so far and run so far (None: a checkpoint older than them), this process's images
        # and train seconds, the epoch in progress and the last epoch cut short by max_steps
        self._epoch_before: tally.EpochTally | None = None
        self._run_before: tally.RunTally | None = tally.RunTally()
        self._images, self._train_time, self._t_run = 0, 0.0, None
        self._running, self._cut_short, self._recorded = None, None, 0

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

    # ------------------------------------------------------------------ validation
    def validate(self) -> dict[str, dict]:
        rt, ex = self.rt, self.rt.ex
        out = {}
        ex.sync_bn_stats()
        ex.before_validation()
        rt.validation(val_schedule(self.pc))
        out["val"] = ex.read_metrics("val")
        if self.pc.ema:
            with ex.ema_weights():
                if self.pc.bn_folded:
                    ex.before_validation()
                rt.validation(val_schedule(self.pc))
            if self.pc.bn_folded:
                ex.before_validation()
            ex.acc["val_ema"].copy_(ex.acc["val"])
            ex.acc["val"].zero_()
            out["val_ema"] = ex.read_metrics("val_ema")
        return out

    # ------------------------------------------------------------------ checkpoints
    def steps_before(self, epoch: int) -> int:
        return sum(len(epoch_schedule(self.pc, e)) for e in range(epoch))

    def _resume_point(self) -> tuple[int, int, list]:
        """(epoch, step, history) to start from; restores the arena when resuming."""
        from tr_hydra.runtime.distributed import broadcast
        pc, rt = self.pc, self.rt
        from tr_hydra.config.plan_config import resume_choice
        if resume_choice(pc.resume) is None:  # a PlanConfig built in Python may spell it "none"
            return 0, 0, []
        if pc.resume == "auto":
            # rank 0 picks the checkpoint; every rank loads that same file (or stops with it,
            # when every checkpoint there is corrupt)
            found, why = None, None
            if self.is_main:
                try:
                    found = ck.newest_valid(self.run_dir, log=self.log)
                except ck.CheckpointError as e:
                    why = str(e)
            path, why = broadcast(rt.dist, (str(found) if found else None, why))
            if why is not None:
                raise ck.CheckpointError(why)
            if path is None:
                self.log(f"resume=auto: no checkpoint in {self.run_dir / 'checkpoints'}; starting fresh")
                return 0, 0, []
            path = Path(path)
        else:
            path = Path(pc.resume)
        state = ck.load(path)
        ck.check_compatible(state, rt.arena, pc.fingerprint(), pc.describe(), path)
        ck.restore(state, rt.arena)
        data = (state.get("extra") or {}).get("data")
        if data and len(data) == rt.dist.world_size and hasattr(rt.source, "restore"):
            rt.source.restore(data[rt.dist.rank])  # the input's augmentation state, per rank
        step = int(state["position"]["step"])
        epoch = 0
        while epoch < pc.trainer.epochs and self.steps_before(epoch + 1) <= step:
            epoch += 1
        self._epoch_before, self._run_before = tally.from_extra(state["extra"])
        if self._epoch_before is not None and self._epoch_before.epoch == epoch - 1:
            epoch -= 1  # stopped after the epoch's last step, before its record: that record is next
        if self._epoch_before is not None and (self._epoch_before.epoch, self._epoch_before.step) != (epoch, step):
            self._epoch_before = None  # (not the epoch this resume goes on with)
        self.log(f"resumed from {path} at epoch {epoch + 1}, step {step}")
        return epoch, step, list(state["history"])

    def save_checkpoint(self, epoch: int, step: int, history: list) -> Path | None:
        from tr_hydra.runtime.distributed import all_gather, broadcast
        rt = self.rt
        rt.ex.sync_bn_stats()  # every rank: the collective needs them all
        # every rank's input state (where its train stream stands, its augmentation generators)
        data = all_gather(rt.dist, self._input_state())
        d = self.run_dir / "checkpoints"
        path, why = None, None
        if self.is_main:
            try:
                _mkdir(d, "checkpoint")
                path = ck.save(d / f"ckpt_e{epoch:04d}_s{step:08d}.pt", rt.arena,
                               position=ck.Position(epoch, step), fingerprint=self.pc.fingerprint(),
                               config=_jsonable(self.pc.to_dict()), describe=self.pc.describe(),
                               history=_jsonable(history),
                               extra=self._tallies(step) | ({"data": data} if any(data) else {}))
                ck.prune(self.run_dir, self.pc.trainer.keep_checkpoints)
            except DiskError as e:
                why = str(e)
        why = broadcast(rt.dist, why)  # (every rank waits here for rank 0's write)
        if why is not None:
            raise DiskError(why)
        return path

    def _tallies(self, step: int) -> dict:
        """A checkpoint's tallies at ``step``: the epoch it stops inside (in progress, or cut
        short by max_steps), and the whole run's images and seconds."""
        images, secs, epoch = self._images, self._train_time, self._cut_short
        if self._running is not None:  # a stop inside the epoch in progress
            so_far, sched, step0, t0 = self._running
            n, dt = sum(s[2] for s in sched[:step - step0]), time.perf_counter() - t0
            images, secs, epoch = images + n, secs + dt, so_far.plus(n, dt, step)
        wall = time.perf_counter() - self._t_run if self._t_run is not None else 0.0
        # (after a resume from a checkpoint without them, the run's earlier part is not known)
        run = self._run_before.plus(images, secs, wall) if self._run_before is not None else None
        return tally.to_extra(epoch, run)

    def _input_state(self):
        """The source's state for a checkpoint; a source that cannot give it (a pipeline broken by
        the error that stops the run) must not cost the checkpoint itself."""
        if not hasattr(self.rt.source, "state"):
            return None
        try:
            return self.rt.source.state()
        except Exception as e:  # noqa: BLE001 - the checkpoint matters more
            self.log(f"checkpoint: the input state is not saved ({str(e).splitlines()[0] if str(e) else type(e).__name__}); "
                     f"a run resumed from it draws fresh crops")
            return None

    def write_metrics(self, history: list, summary: dict | None = None) -> None:
        if not self.is_main:
            return
        _mkdir(self.run_dir, "metrics")
        text = json.dumps({"history": _jsonable(history), "summary": _jsonable(summary or {}),
                           "describe": self.pc.describe()}, indent=1)
        ck.write_atomic(self.run_dir / "metrics.json", text.encode(), what="metrics")

    def final_state_dict(self) -> dict[str, torch.Tensor]:
        return self.rt.arena.state_dict_from_arena(self.rt.model, int(self.rt.ex.scalar("step_count")))

    def save_final(self) -> Path:
        from tr_hydra.runtime.distributed import weights_agree
        rt = self.rt
        if not weights_agree(rt.dist, rt.arena.span(*health.W_SPAN)):
            raise RuntimeError("data parallel: the ranks ended with different weights")
        if self.pc.world_size > 1:
            self.log(f"weights identical on all {self.pc.world_size} ranks")
        rt.ex.sync_bn_stats()
        path = self.run_dir / "model_final.pt"
        if self.is_main:
            _mkdir(self.run_dir, "weights")
            ck.atomic_save(self.final_state_dict(), path, what="weights")
        return path

    # ------------------------------------------------------------------ the loop
    def _start_together(self) -> list[float]:
        """Under ddp, every rank waits here until all have compiled and captured: the first
        all-reduce would wait anyway, but inside the clock of the first steps. Returns each
        rank's wait (the largest is the ranks' start-up skew)."""
        dist = self.rt.dist
        if dist.world_size <= 1:
            return []
        from tr_hydra.runtime.distributed import all_gather, barrier
        t = time.perf_counter()
        barrier(dist)
        waits = all_gather(dist, time.perf_counter() - t)
        self.log("all {} ranks ready; waited for the others: {}".format(
            len(waits), ", ".join(f"rank {r} {w:.1f}s" for r, w in enumerate(waits))))
        return waits

    def fit(self) -> TrainResult:
        from tr_hydra.telemetry.tensorboard import Telemetry
        rt = self.rt
        res = TrainResult(arena_bytes=rt.compiled.plan.total_bytes)
        start_epoch, step, history = self._resume_point()
        start_step = step
        self.get_ready()  # after the restore: warm-up snapshots and restores the resumed state
        res.capture_seconds = self.startup.capture_seconds
        res.start_wait_seconds = self._start_together()
        tel = Telemetry(self.run_dir, rt.compiled, rt.arena, enabled=self.telemetry,
                        grads_16bit=rt.ex.grads_read_16bit, grad16_sumsq=rt.ex.grad16_sumsq, log=self.log)
        try:
            return self._fit(res, start_epoch, step, start_step, history, tel)
        finally:
            tel.close()  # (a no-op once closed; an error's path closes it here)

    def _fit(self, res: TrainResult, start_epoch: int, step: int, start_step: int, history: list,
             tel) -> TrainResult:
        from tr_hydra.runtime.guards import PreemptionGuard
        rt = self.rt
        tel.start(step)
        t_run = self._t_run = time.perf_counter()
        self._images, self._train_time, self._recorded = 0, 0.0, 0  # (this process's, in this fit)
        rt.model.train()
        with PreemptionGuard() as guard:
            try:
                step, images, train_time = self._epochs(start_epoch, step, history, tel, guard)
            except _Stop as stop:
                step = stop.step
                rt.sync()
                try:
                    path = self.save_checkpoint(stop.epoch, step, history)
                    self.write_metrics(history)
                except DiskError as e:
                    if stop.error is None:
                        raise
                    # the error that stopped the run comes first; the last checkpoint written stays
                    raise type(stop.error)(f"{stop.error}; no checkpoint at the stop ({e})") from None
                tel.close()
                if stop.error is not None:
                    self.log(f"checkpoint before stopping: {path}")
                    raise stop.error from None  # (not chained to the _Stop that carried it)
                self.log(f"stopped by {guard.stop.signal_name} at step {step}; checkpoint {path}; "
                         f"continue with resume=auto (same run dir)")
                res.epochs, res.steps, res.preempted = history, step, True
                return res
        res.epochs, res.steps = history, step
        before = self._run_before or tally.RunTally()  # (the run's earlier processes)
        images, train_time = images + before.images, train_time + before.train_seconds
        res.img_per_sec = images / train_time if train_time else 0.0
        if rt.device.type == "cuda":
            res.peak_device_bytes = torch.cuda.max_memory_allocated(rt.device)
        res.final_path = str(self.save_final())
        if step == start_step and step > 0 and not self._recorded:  # a resumed run that was already complete
            kept = sm.kept(self.run_dir, history, step, rt.compiled.plan.total_bytes, self.pc.trainer.objective)
            res.img_per_sec = kept.get("img_per_sec", 0.0)
            res.peak_device_bytes, res.summary = kept.get("peak_device_bytes", 0), kept
            self.write_metrics(history, kept)
            tel.close()
            self.log(f"nothing to train: the run was complete at step {step}; its summary is kept "
                     f"(best val top1 {sm.top1(kept['best_val_top1'])}, {res.img_per_sec:,.1f} img/s)")
            return res
        made = sm.made(history, objective_name=self.pc.trainer.objective, images=images, train_seconds=train_time,
                       seconds=time.perf_counter() - t_run + before.seconds, arena_bytes=res.arena_bytes,
                       peak_device_bytes=res.peak_device_bytes, steps=step, resumed_at_step=start_step,
                       since_resume=self._run_before is None)
        if res.start_wait_seconds:
            made["start_wait_seconds"] = res.start_wait_seconds
        res.summary = made
        self.write_metrics(history, made)
        tel.close(_jsonable(self.pc.to_dict()), made)
        self.log(sm.line(made))
        return res

    def _epochs(self, start_epoch, step, history, tel, guard):
        pc, rt, ex = self.pc, self.rt, self.rt.ex
        for epoch in range(start_epoch, pc.trainer.epochs):
            sched = epoch_schedule(pc, epoch)[step - self.steps_before(epoch):]  # skip what is done
            if pc.trainer.max_steps:
                sched = sched[:max(pc.trainer.max_steps - step, 0)]
            done = self._epoch_before is not None and step == self.steps_before(epoch + 1)
            if not sched and not done:  # (done: resumed after the epoch's last step, before its record)
                break
            rt.sync()
            t0 = time.perf_counter()
            so_far = self._epoch_so_far(epoch, step, history)
            self._running, self._cut_short = (so_far, sched, step, t0), None
            bar = _progress(len(sched), f"epoch {epoch + 1}/{pc.trainer.epochs}",
                            pc.trainer.progress and self._tty)
            mark = {"t": t0, "k": -1, "wait": 0.0}

            def on_step(k, _n=len(sched), _step0=step, _epoch=epoch):
                if bar:
                    bar.update(1)
                if self._should_stop(guard, k + 1 == _n or (k + 1) % pc.trainer.log_every == 0):
                    raise _Stop(_step0 + k + 1, _epoch)
                # the host reads the device accumulator once per log interval, never per step
                if (k + 1) % pc.trainer.log_every == 0 or k + 1 == _n:
                    m = ex.read_metrics("train")
                    now = time.perf_counter()
                    n_steps = k - mark["k"]
                    n_img = sum(s[2] for s in sched[mark["k"] + 1:k + 1])
                    so_far.add(m)
                    rate = n_img / max(now - mark["t"], 1e-9)
                    tel.train(_step0 + k + 1, m, lr=ex.scalar("lr"), img_per_sec=rate,
                              step_time_ms=1000 * (now - mark["t"]) / n_steps,
                              data_wait_ms=1000 * (rt.data_wait - mark["wait"]) / n_steps,
                              loss_scale=ex.scalar("loss_scale") if ex.fp16 else None,
                              skipped=ex.scalar("skipped"))
                    if bar:
                        bar.set_postfix(loss=f"{m['loss']:.4f}", img_s=f"{rate:,.0f}")
                    mark.update(t=now, k=k, wait=rt.data_wait)
                    try:
                        health.check(pc, rt, _step0 + k + 1)
                    except Exception as e:
                        raise _Stop(_step0 + k + 1, _epoch, error=e) from None
            self.run_steps(sched, "train", step0=step, on_step=on_step, epoch=epoch)
            if not sched:
                so_far.add(ex.read_metrics("train"))  # (the samples of its steps since the last read)
            if bar:
                bar.close()
            rt.sync()
            dt = time.perf_counter() - t0
            n_img = sum(s[2] for s in sched)
            step, self._images, self._train_time = step + len(sched), self._images + n_img, self._train_time + dt
            so_far = so_far.plus(n_img, dt, step)
            rec = {"epoch": epoch + 1, "step": step, "train": so_far.train(),
                   "img_per_sec": so_far.images / so_far.seconds, "lr": ex.scalar("lr")}
            if so_far.from_step:
                rec["train_from_step"] = so_far.from_step
            complete = step == self.steps_before(epoch + 1)
            self._running, self._cut_short = None, None if complete else so_far
            if complete and pc.trainer.sema_every and pc.ema and (epoch + 1) % pc.trainer.sema_every == 0:
                ex.sema_switch()
            if complete and ((epoch + 1) % pc.trainer.val_every == 0 or epoch + 1 == pc.trainer.epochs):
                rec.update(self.validate())
                for name in ("val", "val_ema"):
                    if name in rec:
                        tel.val(step, name, rec[name])
            rec["nonfinite"] = ex.scalar("nonfinite")
            rec["skipped"] = ex.scalar("skipped")
            history.append(rec)
            self._recorded += 1
            self.log(format_epoch(rec))
            last = epoch + 1 == pc.trainer.epochs or (pc.trainer.max_steps and step >= pc.trainer.max_steps)
            if pc.trainer.checkpoint_every and ((epoch + 1) % pc.trainer.checkpoint_every == 0 or last):
                self.save_checkpoint(epoch + 1 if complete else epoch, step, history)
            self.write_metrics(history)
        return step, self._images, self._train_time

    def _epoch_so_far(self, epoch: int, step: int, history: list) -> tally.EpochTally:
        """The tally ``epoch`` starts from at ``step``: none at its start; resumed inside it, the
        checkpoint's, whose epoch record (written where max_steps cut the epoch short) this
        epoch's record replaces; without one (an older checkpoint), a fresh tally marked with
        the step its train metrics start from."""
        if step == self.steps_before(epoch):
            return tally.EpochTally(epoch)
        before, self._epoch_before = self._epoch_before, None
        if before is None:
            self.log(f"resume: the checkpoint has no tally of epoch {epoch + 1} before step {step}; "
                     f"that epoch's train metrics cover steps {step + 1} on")
            return tally.EpochTally(epoch, from_step=step)
        if history and (history[-1]["epoch"], history[-1]["step"]) == (epoch + 1, step):
            history.pop()
        return before

    def _should_stop(self, guard, at_log: bool) -> bool:
        """A preemption signal stops at a step boundary; with several ranks, all ranks agree
        (at log intervals) so none is left waiting in a collective."""
        if self.rt.dist.world_size <= 1:
            return guard.stop.requested
        if not at_log:
            return False
        flag = torch.tensor([1.0 if guard.stop.requested else 0.0], device=self.rt.device)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        return bool(flag.item())


def _progress(total: int, desc: str, enabled: bool):
    if not enabled:
        return None
    from tqdm import tqdm
    return tqdm(total=total, desc=desc, unit="step", leave=False, dynamic_ncols=True)


def format_epoch(rec: dict) -> str:
    t = rec["train"]
    s = (f"epoch {rec['epoch']:>3}  step {rec['step']:>6}  train loss {t['loss']:.4f} "
         f"top1 {t['top1']:6.2f} top5 {t['top5']:6.2f}  {rec['img_per_sec']:9.1f} img/s  lr {rec['lr']:.4g}")
    for k in ("val", "val_ema"):
        if k in rec:
            v = rec[k]
            s += f"  | {k} loss {v['loss']:.4f} top1 {v['top1']:6.2f} top5 {v['top5']:6.2f}"
    if rec.get("skipped"):
        s += f"  skipped {int(rec['skipped'])}"
    return s

