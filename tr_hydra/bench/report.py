"""What tr-bench prints and writes: the step table, the profiler's kernel groups, what tr_hydra's
start-up did, the settings every mode ran with, the host, and the JSON (written atomically)."""
from __future__ import annotations

import json
import os
import sys
import time

from tr_hydra.bench.modes import PYTORCH_MODES
from tr_hydra.bench.timing import sync
from tr_hydra.errors import ConfigError

# ------------------------------------------------------------------ the step table


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
            def mib(k, m=m):
                return f"{m[k] / 2**20:,.0f}" if k in m else "-"
            lines.append(f"{r['mode']} memory MiB: arena {mib('arena_bytes')}, between steps "
                         f"{mib('allocated_between_steps_bytes')}, peak after warm-up {mib('peak_after_warmup_bytes')}, "
                         f"peak {r['peak_bytes'] / 2**20:,.0f}, predicted {mib('predicted_need_bytes')}")
        lines += [f"{r['mode']}: {line}" for line in search_lines(r.get("startup"))]
    return "\n".join(lines)


# ------------------------------------------------------------------ tr_hydra's start-up


def search_lines(s: dict | None) -> list[str]:
    """From a start-up's report (``StartupReport.to_json()``): cuDNN's search before the first
    step, and Triton's autotuning benchmarks in the warm-up."""
    out = []
    cp = (s or {}).get("cudnn")
    if cp:
        ahead = (f", at the end of the first compile, after {cp['ahead_seconds']:.1f}s on a thread beside it "
                 f"(waited {cp['waited']:.1f}s)" if cp.get("in_first_compile") else "")
        if cp.get("ahead_error"):
            ahead = f", at the end of the first compile (the thread's search beside it failed: {cp['ahead_error']})"
        out.append(f"cuDNN's search for {cp['convolutions']} convolutions before the first step took "
                   f"{cp['seconds']:.1f}s{ahead}")
    fl = (s or {}).get("autotune_flush")
    if fl and fl.get("benchmarks"):
        out.append(f"Triton's autotuning ran {fl['benchmarks']} benchmarks in the warm-up; {fl['cut']} flushed L2 "
                   f"with less than {fl['full_bytes'] / 2**20:.0f} MiB to stay under the peak")
    return out


def compile_lines(s: dict | None) -> list[str]:
    """From a start-up's report: the parallel compiles, the whole compiles loaded (a child's, or
    kept by an earlier run in the saved store), what the main process's compiler did per
    variant, and the variants it compiled whole itself to keep."""
    if not s:
        return []
    out = [children_line(s.get("children"), s.get("launcher_ready_s"), s.get("launcher_error"))]
    loads = s.get("loaded_s") or {}
    if loads:
        kept = s.get("from_store") or []
        out.append(f"the main process loaded {len(loads)} saved compile{'s' if len(loads) != 1 else ''} "
                   f"in {sum(loads.values()):.1f}s: " + ", ".join(f"{v} {t:.2f}s" for v, t in loads.items())
                   + (f"; {len(kept)} of them kept by an earlier run (runtime.saved_store_gb), "
                      f"no child compiled them" if kept else "")
                   + (f"; {len(s['preloaded'])} loaded on a thread during cuDNN's search"
                      if s.get("preloaded") else ""))
    out.append(compile_work_line(s.get("warmup_work")))
    if s.get("whole_compile_s"):
        out.append("compiled whole here, to be kept (runtime.saved_store_gb): "
                   + ", ".join(f"{v} {t:.1f}s" for v, t in s["whole_compile_s"].items()))
    return [line for line in out if line]


def compile_work_line(work: dict | None) -> str:
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


def children_line(children: dict | None, launcher_ready: float | None, launcher_error: str | None = None) -> str:
    """The parallel compiles: how each child started, and its time split (asked for, started,
    imports, runtime, compile and step), from the start-up's ``children``."""
    if not children:
        return ""
    starts = sorted({c.get("start", "spawn") for c in children.values() if c.get("ok") is not None})
    parts = []
    for name, c in children.items():
        if c.get("ok") is None:
            parts.append(f"{name} here")
            continue
        split = [f"{label} {c[key]:.1f}s" for label, key in (("start", "start_s"), ("import", "import_s"),
                                                               ("runtime", "trainer_s"), ("step", "step_s"))
                 if c.get(key) is not None]
        if c.get("kernels_tuned") is not None:  # runtime.tuning chose coordinate descent
            split.append(f"{c['kernels_tuned']} kernels tuned, {c.get('kernels_kept', 0)} small ones kept"
                         + (f", {c['kernels_unpaid']} too short to pay" if c.get("kernels_unpaid") else "")
                         + (f", {c['kernels_loaded']} as tuned before" if c.get("kernels_loaded") else "")
                         + (f", {c['candidates_ahead']} candidates compiled ahead" if c.get("candidates_ahead") else ""))
        for v, t in (c.get("saved_s") or {}).items():  # compiled whole and saved for the main process
            split.append(f"compiled whole and saved in {t:.1f}s" if v not in (c.get("saved_errors") or {})
                         else f"not saved ({c['saved_errors'][v][:80]})")
        parts.append(f"{name} {c['seconds']:.1f}s{'' if c['ok'] else ' (failed)'}" + (f" ({', '.join(split)})" if split else ""))
    head = f"parallel compiles ({'/'.join(starts) or 'none started'}"
    if launcher_error:
        head += f"; the launcher failed: {launcher_error}"
    elif launcher_ready is not None:
        head += f"; the launcher could fork after {launcher_ready:.1f}s"
    return head + "): " + "; ".join(parts)


# ------------------------------------------------------------------ the profiler

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


def kernel_group(name: str) -> str:
    low = name.lower()
    for group, keys in KERNEL_GROUPS:
        if any(k.lower() in low for k in keys):
            return group
    return "other"


def profile_mode(mode, steps: int = 5) -> dict:
    """torch.profiler over ``steps`` steps of a built ``modes.Mode``: device time per step by
    kernel group, the top kernels, kernel count per step, and how much of the step the device
    is busy."""
    from torch.profiler import ProfilerActivity, profile
    mode.run(1)
    sync(mode.device)
    cuda = mode.device.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        t0 = time.perf_counter()
        mode.run(steps)
        sync(mode.device)
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
        g = groups.setdefault(kernel_group(ev.name), [0.0, 0])
        g[0] += dev_us
        g[1] += 1
        k = kernels.setdefault(ev.name, [0.0, 0])
        k[0] += dev_us
        k[1] += 1
    per = max(steps, 1)
    busy = sum(v[0] for v in groups.values()) / per

    def entry(n, v):
        return {"name": n[:160], "ms_per_step": v[0] / per / 1000, "calls_per_step": v[1] / per}
    top = sorted(kernels.items(), key=lambda kv: -kv[1][0])[:20]
    return {"mode": name, "wall_ms_per_step": 1000 * wall / per, "device_busy_ms_per_step": busy / 1000,
            "kernels_per_step": sum(v[1] for v in groups.values()) / per,
            "groups_ms_per_step": {g: v[0] / per / 1000 for g, v in sorted(groups.items(), key=lambda kv: -kv[1][0])},
            "group_kernels_per_step": {g: v[1] / per for g, v in groups.items()},
            "top_kernels": [entry(n, v) for n, v in top],
            # the few largest of each group, the small groups included (memsets, eager kernels)
            "top_by_group": {g: [entry(n, v) for n, v in sorted(((n, v) for n, v in kernels.items()
                                                                 if kernel_group(n) == g),
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


# ------------------------------------------------------------------ settings and host


def settings_lines(pc, device_type: str) -> list[str]:
    """Under the tables: the process-wide settings every mode ran with, and where tr_hydra's
    model computes differently from the PyTorch modes' (its stem, max pooling, ReLU and linear
    layers as ``runtime.model_prep.prepare`` sets them up for this model, each path on or off,
    and, under autocast, the width of stored gradients on CUDA)."""
    lines = [options_line(pc)] if pc.runtime.inductor_options else []
    if device_type == "cuda":
        for on, note in model_path_notes(pc, device_type):
            lines.append(f"tr_hydra {note}" + ("; the PyTorch modes run the model's own" if on else ""))
    if device_type == "cuda" and pc.amp:
        lines.append("tr_hydra with Inductor stores a 16-bit gradient that several kernels read in 16 bits, "
                     "where Inductor stores it converted to float32; the PyTorch modes run Inductor's own")
    return lines


def model_path_notes(pc, device_type: str) -> list[tuple[bool, str]]:
    """``prepare``'s notes for the model of ``pc`` on ``device_type`` with Inductor (tr_hydra's
    mode), from the model built on the meta device."""
    import torch

    from tr_hydra.compiler.analysis import find_first_convs
    from tr_hydra.compiler.compile import instantiate_model
    from tr_hydra.runtime.model_prep import prepare
    model = instantiate_model(pc, "meta")
    first = find_first_convs(model, pc.data.channels)
    return prepare(model, first, torch.device(device_type), pc.amp, True, False, log=lambda *_: None).notes


def options_line(pc) -> str:
    """Under the tables: the Inductor options every compiled mode ran with."""
    opts = ", ".join(f"{k}={v}" for k, v in pc.runtime.inductor_options)
    return f"Inductor options (runtime.inductor_options), for tr_hydra and every torch.compile mode alike: {opts}"


def python_loop_ms(n: int = 2_000_000, repeats: int = 3) -> float:
    """A pure-Python loop's best time in ms: how fast this host runs the Python that Dynamo,
    AOTAutograd and Inductor are made of, the host work of a cold compile (a host 1.7x slower
    on it reached the epoch mix's first steps 1.1-1.2x later)."""
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        sum(i * i for i in range(n))
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def host_info(device) -> dict:
    """What the figures were measured on, beyond the device: the host's processor and cores,
    Python and its speed, PyTorch, and where this process keeps Python's bytecode."""
    import platform

    import torch

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


def check_writable(path: str | None) -> None:
    """Fails now, in one line, where ``write_json`` could not write ``path`` at the end; makes
    its folder if missing."""
    path = path or "bench.json"
    try:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(f"{path}.tmp", "w"):
            pass
        os.remove(f"{path}.tmp")
    except OSError as e:
        raise ConfigError(f"bench.out: cannot write {path}: {e.strerror or e}") from None


def write_json(out: dict, path: str | None, quiet: bool = False) -> None:
    """``out`` to ``path`` (``bench.json`` by default) through a temporary file, so that a reader,
    or a run stopped mid-write, never sees half a file."""
    path = path or "bench.json"
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(out, f, indent=1)
    os.replace(tmp, path)
    if not quiet:
        print(f"results in {path}")
