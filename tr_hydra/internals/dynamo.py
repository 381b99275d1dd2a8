"""What Dynamo and Inductor tell of their work: compile counters, phase timers, and the callback
at the end of a compile. Read-only: a PyTorch without one of them reports nothing."""
from __future__ import annotations

from tr_hydra import internals

# what this process's compiler did while one variant warmed up, from dynamo's counters: graphs
# compiled here (Inductor cache misses), graphs loaded from the cache (hits: a parallel child's
# compile, or an earlier run's), and coordinate-descent benchmarks run here
# (runtime.tuning chose coordinate descent; none when the tuning was loaded)
COMPILE_COUNTERS = {"compiled": ("inductor", "fxgraph_cache_miss"),
                    "loaded": ("inductor", "fxgraph_cache_hit"),
                    "coordesc_benchmarks": ("inductor", "coordesc_tuning_bench")}

# Dynamo's and Inductor's own phase timers a parallel compile reports: where its time goes
PHASES = (("trace", "bytecode_tracing"), ("aot", "create_aot_dispatcher_function"),
          ("inductor", "compile_fx_inner"), ("triton_wait", "async_compile.wait"),
          ("autotune", "CachingAutotuner.benchmark_all_configs"))


def _counters():
    try:
        from torch._dynamo.utils import counters
    except ImportError:
        return None
    return counters


def _timers() -> dict:
    try:
        from torch._dynamo.utils import compilation_time_metrics
    except ImportError:
        return {}
    return compilation_time_metrics


def compile_counts() -> dict[str, int]:
    """The process's running totals of ``COMPILE_COUNTERS``."""
    c = _counters()
    return {name: int(c[group][key]) if c is not None else 0 for name, (group, key) in COMPILE_COUNTERS.items()}


def compile_work_since(before: dict[str, int]) -> dict[str, int]:
    """``COMPILE_COUNTERS`` added since ``before`` (a ``compile_counts()``)."""
    return {name: n - before.get(name, 0) for name, n in compile_counts().items()}


def cache_counts() -> dict[str, int]:
    """Hits, misses and bypasses of Inductor's FX graph cache and AOTAutograd's cache, and with
    the gate open the tuned-kernel rule's and the compile-ahead's counts."""
    c = _counters()
    out = {}
    for group, keys in (("inductor", ("fxgraph_cache_hit", "fxgraph_cache_miss", "fxgraph_cache_bypass")),
                        ("aot_autograd", ("autograd_cache_hit", "autograd_cache_miss", "autograd_cache_bypass"))):
        for k in keys:
            out[k] = int(c[group][k]) if c is not None else 0
    if internals.is_open():
        from tr_hydra.internals import compile_ahead, tuned_kernels
        out.update({f"kernels_{k}": n for k, n in tuned_kernels.COUNTS.items()})
        out.update({f"candidates_{k}": n for k, n in compile_ahead.COUNTS.items()})
    return out


def compile_timers(least: float = 0.0, most: int = 1 << 30) -> dict[str, float]:
    """Every one of Dynamo's and Inductor's phase timers (``compilation_time_metrics``: summed
    over this process's compiles; nested timers overlap) that took ``least`` seconds or more,
    the ``most`` longest first: where a compile's time goes."""
    m = _timers()
    tot = sorted(((round(sum(v), 2), k) for k, v in m.items() if v and sum(v) >= least), reverse=True)
    return {k: t for t, k in tot[:most]}


def phase_totals() -> dict[str, float]:
    """``PHASES``' timers, by their short names."""
    m = _timers()
    return {short: round(sum(m[key]), 2) for short, key in PHASES if m.get(key)}


def phase_seconds() -> dict[str, float]:
    """The process's running totals of every one of Dynamo's and Inductor's phase timers."""
    return compile_timers()


def phase_seconds_since(before: dict[str, float], least: float = 0.05, most: int = 15) -> dict[str, float]:
    """The timers that added ``least`` seconds or more since ``before`` (a ``phase_seconds()``),
    the ``most`` longest first: where a variant's warm-up spent its compiler time (a compile:
    ``compile_fx_inner``; a load from the cache: tracing, ``PyCodeCache.load_by_key_path``...)."""
    d = sorted(((round(t - before.get(k, 0.0), 2), k) for k, t in phase_seconds().items()
                if t - before.get(k, 0.0) >= least), reverse=True)
    return {k: t for t, k in d[:most]}


def end_callbacks():
    """Dynamo's compile-end callback registry ``(register, remove)``; None in a PyTorch without
    it, or with the gate closed."""
    if not internals.is_open():
        return None
    try:
        from torch._dynamo.callback import callback_handler as h
    except ImportError:
        return None
    reg, rem = getattr(h, "register_end_callback", None), getattr(h, "remove_end_callback", None)
    return (reg, rem) if reg and rem else None
