"""tr-bench: PyTorch's best practice and tr_hydra side by side, one process, same model, batch
and precision (tr-train overrides). Every mode is built first (time to first step, peak
memory), then timed interleaved: each repeat runs every mode once, so drift affects all alike.

    tr-bench model=resnet50 amp=true variants.batch_size=256 variants.base_res=224
"""
from __future__ import annotations

import dataclasses
import json
import os
import statistics
import sys
import time

from tr_hydra.cli._common import compose, user_errors

PYTORCH_MODES = ("eager", "compile", "reduce-overhead")
TR_MODES = ("tr", "tr-inductor", "tr-recompute", "tr-streams", "tr-streams-next")
E2E_MODES = ("tr", "dali-compile", "dl-compile")


def _sync(device):
    import torch
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _modes(spec, device, e2e: bool = False) -> list[str]:
    known = E2E_MODES if e2e else PYTORCH_MODES + TR_MODES
    if spec == "auto":
        if e2e:
            return list(E2E_MODES) if device.type == "cuda" else ["tr", "dl-compile"]
        return ["eager", "compile", "reduce-overhead", "tr", "tr-inductor"] if device.type == "cuda" else ["eager", "tr"]
    modes = _as_list(spec)
    bad = [m for m in modes if m not in known]
    if bad:
        from tr_hydra.errors import ConfigError
        what = " with bench.data" if e2e else ""
        raise ConfigError(f"bench.modes: unknown {bad}{what}; choose from {', '.join(known)}")
    return modes


def _as_list(spec) -> list[str]:
    """A mode list given as [a,b] (a list) or "a,b" (a string)."""
    items = spec.split(",") if isinstance(spec, str) else [str(m) for m in spec]
    return [m.strip() for m in items if m.strip()]


def end_to_end(pc, b, device) -> dict:
    """tr_hydra, DALI + torch.compile and DataLoader + torch.compile on the JPEG folder
    ``bench.data``, same model, batch, resolution and precision; img/s over the rest of a first
    epoch after a warm-up and a second whole epoch."""
    import torch
    from tr_hydra.bench import (e2e_dali_compile, e2e_dataloader_compile, e2e_tr, folder_config,
                                make_jpegs)
    modes = _modes(b.modes, device, e2e=True)
    if b.generate:
        make_jpegs(b.data, b.generate)
    fpc = folder_config(pc, b.data, pc.runtime.compile)
    v = fpc.variant("train_base")
    records = []
    for m in modes:
        if m == "tr":
            r = e2e_tr(fpc, "/tmp/tr_bench_e2e", warm_steps=b.warmup, profile_steps=b.steps if b.profile else 0)
        elif m == "dali-compile":
            r = e2e_dali_compile(b.data, fpc.model.name, v.batch, v.res, device, fpc.amp, warm_steps=b.warmup,
                                 hw_decoder_load=fpc.data.hw_decoder_load,
                                 options=dict(fpc.runtime.inductor_options))
        else:
            r = e2e_dataloader_compile(b.data, fpc.model.name, v.batch, v.res, device, fpc.amp, warm_steps=b.warmup,
                                       options=dict(fpc.runtime.inductor_options))
        r["mode"] = m
        records.append(r)
        _sync(device)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return {"config": fpc.describe(), "runtime": dataclasses.asdict(fpc.runtime), "device": str(device),
            "data": b.data, "train_images": fpc.train_size,
            "batch": v.batch, "res": v.res, "modes": records}


def e2e_table(records: list[dict]) -> str:
    tr = next((r for r in records if r["mode"] == "tr"), None)
    lines = [f"{'mode':<14} {'img/s':>10} {'tr_hydra x':>11} {'first step s':>13} {'epoch 0 rest / epoch 1':>24}"]
    for r in records:
        ratio = f"{tr['img_per_sec'] / r['img_per_sec']:.2f}" if tr else "-"  # no tr_hydra run: no ratio
        parts = " / ".join(f"{v:,.0f}" for v in r.get("epoch_img_per_sec", []))
        lines.append(f"{r['mode']:<14} {r['img_per_sec']:>10,.1f} {ratio:>11} {r['first_step_seconds']:>13.1f} "
                     f"{parts:>24}")
    if tr and "data_wait_seconds" in tr:
        lines.append(f"tr_hydra waited {tr['data_wait_seconds']:.2f} s of {tr['seconds']:.2f} s for batches "
                     f"({tr.get('copy_wait_seconds', 0.0):.2f} s of it for the device to take the previous one, "
                     f"{tr['epoch_switch_wait_seconds']:.2f} s at the start of epoch 1; "
                     f"epoch 1's first batch decoding before the switch: {'yes' if tr['epochs_read_ahead'] else 'no'})")
    return "\n".join(lines)


def tr_runtime(mode: str, runtime):
    """tr_hydra's runtime settings for a bench mode: ``tr`` the eager model, ``tr-inductor``
    Inductor, ``tr-recompute`` Inductor with ``runtime.recompute=pointwise`` (less activation
    memory for a slower step), ``tr-streams`` Inductor with ``runtime.backward_streams=2``,
    ``tr-streams-next`` that with ``runtime.backward_join=next``; the rest of ``runtime`` as given."""
    if mode == "tr-recompute":
        return dataclasses.replace(runtime, compile="inductor", recompute="pointwise")
    if mode in ("tr-streams", "tr-streams-next"):
        return dataclasses.replace(runtime, compile="inductor", backward_streams=2,
                                   backward_join="next" if mode == "tr-streams-next" else "conv")
    return dataclasses.replace(runtime, compile="inductor" if mode == "tr-inductor" else "none")


def trainer_log(keep=None):
    """A tr_hydra trainer's log inside tr-bench: the warm-up's progress lines (``  still ...``,
    every 30 s of a long compile) go to stderr beside tr-bench's own progress; every line also
    goes to ``keep`` if given, and is otherwise dropped (the tables say what matters)."""
    def say(*parts) -> None:
        msg = " ".join(str(p) for p in parts)
        if msg.startswith("  still "):
            print(f"tr-bench: {msg.strip()}", file=sys.stderr, flush=True)
        if keep is not None:
            keep(msg)
    return say


class Mode:
    """One way of running the training step, built and warmed up, ready to be timed."""

    def __init__(self, name: str, pc, device, warmup: int, single_buffer: bool = False):
        import torch
        from tr_hydra.bench import pytorch_runner
        self.name, self.pc, self.device = name, pc, device
        self.single_buffer = single_buffer
        t0 = time.perf_counter()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
        v = pc.variant("train_base")
        self.batch = v.batch
        if name in PYTORCH_MODES:
            self.trainer = None
            step = pytorch_runner(pc.model.name, v.batch, v.res, pc.model.num_classes, name, device, pc.amp,
                                  options=dict(pc.runtime.inductor_options))
            self.step = step
        else:
            from tr_hydra.runtime.runner import Trainer
            tpc = dataclasses.replace(pc, runtime=tr_runtime(name, pc.runtime))
            self.trainer = Trainer(tpc, "/tmp/tr_bench_run", log=trainer_log(), telemetry=False)
            self.trainer.capture()
            self.step = None
        self.run(max(warmup, 1))
        _sync(device)
        self.first_seconds = time.perf_counter() - t0
        self.peak_bytes = (torch.cuda.max_memory_allocated(device) - base) if device.type == "cuda" else 0
        self.memory = self._memory(base if device.type == "cuda" else 0)
        self.times: list[float] = []
        self.other_times: list[float] = []

    def _memory(self, base: int) -> dict:
        """Where the peak comes from: what stays allocated between steps, and for tr_hydra the
        arena, the plan's prediction and the peak the warm-up had reached before the capture."""
        import torch
        cuda = self.device.type == "cuda"
        out = {"allocated_between_steps_bytes": torch.cuda.memory_allocated(self.device) - base} if cuda else {}
        if self.trainer is not None:
            c = self.trainer.compiled
            out.update(arena_bytes=c.plan.total_bytes, activation_estimate_bytes=c.activation_estimate,
                       gradient_transient_bytes=c.gradient_transient, library_workspace_bytes=c.library_workspace,
                       predicted_need_bytes=c.predicted_need)
            if cuda and self.trainer.graphs is not None:
                out["peak_after_warmup_bytes"] = self.trainer.graphs.peak_after_warmup - base
        return out

    def run(self, steps: int) -> None:
        """``steps`` training steps. tr_hydra runs them as one schedule, as in training: the
        feeder fills one input buffer while the step on the other runs."""
        if self.trainer is None:
            for _ in range(steps):
                self.step()
        elif self.single_buffer:  # diagnostic: every step on buffer A, copy and step serialised
            for i in range(steps):
                self.trainer.run_steps([("train_base", i, self.batch)], "train")
        else:
            self.trainer.run_steps([("train_base", i, self.batch) for i in range(steps)], "train")

    def time(self, steps: int) -> None:
        _sync(self.device)
        t0 = time.perf_counter()
        self.run(steps)
        _sync(self.device)
        self.times.append(steps * self.batch / (time.perf_counter() - t0))
        if self.trainer is not None:  # tr_hydra, also timed the other way (a diagnostic)
            self.single_buffer = not self.single_buffer
            _sync(self.device)
            t0 = time.perf_counter()
            self.run(steps)
            _sync(self.device)
            self.other_times.append(steps * self.batch / (time.perf_counter() - t0))
            self.single_buffer = not self.single_buffer

    def record(self) -> dict:
        r = self.times
        out = {"mode": self.name, "img_per_sec_median": statistics.median(r), "img_per_sec_all": r,
               "spread": (max(r) - min(r)) / statistics.median(r) if r else 0.0,
               "peak_bytes": self.peak_bytes, "first_step_seconds": self.first_seconds,
               "memory": self.memory}
        rep = getattr(self.trainer, "cudnn_prime", None)
        if rep is not None:  # runtime.prime_cudnn: part of first_step_seconds
            out["cudnn_prime"] = _prime_json(rep)
        fl = getattr(self.trainer, "autotune_flush", None)
        if fl is not None:  # runtime.autotune_flush=fit: the warm-up's autotuning benchmarks
            out["autotune_flush"] = {"benchmarks": fl.benchmarks, "cut": fl.cut, "full_bytes": fl.full_bytes,
                                     "smallest_bytes": fl.smallest_bytes, "supported": fl.supported}
        if self.other_times:
            key = "img_per_sec_ab_schedule" if self.single_buffer else "img_per_sec_single_buffer"
            out[key + "_median"] = statistics.median(self.other_times)
            out[key + "_all"] = self.other_times
        return out


KERNEL_GROUPS = (  # first match wins: where a step's device time goes
    # end to end: the input pipeline's own kernels, before the convolutions' keys ("conv" is
    # also in a colour conversion's name)
    ("DALI / nvJPEG (decode, resize, normalise)", ("dali", "nvjpeg", "jpeg", "npp")),
    ("tr_hydra range kernels", ("_update_kernel", "_lars_kernel", "_cast_kernel", "_ema_kernel", "_nonfinite")),
    ("tr_hydra max pooling backward", ("maxpool_gather_backward",)),
    ("NCCL", ("nccl",)),
    # before the convolutions: Inductor names its kernels after the ops they fuse, and
    # "convolution_backward" in a fused elementwise kernel's name does not make it a convolution
    ("Inductor (Triton)", ("triton_",)),
    ("convolution (cuDNN)", ("conv", "cudnn", "xmma", "implicit", "dgrad", "wgrad", "fprop", "sm90", "sm100")),
    ("matmul (cuBLAS)", ("gemm", "cublas", "cutlass")),
    ("BatchNorm (eager)", ("batch_norm", "batchnorm", "bn_")),
    ("multi-tensor (optimizer, grad copy)", ("fused_sgd", "multi_tensor", "foreach")),
    ("memset / memcpy", ("memset", "memcpy", "Memset", "Memcpy")),
    ("elementwise / reduce (eager)", ("elementwise", "reduce", "vectorized", "unrolled", "Reduce")),
)


def _group(name: str) -> str:
    low = name.lower()
    for group, keys in KERNEL_GROUPS:
        if any(k.lower() in low for k in keys):
            return group
    return "other"


def profile_mode(mode: "Mode", steps: int = 5) -> dict:
    """torch.profiler over ``steps`` steps: device time per step by kernel group, the top kernels,
    kernel count per step, and how much of the step the device is busy."""
    from torch.profiler import ProfilerActivity, profile
    mode.run(1)
    _sync(mode.device)
    cuda = mode.device.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        t0 = time.perf_counter()
        mode.run(steps)
        _sync(mode.device)
        wall = time.perf_counter() - t0
    return kernel_profile(prof, mode.name, steps, wall, cuda)


def kernel_profile(prof, name: str, steps: int, wall: float, cuda: bool) -> dict:
    """A finished ``torch.profiler.profile`` of ``steps`` steps in ``wall`` seconds, per step:
    device time by kernel group (``KERNEL_GROUPS``; on the CPU, operators by their own time),
    the top kernels, the kernel count and how busy the device was."""
    groups: dict[str, list[float]] = {}
    kernels: dict[str, list[float]] = {}
    for ev in prof.events():
        if cuda:  # kernels, including those replayed inside CUDA graphs
            dev_us = getattr(ev, "device_time", None)
            if dev_us is None:
                dev_us = getattr(ev, "cuda_time", 0.0)
            if not (str(getattr(ev, "device_type", "")).endswith("CUDA") and dev_us):
                continue
        else:  # CPU: operators by their own time
            dev_us = ev.self_cpu_time_total
            if not dev_us or ev.name.startswith("ProfilerStep"):
                continue
        if True:
            g = groups.setdefault(_group(ev.name), [0.0, 0])
            g[0] += dev_us
            g[1] += 1
            k = kernels.setdefault(ev.name, [0.0, 0])
            k[0] += dev_us
            k[1] += 1
    per = max(steps, 1)
    busy = sum(v[0] for v in groups.values()) / per
    top = sorted(kernels.items(), key=lambda kv: -kv[1][0])[:20]
    return {"mode": name, "wall_ms_per_step": 1000 * wall / per, "device_busy_ms_per_step": busy / 1000,
            "kernels_per_step": sum(v[1] for v in groups.values()) / per,
            "groups_ms_per_step": {g: v[0] / per / 1000 for g, v in sorted(groups.items(), key=lambda kv: -kv[1][0])},
            "group_kernels_per_step": {g: v[1] / per for g, v in groups.items()},
            "top_kernels": [{"name": n[:160], "ms_per_step": v[0] / per / 1000, "calls_per_step": v[1] / per}
                            for n, v in top],
            # the few largest of each group, the small groups included (memsets, eager kernels)
            "top_by_group": {g: [{"name": n[:160], "ms_per_step": v[0] / per / 1000, "calls_per_step": v[1] / per}
                                 for n, v in sorted(((n, v) for n, v in kernels.items() if _group(n) == g),
                                                    key=lambda kv: -kv[1][0])[:5]]
                             for g in groups}}


def profile_table(profiles: list[dict]) -> str:
    groups = []
    for p in profiles:
        groups += [g for g in p["groups_ms_per_step"] if g not in groups]
    head = f"{'device ms per step':<30}" + "".join(f"{p['mode']:>16}" for p in profiles)
    lines = [head]
    for g in groups:
        lines.append(f"{g:<30}" + "".join(f"{p['groups_ms_per_step'].get(g, 0.0):>16.3f}" for p in profiles))
    lines.append(f"{'device busy':<30}" + "".join(f"{p['device_busy_ms_per_step']:>16.3f}" for p in profiles))
    lines.append(f"{'wall':<30}" + "".join(f"{p['wall_ms_per_step']:>16.3f}" for p in profiles))
    lines.append(f"{'kernels per step':<30}" + "".join(f"{p['kernels_per_step']:>16.0f}" for p in profiles))
    return "\n".join(lines)


MIX_MODES = ("tr", "eager", "reduce-overhead-static", "reduce-overhead-dynamic")


def _mix_schedule(pc) -> tuple[list[tuple[str, str, int, int]], int]:
    """Every step of the mix, in order: (split, variant, index, size) over enough epochs to
    cover low-res and full-res training, validation after each epoch; and the training images."""
    from tr_hydra.runtime.runner import epoch_schedule, val_schedule
    steps, n = [], 0
    for e in range(max(pc.lowres_epochs + 1, 2)):
        sched = epoch_schedule(pc, e)
        steps += [("train", v, i, size) for v, i, size in sched]
        n += sum(size for _, _, size in sched)
        steps += [("val", v, i, size) for v, i, size in val_schedule(pc)]
    return steps, n


def _variant_times(run_one, variants, repeat: int) -> dict:
    out = {}
    for v in variants:
        run_one(v, 1)
        _sync_all()
        t0 = time.perf_counter()
        run_one(v, repeat)
        _sync_all()
        out[v.name] = 1000 * (time.perf_counter() - t0) / repeat
    return out


def _sync_all():
    import torch
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def mix_tr(pc, device, repeat: int) -> dict:
    """tr_hydra: build and capture every variant, then the whole schedule."""
    from tr_hydra.runtime import compile_gc
    from tr_hydra.runtime.progress import process_age_s
    from tr_hydra.runtime.runner import Trainer
    before = process_age_s()  # this process's start (Python, imports, the config) until the trainer's
    t0 = time.perf_counter()
    lines: list[str] = []  # kept in the JSON: what the run would have printed (the compiles' reports)
    tr = Trainer(pc, "/tmp/tr_bench_mix", log=trainer_log(lines.append), telemetry=False)
    built = time.perf_counter() - t0
    t_cap = time.perf_counter()
    tr.capture()
    captured = time.perf_counter() - t_cap
    tr.run_steps([(v.name, 0, v.batch) for v in pc.variants if v.train], "train")

    def run_val(fn):
        tr.model.eval()
        with tr.ex.folded():
            fn()
        tr.model.train()
    run_val(lambda: tr.run_steps([(v.name, 0, v.batch) for v in pc.variants if not v.train], "val"))
    _sync(device)
    ready = time.perf_counter() - t0

    def run_one(v, k):
        steps = [(v.name, i, v.batch) for i in range(k)]
        if v.train:
            tr.run_steps(steps, "train")
        else:
            run_val(lambda: tr.run_steps(steps, "val"))
    per_variant = _variant_times(run_one, pc.variants, repeat)
    steps, n = _mix_schedule(pc)
    t1 = time.perf_counter()
    e = k = 0
    while k < len(steps):  # consecutive steps of one split run as one schedule (A/B feeding)
        split = steps[k][0]
        j = k
        while j < len(steps) and steps[j][0] == split:
            j += 1
        chunk = [(v, i, size) for _, v, i, size in steps[k:j]]
        if split == "train":
            tr.run_steps(chunk, "train", epoch=e)
        else:
            run_val(lambda: tr.run_steps(chunk, "val"))
            e += 1
        k = j
    _sync(device)
    g = tr.graphs
    return {"img_per_sec": n / (time.perf_counter() - t1), "first_step_of_all_variants_seconds": ready,
            "step_ms_by_variant": per_variant,
            "warmup_seconds_by_variant": dict(g.warmup_seconds) if g is not None else {},
            # the main process's compiler over each variant's warm-up: graphs compiled here or
            # loaded (a child's compile), coordinate-descent benchmarks run here
            "compile_work_by_variant": dict(g.warmup_work) if g is not None else {},
            # and where each warm-up's compiler time went (Dynamo's and Inductor's timers, seconds)
            "compile_phases_by_variant": dict(g.warmup_phases) if g is not None else {},
            # where the time to the first steps went: building the trainer (model, plan, arena),
            # cuDNN's search, the warm-ups (compiles, or waiting for them), capturing the graphs
            # (the search done at the end of the first compile is part of that warm-up)
            "ready_seconds": _ready_parts(tr, built, captured, ready),
            "cudnn_prime": _prime_json(tr.cudnn_prime) if tr.cudnn_prime else None,
            "precompile": tr.precompile_summary,
            # runtime.precompile_start=fork: seconds from the trainer's start until its launcher could
            # fork, or why it could not
            "launcher_ready_seconds": tr.launcher_ready_s, "launcher_error": tr.launcher_error,
            # how long before the trainer its launcher started (precompile.start_early: before this
            # process imported PyTorch), or None: with the trainer, or none
            "launcher_head_start_seconds": tr.launcher_head_start_s,
            # seconds from this process's start to the trainer's (not in the time to the first steps)
            "process_seconds_before_trainer": before,
            # runtime.precompile_backward: how long the first variant's backward waited for its twin
            "twin_wait_seconds": tr.twin_wait_s,
            # runtime.precompile_saved: per variant, seconds to load the compile its child saved
            "saved_load_seconds": {v: round(t, 3) for v, t in tr.saved_load_s.items()},
            # runtime.saved_store: those of them kept by an earlier run (no child compiled them),
            # those of these loaded on a thread during cuDNN's search, and the compiles this run
            # kept for the next (the children's, and those compiled whole here: written in
            # saved_store_write_seconds, after the capture)
            "saved_from_store": list(tr.saved_from_store), "saved_preloaded": list(tr.saved_preloaded),
            "saved_stored": list(tr.saved_stored), "saved_store_write_seconds": round(tr.saved_store_write_s, 3),
            # the variants this process compiled whole itself (runtime.saved_store), seconds each:
            # Inductor's cache counters (compile_work_by_variant) do not count such compiles
            "whole_compile_seconds": tr.whole_compile_s(),
            # runtime.compile_gc: seconds in Python's collector during this process's compiles,
            # and its full collections then (children: in "precompile")
            "compile_gc": tr.pc.runtime.compile_gc, "gc": compile_gc.report(),
            "trainer_log": lines}


def _ready_parts(tr, built: float, captured: float, ready: float) -> dict:
    """The time to the first step of every variant, split; the parts add up to it."""
    g = tr.graphs
    parts = {"trainer": built,
             "start_children": tr.capture_phases.get("start_children", 0.0),
             "record_convs": tr.capture_phases.get("record_convs", 0.0),
             "prime_cudnn": (tr.cudnn_prime.seconds if tr.cudnn_prime
                             and not tr.cudnn_prime.in_first_compile else 0.0),
             "warmup": sum(g.warmup_seconds.values()) if g is not None else 0.0,
             "graphs": g.graph_seconds if g is not None else 0.0}
    # the rest of the capture (the arena's snapshot and restore, waiting on the device), then
    # the first replayed step of each variant
    parts["capture_other"] = max(0.0, captured - sum(v for k, v in parts.items() if k != "trainer"))
    parts["first_steps"] = max(0.0, ready - built - captured)
    return parts


def _prime_json(rep) -> dict:
    """runtime.prime_cudnn's report (``ahead_seconds``: a thread's search beside the first
    compile; ``waited``: the main thread's wait for it)."""
    return {"convolutions": rep.calls, "seconds": rep.seconds, "in_first_compile": rep.in_first_compile,
            "ahead_seconds": rep.ahead_seconds, "waited": rep.waited, "ahead_error": rep.ahead_error}


def mix_pytorch(pc, device, mode: str, repeat: int) -> dict:
    """The same schedule in PyTorch: the torchvision model, channels_last, bf16 autocast, fused
    SGD; eager, or torch.compile(mode="reduce-overhead") with dynamic=False (a graph per shape)
    or its default automatic dynamic shapes. Training and validation are compiled separately."""
    import torch
    import torch.nn.functional as F
    from tr_hydra.models.registry import build_model
    torch.backends.cudnn.benchmark = True
    torch.manual_seed(0)
    t0 = time.perf_counter()
    model = build_model(pc.model.name, pc.model.num_classes).to(device).to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, fused=device.type == "cuda")
    amp = pc.amp

    def fwd_bwd(x, y):
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
            loss = F.cross_entropy(model(x), y)
        loss.backward()

    def fwd(x):
        with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
            return model(x).argmax(1)
    if mode != "eager":
        dynamic = False if mode.endswith("static") else None
        from tr_hydra.bench import compile_as
        options = dict(pc.runtime.inductor_options)  # as tr_hydra's compile
        fwd_bwd = compile_as(fwd_bwd, "reduce-overhead", options, dynamic=dynamic)
        fwd = compile_as(fwd, "reduce-overhead", options, dynamic=dynamic)
    data = {}
    for v in pc.variants:
        x = torch.randn(v.batch, pc.data.channels, v.res, v.res, device=device).to(memory_format=torch.channels_last)
        data[v.name] = (x.to(torch.bfloat16) if amp else x, torch.randint(0, pc.model.num_classes, (v.batch,), device=device))
    mark = getattr(torch.compiler, "cudagraph_mark_step_begin", lambda: None)

    def step(vname, train):
        x, y = data[vname]
        mark()
        if train:
            model.train()
            fwd_bwd(x, y)
            opt.step()
            opt.zero_grad(set_to_none=True)
        else:
            model.eval()
            fwd(x)
    first = {}
    for v in pc.variants:
        t = time.perf_counter()
        step(v.name, v.train)
        _sync(device)
        first[v.name] = time.perf_counter() - t
    ready = time.perf_counter() - t0

    def run_one(v, k):
        for _ in range(k):
            step(v.name, v.train)
    per_variant = _variant_times(run_one, pc.variants, repeat)
    steps, n = _mix_schedule(pc)
    t1 = time.perf_counter()
    for split, v, _, _ in steps:
        step(v, split == "train")
    _sync(device)
    return {"img_per_sec": n / (time.perf_counter() - t1), "first_step_of_all_variants_seconds": ready,
            "step_ms_by_variant": per_variant, "first_step_seconds_by_variant": first}


def epoch_mix(pc, device, modes=None, repeat: int = 5) -> dict:
    """A real epoch mix rather than one shape: low-res and full-res epochs with their last
    batches and validation at both batch sizes. For each mode: img/s over the whole schedule
    (training images over training and validation time), the time to the first step of every
    variant (compiles and captures included), and each variant's own ms/step."""
    import torch
    modes = _mix_modes(modes, device)
    out = {"variants": {v.name: {"batch": v.batch, "res": v.res, "train": v.train} for v in pc.variants},
           "modes": {}}
    for m in modes:
        r = mix_tr(pc, device, repeat) if m == "tr" else mix_pytorch(pc, device, m, repeat)
        out["modes"][m] = r
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return out


def _mix_modes(modes, device) -> list[str]:
    modes = modes or (["tr", "reduce-overhead-static", "reduce-overhead-dynamic"] if device.type == "cuda"
                      else ["tr", "eager"])
    bad = [m for m in modes if m not in MIX_MODES]
    if bad:
        from tr_hydra.errors import ConfigError
        raise ConfigError(f"bench.epoch_mix_modes: unknown {bad}; choose from {', '.join(MIX_MODES)}")
    return list(modes)


# the keys a cold epoch mix sets for each of its processes
_COLD_OWNS = ("bench.modes", "bench.epoch_mix", "bench.epoch_mix_modes", "bench.cold", "bench.out",
              "bench.profile", "bench.data", "bench.generate")


def epoch_mix_cold(argv: list[str], pc, device, modes=None, log=print, out_path: str | None = None,
                   on_progress=None) -> dict:
    """``bench.cold=true``: each epoch-mix mode in a process of its own (same overrides), with
    empty Inductor and Triton caches made for it and deleted afterwards, so the time to the
    first step of every variant is a first run's, whatever ran before (an earlier mode in the
    same process reuses Dynamo's compiles, cuDNN's loaded libraries and the caches on disk).
    The driver's JIT cache (``CUDA_CACHE_PATH``) is left as it is.

    Each mode's own results are kept next to ``out_path`` (``<stem>.cold_<mode>.json``) and
    ``on_progress(partial)`` is called before the first mode and after each, so a run stopped part-way (a time limit, a
    signal) keeps the modes that finished. SIGTERM stops the running mode's process and still
    deletes its caches."""
    import shutil
    import subprocess
    import tempfile
    from tr_hydra.errors import TrHydraError
    modes = _mix_modes(modes, device)
    keep = [a for a in argv if a.split("=", 1)[0].lstrip("+~") not in _COLD_OWNS]
    out = {"variants": {v.name: {"batch": v.batch, "res": v.res, "train": v.train} for v in pc.variants},
           "modes": {}, "cold": True}
    stem = os.path.splitext(out_path or "bench.json")[0]
    if on_progress is not None:
        on_progress(out)
    for m in modes:
        tmp = tempfile.mkdtemp(prefix=f"tr_bench_cold_{m}_")
        try:
            env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=os.path.join(tmp, "inductor"),
                       TRITON_CACHE_DIR=os.path.join(tmp, "triton"), **{COLD_PARENT_VAR: str(os.getpid())})
            res = f"{stem}.cold_{m}.json"
            cmd = [sys.executable, "-m", "tr_hydra.cli.bench", *keep, "bench.modes=[]", "bench.epoch_mix=true",
                   f"bench.epoch_mix_modes=[{m}]", "bench.cold=false", f"bench.out={res}"]
            log(f"epoch mix, cold: {m} in a process of its own, with empty caches in {tmp}", flush=True)
            rc = subprocess.run(cmd, env=env).returncode
            if rc != 0:
                raise TrHydraError(f"bench.cold: the {m} epoch mix failed in its own process (exit status {rc}); "
                                   "its output is above")
            with open(res) as f:
                r = json.load(f)["epoch_mix"]["modes"][m]
            r["caches"] = {"inductor": env["TORCHINDUCTOR_CACHE_DIR"], "triton": env["TRITON_CACHE_DIR"],
                           "fresh_process": True}
            out["modes"][m] = r
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        if on_progress is not None:
            on_progress(out)
    return out


class _Terminated(Exception):
    pass


def _term_as_exception():
    """SIGTERM (a time limit's ``timeout``, a scheduler) raises in the main thread, so ``finally``
    blocks run: a cold mode's process is stopped and its caches deleted, and what finished is
    written. Returns the previous handler."""
    import signal

    def handle(signum, frame):
        raise _Terminated()
    try:
        return signal.signal(signal.SIGTERM, handle)
    except ValueError:  # not the main thread
        return None


def mix_table(mix: dict) -> str:
    names = list(mix["variants"])
    head = f"{'epoch mix':<24} {'img/s':>9} {'first (s)':>10} " + " ".join(f"{n:>18}" for n in names)
    lines = [head, f"{'':<45}" + " ".join(f"{str(mix['variants'][n]['batch']) + 'x' + str(mix['variants'][n]['res']) + ' ms':>18}" for n in names)]
    for m, r in mix["modes"].items():
        lines.append(f"{m:<24} {r['img_per_sec']:>9,.0f} {r['first_step_of_all_variants_seconds']:>10.1f} "
                     + " ".join(f"{r['step_ms_by_variant'][n]:>18.2f}" for n in names))
    if mix.get("cold"):
        lines.append("cold (bench.cold): each mode in a process of its own, with empty Inductor and Triton caches")
    for m, r in mix["modes"].items():
        parts = r.get("ready_seconds")
        if parts:
            before = r.get("process_seconds_before_trainer")
            since = (f" ({before + r['first_step_of_all_variants_seconds']:.1f}s since the process started, "
                     f"{before:.1f}s before the trainer)" if before is not None else "")
            lines.append(f"{m}: first step of every variant after {r['first_step_of_all_variants_seconds']:.1f}s{since}: "
                         + ", ".join(f"{k.replace('_', ' ')} {v:.1f}s" for k, v in parts.items()))
        line = _precompile_line(r.get("precompile"), r.get("launcher_ready_seconds"), r.get("launcher_error"),
                                r.get("launcher_head_start_seconds"))
        if line:
            lines.append(f"{m}: {line}")
        if r.get("twin_wait_seconds") is not None:
            lines.append(f"{m}: the main process's first variant waited {r['twin_wait_seconds']:.1f}s for its "
                         f"backward's twin (runtime.precompile_backward)")
        if r.get("saved_load_seconds"):
            loads = r["saved_load_seconds"]
            kept = r.get("saved_from_store") or []
            lines.append(f"{m}: the main process loaded {len(loads)} saved compile{'s' if len(loads) != 1 else ''} "
                         f"in {sum(loads.values()):.1f}s "
                         f"(runtime.precompile_saved): " + ", ".join(f"{v} {t:.2f}s" for v, t in loads.items())
                         + (f"; {len(kept)} of them kept by an earlier run (runtime.saved_store), "
                            f"no child compiled them" if kept else "")
                         + (f"; {len(r['saved_preloaded'])} loaded on a thread during cuDNN's search"
                            if r.get("saved_preloaded") else ""))
        line = _compile_work_line(r.get("compile_work_by_variant"))
        if line:
            lines.append(f"{m}: {line}")
        if r.get("whole_compile_seconds"):
            lines.append(f"{m}: compiled whole here, to be kept (runtime.saved_store): "
                         + ", ".join(f"{v} {t:.1f}s" for v, t in r["whole_compile_seconds"].items()))
        gcr = r.get("gc")
        if gcr and r.get("compile_gc"):
            lines.append(f"{m}: Python's collector took {gcr['seconds']:.1f}s during the main process's compiles, "
                         f"{gcr['full']} full collections ({gcr['full_seconds']:.1f}s; runtime.compile_gc="
                         f"{r['compile_gc']})")
    return "\n".join(lines)


def _compile_work_line(work: dict | None) -> str:
    """What the main process's compiler did in each variant's warm-up: graphs compiled there,
    graphs loaded from the cache (the parallel children's compiles), and coordinate-descent
    benchmarks (a variant that a child tuned should need none)."""
    if not work:
        return ""
    parts = []
    for name, w in work.items():
        part = f"{name} compiled {w.get('compiled', 0)}, loaded {w.get('loaded', 0)}"
        if w.get("coordesc_benchmarks"):
            part += f", {w['coordesc_benchmarks']:,} coordinate-descent benchmarks"
        parts.append(part)
    return "main process's graphs per variant: " + "; ".join(parts)


def _precompile_line(summary: dict | None, launcher_ready: float | None, launcher_error: str | None = None,
                     head_start: float | None = None) -> str:
    """The parallel compiles: how each child started, and its time split (asked for, started,
    imports, trainer, compile and step), from the precompiler's summary. ``head_start``: how
    long before the trainer its launcher started."""
    if not summary:
        return ""
    starts = sorted({c.get("start", "spawn") for c in summary.values() if c.get("ok") is not None})
    parts = []
    for name, c in summary.items():
        if c.get("ok") is None:
            parts.append(f"{name} here")
            continue
        split = [f"{k} {c[k + '_s']:.1f}s" for k in ("start", "import", "trainer", "step") if c.get(k + "_s") is not None]
        if c.get("twin_wait_s"):  # its backward waited for its twin (runtime.precompile_backward)
            split.append(f"waited {c['twin_wait_s']:.1f}s for its twin")
        for v, t in (c.get("saved_s") or {}).items():  # runtime.precompile_saved: compiled whole, saved
            split.append(f"compiled whole and saved in {t:.1f}s" if v not in (c.get("saved_errors") or {})
                         else f"not saved ({c['saved_errors'][v][:80]})")
        gcr = c.get("gc")
        if gcr and gcr.get("seconds"):  # Python's collector during its compiles (runtime.compile_gc)
            split.append(f"Python's collector {gcr['seconds']:.1f}s in its compiles, {gcr['full']} full")
        share = c.get("cudnn_share")
        if share:  # its share of the main process's cuDNN search, run beside its compile
            split.append(f"cuDNN share {share['calls']}/{share['of']} in {share['seconds']:.1f}s"
                         + (f" ({share['error']})" if share.get("error") else ""))
        parts.append(f"{name} {c['seconds']:.1f}s{'' if c['ok'] else ' (failed)'}" + (f" ({', '.join(split)})" if split else ""))
    head = f"parallel compiles ({'/'.join(starts) or 'none started'}"
    if launcher_error:
        head += f"; the launcher failed: {launcher_error}"
    elif launcher_ready is not None:
        head += f"; the launcher could fork after {launcher_ready:.1f}s"
        if head_start:
            head += f", started {head_start:.1f}s before the trainer"
    head += ")"
    return head + ": " + "; ".join(parts)


def table(records: list[dict]) -> str:
    pt = [r for r in records if r["mode"] in PYTORCH_MODES]
    best = max(pt, key=lambda r: r["img_per_sec_median"]) if pt else None
    lines = [f"{'mode':<16} {'img/s':>10} {'spread':>7} {'x best PyTorch':>15} {'peak MiB':>9} {'first step s':>13}"]
    for r in records:
        # no PyTorch mode in the run: no ratio to show
        ratio = f"{r['img_per_sec_median'] / best['img_per_sec_median']:.3f}" if best else "-"
        lines.append(f"{r['mode']:<16} {r['img_per_sec_median']:>10,.1f} {100 * r['spread']:>6.1f}% "
                     f"{ratio:>15} {r['peak_bytes'] / 2**20:>9,.0f} {r['first_step_seconds']:>13.1f}")
    if best:
        lines.append(f"best PyTorch mode: {best['mode']}")
    for r in records:
        for key, what in (("img_per_sec_single_buffer_median", "one step at a time on buffer A"),
                          ("img_per_sec_ab_schedule_median", "A/B schedules")):
            if key in r:
                lines.append(f"{r['mode']}, timed as {what}: {r[key]:,.1f} img/s")
        m = r.get("memory", {})
        if "arena_bytes" in m:
            mib = lambda k: f"{m[k] / 2**20:,.0f}" if k in m else "-"  # noqa: E731
            lines.append(f"{r['mode']} memory MiB: arena {mib('arena_bytes')}, between steps "
                         f"{mib('allocated_between_steps_bytes')}, peak after warm-up {mib('peak_after_warmup_bytes')}, "
                         f"peak {r['peak_bytes'] / 2**20:,.0f}, predicted {mib('predicted_need_bytes')}")
        if "cudnn_prime" in r:
            cp = r["cudnn_prime"]
            ahead = (f", at the end of the first compile, after {cp['ahead_seconds']:.1f}s on a thread beside it "
                     f"(waited {cp['waited']:.1f}s)" if cp.get("in_first_compile") else "")
            if cp.get("ahead_error"):
                ahead = f", at the end of the first compile (the thread's search beside it failed: {cp['ahead_error']})"
            lines.append(f"{r['mode']}: cuDNN's search for {cp['convolutions']} convolutions before the first "
                         f"step took {cp['seconds']:.1f}s{ahead} (runtime.prime_cudnn)")
        fl = r.get("autotune_flush")
        if fl and fl.get("benchmarks"):
            lines.append(f"{r['mode']}: Triton's autotuning ran {fl['benchmarks']} benchmarks in the warm-up; "
                         f"{fl['cut']} flushed L2 with less than {fl['full_bytes'] / 2**20:.0f} MiB to stay under "
                         f"the peak (runtime.autotune_flush)")
    return "\n".join(lines)


COLD_PARENT_VAR = "TR_HYDRA_BENCH_COLD_PARENT"  # set for a cold mode's own process: the bench's pid


def _tr_mix_process(b, cold_mode: bool) -> bool:
    """Whether this process is a cold epoch mix's own process for tr_hydra (``cold_mode``:
    ``bench.cold``'s ``epoch_mix_cold`` started it, one per mode), whose first trainer is
    tr_hydra's."""
    return (cold_mode and bool(b.epoch_mix) and not b.cold and not b.data
            and not _as_list(b.modes) and _as_list(b.epoch_mix_modes) == ["tr"])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    cold_mode = bool(os.environ.get(COLD_PARENT_VAR))  # read before die_with_parent takes it
    if cold_mode:  # a cold mode's process ends with the bench that started it
        from tr_hydra.runtime.precompile import die_with_parent
        if not die_with_parent(COLD_PARENT_VAR):
            print("tr-bench: the bench that started this cold mode has ended", file=sys.stderr)
            return 1
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        return 0
    from tr_hydra.config.plan_config import plan_config_from
    with user_errors("tr-bench"):
        cfg = compose(argv)
        pc = plan_config_from(cfg)
        b = cfg.bench
        if _tr_mix_process(b, cold_mode):  # its trainer's launcher imports PyTorch beside this process
            from tr_hydra.runtime.precompile import start_early
            start_early(pc)
        import torch
        from tr_hydra.runtime.runner import pick_device
        if b.cold and not b.epoch_mix:
            from tr_hydra.errors import ConfigError
            raise ConfigError("bench.cold: applies to the epoch mix; add bench.epoch_mix=true")
        device = pick_device(pc)
        from tr_hydra.runtime.runner import set_cudnn_benchmark_limit
        set_cudnn_benchmark_limit(pc.runtime.cudnn_benchmark_limit)  # process-wide: the baselines get it too
        if b.data:
            out = end_to_end(pc, b, device)
            print(e2e_table(out["modes"]))
            profiles = [r["profile"] for r in out["modes"] if "profile" in r]
            if profiles:
                print(profile_table(profiles))
                for p in profiles:
                    print(f"{p['mode']}, profiled steps: the host waited {p['data_wait_ms_per_step']:.2f} ms "
                          f"per step for batches")
            for line in settings_lines(pc, device.type):
                print(line)
            out["host"] = host_info(device)
            print(host_line(out["host"]))
            _write(out, b.out)
            return 0
        modes = _modes(b.modes, device)
        if pc.data.name != "synthetic":  # the step is what is measured; data comes from the device
            pc = dataclasses.replace(pc, data=dataclasses.replace(pc.data, name="synthetic"))
        built = []
        for i, m in enumerate(modes):  # progress on stderr: building a compiled mode takes minutes
            print(f"tr-bench: building {m} ({i + 1}/{len(modes)})", file=sys.stderr, flush=True)
            built.append(Mode(m, pc, device, b.warmup, b.single_buffer))
            print(f"tr-bench: {m} ready, first step after {built[-1].first_seconds:.1f}s",
                  file=sys.stderr, flush=True)
        for r in range(b.repeats):
            for m in built:  # interleaved repeats
                m.time(b.steps)
            if built:
                print(f"tr-bench: repeat {r + 1}/{b.repeats} timed", file=sys.stderr, flush=True)
        records = [m.record() for m in built]
        out = {"config": pc.describe(), "runtime": dataclasses.asdict(pc.runtime), "device": str(device),
               "batch": pc.batch_size,
               "res": pc.variant("train_base").res, "steps": b.steps, "repeats": b.repeats, "modes": records}
        if records:  # before the profile and the epoch mix, which take minutes
            print(table(records), flush=True)
        if b.profile:
            out["profile"] = [profile_mode(m) for m in built]
        if b.epoch_mix:
            mm = None if b.epoch_mix_modes == "auto" else _as_list(b.epoch_mix_modes)
            if b.cold:  # the processes of their own get the device memory the modes above held
                for m in built:
                    if m.trainer is not None:
                        m.trainer.close()
                del built[:]
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                def partial(mix, out=out):
                    _write(dict(out, epoch_mix=dict(mix, complete=False)), b.out, quiet=True)
                prev = _term_as_exception()
                try:
                    out["epoch_mix"] = epoch_mix_cold(argv, pc, device, mm, out_path=b.out, on_progress=partial)
                except (_Terminated, KeyboardInterrupt) as e:
                    sig = "SIGTERM" if isinstance(e, _Terminated) else "SIGINT"
                    print(f"tr-bench: stopped by {sig}; the modes that finished are in "
                          f"{b.out or 'bench.json'}", file=sys.stderr)
                    return 143 if sig == "SIGTERM" else 130
                finally:
                    if prev is not None:
                        import signal
                        signal.signal(signal.SIGTERM, prev)
            else:
                out["epoch_mix"] = epoch_mix(pc, device, mm)
    if "profile" in out:
        print(profile_table(out["profile"]))
    if "epoch_mix" in out:
        print(mix_table(out["epoch_mix"]))
    for line in settings_lines(pc, device.type):
        print(line)
    if not cold_mode:  # after the timings; a cold mode's own process has its bench's
        out["host"] = host_info(device)
        print(host_line(out["host"]))
    _write(out, b.out)
    return 0


def python_loop_ms(n: int = 2_000_000, repeats: int = 3) -> float:
    """A pure-Python loop's best time in ms: how fast this host runs the Python that Dynamo,
    AOTAutograd and Inductor are made of, the host work of a cold compile (in session ab, a host
    1.7x slower on it reached the epoch mix's first steps 1.1-1.2x later)."""
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        sum(i * i for i in range(n))
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def host_info(device) -> dict:
    """What the figures were measured on, beyond the device: the host's processor and cores,
    Python and its speed, PyTorch, and where this process keeps Python's bytecode."""
    import torch
    import platform
    from tr_hydra import bytecode
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    if bytecode.kept():
        where = f"kept by tr_hydra in {bytecode.kept()}"
    elif sys.pycache_prefix:
        where = f"in {sys.pycache_prefix}"
    elif sys.dont_write_bytecode:
        where = "not written"
    else:
        where = "beside the sources"
    info = {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(),
            "python_loop_ms": round(python_loop_ms(), 1), "torch": torch.__version__, "bytecode": where}
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def host_line(info: dict) -> str:
    return (f"host: {info['cpu']}, {info['cores']} cores; Python {info['python']} "
            f"(a loop of 2M squares: {info['python_loop_ms']:.0f} ms), bytecode {info['bytecode']}; "
            f"torch {info['torch']}" + (f"; {info['gpu']}" if info.get("gpu") else ""))


def settings_lines(pc, device_type: str) -> list[str]:
    """Under the tables: the process-wide settings every mode ran with, tr_hydra's and PyTorch's."""
    lines = [options_line(pc)] if pc.runtime.inductor_options else []
    if pc.runtime.cudnn_benchmark_limit is not None:
        lim = pc.runtime.cudnn_benchmark_limit
        lines.append(f"cuDNN's algorithm search (runtime.cudnn_benchmark_limit={lim}), for tr_hydra and every "
                     f"PyTorch mode alike: " + ("every algorithm timed" if lim == 0 else f"up to {lim} algorithms timed")
                     + " per convolution shape")
    from tr_hydra.models.stem import stem_channel_multiple
    multiple = stem_channel_multiple(pc.runtime.stem_channels, device_type, pc.amp)
    if multiple:
        lines.append(f"tr_hydra's convolution over the image reads its input zero-padded to a multiple of "
                     f"{multiple} channels (runtime.stem_channels={pc.runtime.stem_channels}); the PyTorch modes "
                     f"run the model's own")
    if pc.runtime.maxpool == "gather" or (pc.runtime.maxpool == "auto" and device_type == "cuda"):
        who = "tr_hydra" if pc.runtime.maxpool == "gather" else "tr_hydra with Inductor"
        lines.append(f"{who} computes max pooling's backward as one gathering kernel "
                     f"(runtime.maxpool={pc.runtime.maxpool}); the PyTorch modes run the model's own")
    if pc.runtime.compile_gc == "deferred" and pc.runtime.compile != "none":
        lines.append("tr_hydra defers Python's full garbage collections while it compiles "
                     "(runtime.compile_gc=deferred); the torch.compile modes run Python's collector as it is")
    return lines


def options_line(pc) -> str:
    """Under the tables: the Inductor options every compiled mode ran with."""
    opts = ", ".join(f"{k}={v}" for k, v in pc.runtime.inductor_options)
    return f"Inductor options (runtime.inductor_options), for tr_hydra and every torch.compile mode alike: {opts}"


def _write(out: dict, path: str | None, quiet: bool = False) -> None:
    path = path or "bench.json"
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(out, f, indent=1)
    os.replace(tmp, path)  # a reader, or a run stopped mid-write, never sees half a file
    if not quiet:
        print(f"results in {path}")


if __name__ == "__main__":
    sys.exit(main())
