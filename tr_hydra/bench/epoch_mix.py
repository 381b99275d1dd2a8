"""tr-bench's epoch mix: a real schedule of variants rather than one shape (low-res and
full-res epochs with their last batches, validation after each), for tr_hydra and PyTorch; with
``bench.cold``, each mode in a process of its own with empty compiler caches."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

from tr_hydra.bench.baselines import compile_as
from tr_hydra.bench.modes import lr_of, ready_runtime, runtime_log
from tr_hydra.bench.report import compile_lines
from tr_hydra.bench.timing import sync
from tr_hydra.config.epochs import epoch_schedule, val_schedule
from tr_hydra.errors import ConfigError, TrHydraError

MIX_MODES = ("tr", "eager", "reduce-overhead-static", "reduce-overhead-dynamic")
COLD_PARENT_VAR = "TR_HYDRA_BENCH_COLD_PARENT"  # set for a cold mode's own process: the bench's pid
# the keys a cold epoch mix sets for each of its processes
_COLD_OWNS = ("bench.modes", "bench.epoch_mix", "bench.epoch_mix_modes", "bench.cold", "bench.out",
              "bench.profile", "bench.data", "bench.generate")


def mix_modes(modes, device) -> list[str]:
    """``bench.epoch_mix_modes`` resolved (None: by device)."""
    modes = modes or (["tr", "reduce-overhead-static", "reduce-overhead-dynamic"] if device.type == "cuda"
                      else ["tr", "eager"])
    bad = [m for m in modes if m not in MIX_MODES]
    if bad:
        raise ConfigError(f"bench.epoch_mix_modes: unknown {bad}; choose from {', '.join(MIX_MODES)}")
    return list(modes)


def mix_schedule(pc) -> tuple[list[tuple[str, str, int, int]], int]:
    """Every step of the mix, in order: (split, variant, index, size) over enough epochs to
    cover low-res and full-res training, validation after each epoch; and the training images."""
    steps, n = [], 0
    for e in range(max(pc.lowres_epochs + 1, 2)):
        sched = epoch_schedule(pc, e)
        steps += [("train", v, i, size) for v, i, size in sched]
        n += sum(size for _, _, size in sched)
        steps += [("val", v, i, size) for v, i, size in val_schedule(pc)]
    return steps, n


def _variant_times(run_one, variants, repeat: int) -> dict:
    """Each variant's own ms/step, over ``repeat`` steps after one."""
    out = {}
    for v in variants:
        run_one(v, 1)
        sync()
        t0 = time.perf_counter()
        run_one(v, repeat)
        sync()
        out[v.name] = 1000 * (time.perf_counter() - t0) / repeat
    return out


def mix_tr(pc, device, repeat: int) -> dict:
    """tr_hydra: build the runtime, compile and capture every variant, then the whole schedule."""
    from tr_hydra.runtime.progress import process_age_s
    before = process_age_s()  # this process's start (Python, imports, the config) until the runtime's
    t0 = time.perf_counter()
    lines: list[str] = []  # kept in the JSON: what the run would have printed (the compiles' reports)
    rt, rep, built, captured = ready_runtime(pc, runtime_log(lines.append))
    try:
        lr = lr_of(pc)
        rt.run_steps([(v.name, 0, v.batch) for v in pc.variants if v.train], "train", lr=lr)
        rt.validation([(v.name, 0, v.batch) for v in pc.variants if not v.train])
        rt.sync()
        ready = time.perf_counter() - t0

        def run_one(v, k):
            steps = [(v.name, i, v.batch) for i in range(k)]
            if v.train:
                rt.run_steps(steps, "train", lr=lr)
            else:
                rt.validation(steps)
        per_variant = _variant_times(run_one, pc.variants, repeat)
        steps, n = mix_schedule(pc)
        t1 = time.perf_counter()
        e = k = 0
        while k < len(steps):  # consecutive steps of one split run as one schedule (A/B feeding)
            split = steps[k][0]
            j = k
            while j < len(steps) and steps[j][0] == split:
                j += 1
            chunk = [(v, i, size) for _, v, i, size in steps[k:j]]
            if split == "train":
                rt.run_steps(chunk, "train", lr=lr, epoch=e)
            else:
                rt.validation(chunk)
                e += 1
            k = j
        rt.sync()
        seconds = time.perf_counter() - t1
    finally:
        rt.close()
    return {"img_per_sec": n / seconds, "first_step_of_all_variants_seconds": ready,
            "step_ms_by_variant": per_variant,
            # where the time to the first steps went (the parts add up to it)
            "ready_seconds": ready_parts(rep, built, captured, ready),
            # seconds from this process's start to the runtime's (not in the time to the first steps)
            "process_seconds_before_runtime": before,
            # what getting every variant ready did: cuDNN's search, the parallel compiles, the
            # saved store, each variant's warm-up, the graphs (StartupReport)
            "startup": rep.to_json(),
            "log": lines}


def ready_parts(rep, built: float, captured: float, ready: float) -> dict:
    """The time to the first step of every variant, split; the parts add up to it: building
    the runtime (model, plan, arena), starting the parallel compiles, recording the
    convolutions, cuDNN's search, the warm-ups (compiles, or waiting for them), capturing the
    graphs (the search done at the end of the first compile is part of that warm-up)."""
    cp = rep.cudnn
    parts = {"runtime": built,
             "start_children": rep.phases.get("start_children", 0.0),
             "record_convs": rep.phases.get("record_convs", 0.0),
             "prime_cudnn": cp.seconds if cp is not None and not cp.in_first_compile else 0.0,
             "warmup": sum(rep.warmup_seconds.values()),
             "graphs": rep.graph_seconds}
    # the rest of getting ready (the arena's snapshot and restore, waiting on the device), then
    # the first replayed step of each variant
    parts["capture_other"] = max(0.0, captured - sum(v for k, v in parts.items() if k != "runtime"))
    parts["first_steps"] = max(0.0, ready - built - captured)
    return parts


def mix_pytorch(pc, device, mode: str, repeat: int) -> dict:
    """The same schedule in PyTorch: the torchvision model, channels_last, bf16 autocast, fused
    SGD; eager, or torch.compile(mode="reduce-overhead") with dynamic=False (a graph per shape)
    or its default automatic dynamic shapes. Training and validation are compiled separately."""
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
        sync(device)
        first[v.name] = time.perf_counter() - t
    ready = time.perf_counter() - t0

    def run_one(v, k):
        for _ in range(k):
            step(v.name, v.train)
    per_variant = _variant_times(run_one, pc.variants, repeat)
    steps, n = mix_schedule(pc)
    t1 = time.perf_counter()
    for split, v, _, _ in steps:
        step(v, split == "train")
    sync(device)
    return {"img_per_sec": n / (time.perf_counter() - t1), "first_step_of_all_variants_seconds": ready,
            "step_ms_by_variant": per_variant, "first_step_seconds_by_variant": first}


def _variants(pc) -> dict:
    return {v.name: {"batch": v.batch, "res": v.res, "train": v.train} for v in pc.variants}


def epoch_mix(pc, device, modes=None, repeat: int = 5) -> dict:
    """For each mode, in this process: img/s over the whole schedule (training images over
    training and validation time), the time to the first step of every variant (compiles and
    captures included), and each variant's own ms/step."""
    out = {"variants": _variants(pc), "modes": {}}
    for m in mix_modes(modes, device):
        out["modes"][m] = mix_tr(pc, device, repeat) if m == "tr" else mix_pytorch(pc, device, m, repeat)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return out


def epoch_mix_cold(argv: list[str], pc, device, modes=None, log=print, out_path: str | None = None,
                   on_progress=None) -> dict:
    """``bench.cold=true``: each epoch-mix mode in a process of its own (tr-bench again, with
    the same overrides ``argv``), with empty Inductor and Triton caches made for it and deleted
    afterwards, so the time to the first step of every variant is a first run's, whatever ran
    before (an earlier mode in the same process reuses Dynamo's compiles, cuDNN's loaded
    libraries and the caches on disk). The driver's JIT cache (``CUDA_CACHE_PATH``) is left as
    it is. The process ends with this one (``COLD_PARENT_VAR``: ``die_with_parent``).

    Each mode's own results are kept next to ``out_path`` (``<stem>.cold_<mode>.json``) and
    ``on_progress(partial)`` is called before the first mode and after each, so a run stopped
    part-way (a time limit, a signal) keeps the modes that finished. A ``Terminated`` (see
    ``sigterm_raises``) or KeyboardInterrupt stops the running mode's process and still deletes
    its caches."""
    import shutil
    import tempfile
    modes = mix_modes(modes, device)
    keep = [a for a in argv if a.split("=", 1)[0].lstrip("+~") not in _COLD_OWNS]
    out = {"variants": _variants(pc), "modes": {}, "cold": True}
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
            rc = subprocess.run(cmd, env=env, check=False).returncode
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


class Terminated(Exception):
    """SIGTERM, raised in the main thread by ``sigterm_raises``."""


def sigterm_raises():
    """SIGTERM (a time limit's ``timeout``, a scheduler) raises ``Terminated`` in the main
    thread, so ``finally`` blocks run: a cold mode's process is stopped and its caches deleted,
    and what finished is written. Returns the previous handler (None off the main thread)."""
    import signal

    def handle(signum, frame):
        raise Terminated()
    try:
        return signal.signal(signal.SIGTERM, handle)
    except ValueError:  # not the main thread
        return None


def mix_table(mix: dict) -> str:
    names = list(mix["variants"])
    head = f"{'epoch mix':<24} {'img/s':>9} {'first (s)':>10} " + " ".join(f"{n:>18}" for n in names)
    shapes = [f"{mix['variants'][n]['batch']}x{mix['variants'][n]['res']} ms" for n in names]
    lines = [head, f"{'':<45}" + " ".join(f"{s:>18}" for s in shapes)]
    for m, r in mix["modes"].items():
        lines.append(f"{m:<24} {r['img_per_sec']:>9,.0f} {r['first_step_of_all_variants_seconds']:>10.1f} "
                     + " ".join(f"{r['step_ms_by_variant'][n]:>18.2f}" for n in names))
    if mix.get("cold"):
        lines.append("cold (bench.cold): each mode in a process of its own, with empty Inductor and Triton caches")
    for m, r in mix["modes"].items():
        parts = r.get("ready_seconds")
        if parts:
            before = r.get("process_seconds_before_runtime")
            first = r["first_step_of_all_variants_seconds"]
            since = (f" ({before + first:.1f}s since the process started, {before:.1f}s before the runtime)"
                     if before is not None else "")
            lines.append(f"{m}: first step of every variant after {first:.1f}s{since}: "
                         + ", ".join(f"{k.replace('_', ' ')} {v:.1f}s" for k, v in parts.items()))
        lines += [f"{m}: {line}" for line in compile_lines(r.get("startup"))]
    return "\n".join(lines)
