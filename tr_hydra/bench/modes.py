"""tr-bench's step modes: each way of running the training step (PyTorch's eager or compiled
step, tr_hydra's runtime with the eager model, Inductor, or Inductor recomputing pointwise
results) built, warmed up and timed. tr_hydra's modes build a ``Runtime`` and get it ready with
``tr_hydra.startup``, as training does."""
from __future__ import annotations

import dataclasses
import statistics
import sys
import time
from collections.abc import Sequence

import torch

from tr_hydra import startup
from tr_hydra.bench.baselines import pytorch_runner
from tr_hydra.bench.timing import sync
from tr_hydra.config.epochs import epoch_schedule
from tr_hydra.errors import ConfigError
from tr_hydra.runtime.build import Runtime
from tr_hydra.runtime.schedule import lr_at

# reduce-overhead-tuned: with Inductor's coordinate descent too (tr_hydra's runtime.tuning=full)
PYTORCH_MODES = ("eager", "compile", "reduce-overhead", "reduce-overhead-tuned")
TR_MODES = ("tr", "tr-inductor", "tr-recompute")
# end to end (bench.data): on the folder, on shards tr-prepare wrote from it (<bench.data>/shards), and
# tr-synthetic: the same epochs on synthetic data already in host memory (the step's own ceiling)
E2E_MODES = ("tr", "tr-shards", "tr-synthetic", "dali-compile", "dali-shards-compile", "dl-compile")


def as_list(spec, key: str = "bench.modes") -> list[str]:
    """A mode list given as [a,b] (a list) or "a,b" (a string)."""
    if not isinstance(spec, (str, Sequence)):
        raise ConfigError(f"{key}: expects a list such as [tr,reduce-overhead] or auto, got {spec!r}")
    items = spec.split(",") if isinstance(spec, str) else [str(m) for m in spec]
    return [m.strip() for m in items if m.strip()]


def pick_modes(spec, device, e2e: bool = False) -> list[str]:
    """``bench.modes`` resolved (``auto``: by device; with ``bench.data``, the end-to-end modes)."""
    known = E2E_MODES if e2e else PYTORCH_MODES + TR_MODES
    if spec == "auto":
        if e2e:
            return list(E2E_MODES) if device.type == "cuda" else ["tr", "tr-shards", "tr-synthetic", "dl-compile"]
        return ["eager", "compile", "reduce-overhead", "tr", "tr-inductor"] if device.type == "cuda" else ["eager", "tr"]
    modes = as_list(spec)
    bad = [m for m in modes if m not in known]
    if bad:
        what = " with bench.data" if e2e else ""
        raise ConfigError(f"bench.modes: unknown {bad}{what}; choose from {', '.join(known)}")
    return modes


def tr_runtime(mode: str, runtime):
    """tr_hydra's runtime settings for a bench mode: ``tr`` the eager model, ``tr-inductor``
    Inductor, ``tr-recompute`` Inductor with ``runtime.recompute=pointwise`` (less activation
    memory for a slower step); the rest of ``runtime`` as given."""
    if mode == "tr-recompute":
        return dataclasses.replace(runtime, compile="inductor", recompute="pointwise")
    return dataclasses.replace(runtime, compile="inductor" if mode == "tr-inductor" else "none")


def runtime_log(keep=None):
    """tr_hydra's log inside tr-bench: the start-up's progress lines (``  still ...``, every 30 s
    of a long compile) go to stderr beside tr-bench's own progress; every line also goes to
    ``keep`` if given, and is otherwise dropped (the tables say what matters)."""
    def say(*parts) -> None:
        msg = " ".join(str(p) for p in parts)
        if msg.startswith("  still "):
            print(f"tr-bench: {msg.strip()}", file=sys.stderr, flush=True)
        if keep is not None:
            keep(msg)
    return say


def ready_runtime(pc, log) -> tuple[Runtime, startup.StartupReport, float, float]:
    """A ``Runtime`` for ``pc`` with every variant compiled and captured, as training gets it:
    the parallel compiles' launcher started first, so its imports overlap the build. Returns
    the runtime, the start-up's report, and the seconds building the runtime and getting it
    ready took."""
    t0 = time.perf_counter()
    rt, launcher = startup.build(pc, log)
    built = time.perf_counter() - t0
    t1 = time.perf_counter()
    try:
        report = startup.get_ready(rt, launcher, log)
    except BaseException:
        rt.close()
        raise
    return rt, report, built, time.perf_counter() - t1


def lr_of(pc):
    """``lr(k)``: the k-th training step's learning rate, set before each step as training sets
    it (a scalar written on the device, a cost the bench's steps pay as training's do)."""
    per_epoch = len(epoch_schedule(pc, pc.lowres_epochs))
    total = sum(len(epoch_schedule(pc, e)) for e in range(pc.trainer.epochs))
    return lambda k: lr_at(pc.optimizer, k, per_epoch, total)


def tr_runner(model_name: str, batch: int, res: int, classes: int, compile_mode: str, device, amp: bool,
              n_train: int | None = None, deterministic: bool = False):
    """tr_hydra's step on a synthetic plan (momentum SGD, one resolution), ready: returns
    ``(step8, rt)``, ``step8()`` running 8 training steps of ``train_base`` as one schedule, and
    the ``Runtime``."""
    from tr_hydra.config.epochs import make_variants
    from tr_hydra.config.plan_config import PlanConfig
    from tr_hydra.config.specs import DataSpec, ModelSpec, OptimizerSpec, RuntimeSpec, TrainerSpec
    n_train = n_train or batch * 64
    pc = PlanConfig(model=ModelSpec(name=model_name, num_classes=classes),
                    optimizer=OptimizerSpec(name="momentum", lr=0.1, weight_decay=5e-5, schedule="constant"),
                    data=DataSpec(num_classes=classes),
                    trainer=TrainerSpec(epochs=1),
                    runtime=RuntimeSpec(device=device.type, compile=compile_mode,
                                        deterministic=deterministic),
                    variants=make_variants(train_size=n_train, val_size=batch, batch_size=batch,
                                           val_batch_size=batch, base_res=res, lowres_res=res,
                                           lowres_epochs=0, val_res=res, drop_last=False),
                    batch_size=batch, val_batch_size=batch, train_size=n_train, val_size=batch,
                    amp=amp)
    rt, _, _, _ = ready_runtime(pc, lambda *_: None)
    sched = [("train_base", i, batch) for i in range(8)]
    lr = lr_of(pc)

    def step8():
        rt.run_steps(sched, "train", lr=lr)
    return step8, rt


class Mode:
    """One way of running the training step, built and warmed up, ready to be timed."""

    def __init__(self, name: str, pc, device, warmup: int, single_buffer: bool = False):
        self.name, self.pc, self.device = name, pc, device
        self.single_buffer = single_buffer
        t0 = time.perf_counter()
        cuda = device.type == "cuda"
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device) if cuda else 0
        v = pc.variant("train_base")
        self.batch = v.batch
        self.rt = self.startup = None
        if name in PYTORCH_MODES:
            tuned = name.endswith("-tuned")
            options = dict(pc.runtime.inductor_options) | ({"coordinate_descent_tuning": True} if tuned else {})
            self.step = pytorch_runner(pc.model.name, v.batch, v.res, pc.model.num_classes,
                                       name.removesuffix("-tuned"), device, pc.amp, options=options)
        else:
            tpc = dataclasses.replace(pc, runtime=tr_runtime(name, pc.runtime))
            self.rt, self.startup, _, _ = ready_runtime(tpc, runtime_log())
            self.lr = lr_of(tpc)
            self.step = None
        self.run(max(warmup, 1))
        sync(device)
        self.first_seconds = time.perf_counter() - t0
        self.peak_bytes = (torch.cuda.max_memory_allocated(device) - base) if cuda else 0
        self.memory = self._memory(base)
        self.times: list[float] = []
        self.other_times: list[float] = []

    def _memory(self, base: int) -> dict:
        """Where the peak comes from: what stays allocated between steps, and for tr_hydra the
        arena, the plan's prediction and the peak the warm-up had reached before the capture."""
        cuda = self.device.type == "cuda"
        out = {"allocated_between_steps_bytes": torch.cuda.memory_allocated(self.device) - base} if cuda else {}
        if self.rt is not None:
            c = self.rt.compiled
            out.update(arena_bytes=c.plan.total_bytes, activation_estimate_bytes=c.activation_estimate,
                       gradient_transient_bytes=c.gradient_transient, library_workspace_bytes=c.library_workspace,
                       predicted_need_bytes=c.predicted_need)
            if cuda and self.rt.graphs is not None:
                out["peak_after_warmup_bytes"] = self.startup.peak_after_warmup - base
        return out

    def run(self, steps: int) -> None:
        """``steps`` training steps. tr_hydra runs them as one schedule, as in training: the
        feeder fills one input buffer while the step on the other runs."""
        if self.rt is None:
            for _ in range(steps):
                self.step()
        elif self.single_buffer:  # diagnostic: every step on buffer A, copy and step serialised
            for i in range(steps):
                self.rt.run_steps([("train_base", i, self.batch)], "train", lr=self.lr)
        else:
            self.rt.run_steps([("train_base", i, self.batch) for i in range(steps)], "train", lr=self.lr)

    def time(self, steps: int) -> None:
        self.times.append(self._rate(steps))
        if self.rt is not None:  # tr_hydra, also timed the other way (a diagnostic)
            self.single_buffer = not self.single_buffer
            self.other_times.append(self._rate(steps))
            self.single_buffer = not self.single_buffer

    def _rate(self, steps: int) -> float:
        sync(self.device)
        t0 = time.perf_counter()
        self.run(steps)
        sync(self.device)
        return steps * self.batch / (time.perf_counter() - t0)

    def close(self) -> None:
        """Release tr_hydra's graphs and data source (nothing for a PyTorch mode)."""
        if self.rt is not None:
            self.rt.close()

    def record(self) -> dict:
        r = self.times
        out = {"mode": self.name, "img_per_sec_median": statistics.median(r), "img_per_sec_all": r,
               "spread": (max(r) - min(r)) / statistics.median(r) if r else 0.0,
               "peak_bytes": self.peak_bytes, "first_step_seconds": self.first_seconds,
               "memory": self.memory}
        if self.startup is not None:  # tr_hydra's start-up (cuDNN's search, compiles, capture)
            out["startup"] = self.startup.to_json()
        if self.rt is not None:  # runtime.tuning as chosen for the plan, and why
            out["tuning"] = self.rt.compiled.tuning.to_json()
        if self.other_times:
            key = "img_per_sec_ab_schedule" if self.single_buffer else "img_per_sec_single_buffer"
            out[key + "_median"] = statistics.median(self.other_times)
            out[key + "_all"] = self.other_times
        return out
