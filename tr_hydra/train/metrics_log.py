"""What a run reports while it trains: the train metrics and rates of each log interval (img/s,
step time, data wait) to TensorBoard (``Telemetry``) and the progress bar, each epoch's record
(its line in the log, ``format_epoch``), metrics.json, and the run's summary (``summary``'s)
into all three. Only rank 0 writes; every rank reads the metrics (a collective)."""
from __future__ import annotations

import json
import time
from pathlib import Path

from tr_hydra.config.plan_config import PlanConfig
from tr_hydra.files import jsonable, make_dir, write_atomic
from tr_hydra.train.tally import EpochTally


class MetricsLog:
    """The reports of ``pc``'s run in ``run_dir`` over the runtime ``rt``; ``progress``: a
    progress bar per epoch; ``telemetry``: TensorBoard's files (``tb/``)."""

    def __init__(self, pc: PlanConfig, rt, run_dir: Path, *, progress: bool, telemetry: bool):
        self.pc, self.rt, self.run_dir = pc, rt, Path(run_dir)
        self.progress, self.telemetry = progress, telemetry
        self.records = 0  # epoch records made in this fit
        self._tel = None
        self._bar = None
        self._sched: list = []
        self._mark: dict = {}  # where the last log interval ended: its time, step index, data wait

    def open(self, step: int) -> None:
        """A fit starts at ``step``: TensorBoard's writer, and the plan's figures at ``step``."""
        from tr_hydra.telemetry.tensorboard import Telemetry
        rt = self.rt
        self.records = 0
        self._tel = Telemetry(self.run_dir, rt.compiled, rt.arena, enabled=self.telemetry,
                              grads_16bit=rt.ex.grads_read_16bit, grad16_sumsq=rt.ex.grad16_sumsq, log=rt.log)
        self._tel.start(step)

    def close(self, hparams: dict | None = None) -> None:
        """TensorBoard flushed and closed (``hparams``: the summary, written with the config as
        its hparams); a no-op once closed."""
        if self._tel is not None:
            self._tel.close(jsonable(self.pc.to_dict()) if hparams else None, hparams)

    # ------------------------------------------------------------------ an epoch's steps
    def begin_epoch(self, epoch: int, sched: list, t0: float) -> None:
        """``epoch`` runs ``sched`` from ``t0``."""
        self._sched, self._mark = sched, {"t": t0, "k": -1, "wait": 0.0}
        self._bar = _progress(len(sched), f"epoch {epoch + 1}/{self.pc.trainer.epochs}", self.progress)

    def stepped(self) -> None:
        if self._bar:
            self._bar.update(1)

    def read_train(self, step: int, k: int) -> dict:
        """The train metrics since the last read (one host read of the device accumulator), at
        the run's ``step``, the epoch's ``k``-th: to TensorBoard with the interval's rates and to
        the progress bar; returned for the epoch's tally."""
        rt, ex, mark = self.rt, self.rt.ex, self._mark
        m = ex.read_metrics("train")
        now = time.perf_counter()
        n_steps = k - mark["k"]
        n_img = sum(s[2] for s in self._sched[mark["k"] + 1:k + 1])
        rate = n_img / max(now - mark["t"], 1e-9)
        self._tel.train(step, m, lr=ex.scalar("lr"), img_per_sec=rate,
                        step_time_ms=1000 * (now - mark["t"]) / n_steps,
                        data_wait_ms=1000 * (rt.data_wait - mark["wait"]) / n_steps,
                        loss_scale=ex.scalar("loss_scale") if ex.fp16 else None,
                        skipped=ex.scalar("skipped"))
        if self._bar:
            self._bar.set_postfix(loss=f"{m['loss']:.4f}", img_s=f"{rate:,.0f}")
        mark.update(t=now, k=k, wait=rt.data_wait)
        return m

    def end_epoch(self) -> None:
        if self._bar:
            self._bar.close()
        self._bar = None

    # ------------------------------------------------------------------ records and files
    def record(self, epoch: int, so_far: EpochTally, val: dict, history: list) -> dict:
        """``epoch``'s record from its tally and its validation (``val``: none where it ran
        none), appended to ``history``, to TensorBoard and to the log."""
        ex, step = self.rt.ex, so_far.step
        rec = {"epoch": epoch + 1, "step": step, "train": so_far.train(),
               "img_per_sec": so_far.images / so_far.seconds, "lr": ex.scalar("lr")}
        if so_far.from_step:
            rec["train_from_step"] = so_far.from_step
        rec.update(val)
        for name in ("val", "val_ema"):
            if name in rec:
                self._tel.val(step, name, rec[name])
        rec["nonfinite"] = ex.scalar("nonfinite")
        rec["skipped"] = ex.scalar("skipped")
        history.append(rec)
        self.records += 1
        self.rt.log(format_epoch(rec))
        return rec

    def write(self, history: list, summary: dict | None = None) -> None:
        """metrics.json: the epochs' records, the summary (once the run has one), the plan."""
        if not self.rt.is_main:
            return
        make_dir(self.run_dir, "metrics")
        text = json.dumps({"history": jsonable(history), "summary": jsonable(summary or {}),
                           "describe": self.pc.describe()}, indent=1)
        write_atomic(self.run_dir / "metrics.json", text.encode(), what="metrics")

    def finish(self, history: list, summary: dict, line: str, hparams: bool = True) -> None:
        """The run's summary into metrics.json and (``hparams``) TensorBoard's hparams, then
        ``line`` as the log's last."""
        self.write(history, summary)
        self.close(summary if hparams else None)
        self.rt.log(line)


def _progress(total: int, desc: str, enabled: bool):
    if not enabled:
        return None
    from tqdm import tqdm
    return tqdm(total=total, desc=desc, unit="step", leave=False, dynamic_ncols=True)


def format_epoch(rec: dict) -> str:
    """An epoch's line in the log."""
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
