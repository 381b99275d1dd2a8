"""Coordinate descent's candidates compiled ahead, in Inductor's compile workers.

Coordinate descent times a kernel's neighbouring configs one after another, and most of its time
was Triton compiling each candidate just before timing it (with every candidate found in
Triton's cache, the MLPerf plan's full batch compiled in less than half the time). So at the start of a kernel's tuning, and whenever its
best config changes, every config one step from that best (those the tuner may time next) goes
to Inductor's pool of compile workers, which compile it into Triton's cache the way they compile
a kernel's first configs (``_precompile_config``); the tuner's own compile of the candidate then
loads it. The walk, the timings and the config chosen stay Inductor's: a candidate is timed once
its compile has come back, or failed (the tuner then compiles it itself, as before). Triton keys
its cache by the ptxas that compiled, so this process is first given the workers' one. The
time it saves: ``docs/performance.md``.
"""
from __future__ import annotations

import concurrent.futures
import copy
import os

# longest wait for a worker's compile before the tuner compiles the config itself; after one such
# wait the workers are taken to be stuck and the process's later tunings compile as Inductor's do
WAIT_S = 30.0
_STUCK: list = []
_ALIGNED: list = []  # this process's ptxas made the workers' (same_ptxas_as_workers)
# candidates handed to the workers, those of them the tuner then timed, and of those the ones whose
# compile in a worker failed or did not come back in time (the tuner compiled them itself)
COUNTS = {"ahead": 0, "timed": 0, "failed": 0}


def neighbours(tuner, config) -> list:
    """Every config one step from ``config`` along one of ``tuner``'s fields that it would time:
    the tuner's own neighbour values, each kept where the tuner finds it valid."""
    from torch._inductor.runtime.coordinate_descent_tuner import get_field, set_field
    found = []
    for field in tuner.tunable_fields:
        value = get_field(config, field)
        if value is None:
            continue
        for other in tuner.get_neighbour_values(field, value):
            candidate = copy.deepcopy(config)
            set_field(candidate, field, other)
            if tuner.is_valid_config(candidate):
                found.append(candidate)
    return found


def compile_candidate(path: str, name: str, config, env: dict, patch: dict) -> None:
    """In a compile worker: kernel ``name`` of the Inductor module at ``path`` compiled at
    ``config`` into Triton's cache, by the call Inductor's workers compile a kernel's first configs
    with (``_precompile_config``; not ``precompile``, which compiles a kernel's configs once and
    then only returns, where one worker compiles several candidates of a kernel)."""
    os.environ.update(env)
    from torch._inductor import config as inductor_config
    from torch._inductor.codecache import PyCodeCache
    from torch._inductor.runtime import compile_tasks
    getattr(compile_tasks, "_set_triton_ptxas_path", lambda: None)()
    with open(path) as f:
        source = f.read()
    with inductor_config.patch(patch):
        getattr(PyCodeCache.load(source), name)._precompile_config(config)


def same_ptxas_as_workers() -> None:
    """Make this process's Triton compiles use the ptxas Inductor's workers use. The workers take
    PyTorch's own where it ships one (``_set_triton_ptxas_path``, as they start), this process
    Triton's unless told otherwise, and Triton's cache key holds the ptxas version: with two
    versions no compile of a worker would be found here. Once a process."""
    if _ALIGNED:
        return
    _ALIGNED.append(True)
    if os.environ.get("TRITON_PTXAS_PATH") is None:
        from torch._inductor.runtime import compile_tasks
        workers = getattr(compile_tasks, "_set_triton_ptxas_path", lambda: None)
        getattr(workers, "__wrapped__", workers)()  # kept once a process (2.11): its work itself
    if os.environ.get("TRITON_PTXAS_PATH") is not None:
        # the version Triton keeps for its cache key, read again from the ptxas now named: it may
        # have been read before the name was set, here or by Inductor compiling a kernel in this
        # process (as it does while its workers start), which sets it as the workers do
        try:
            from triton.backends.nvidia import compiler
            compiler.get_ptxas_version.cache_clear()
        except (ImportError, AttributeError):
            pass


def _pool():
    """Inductor's pool of compile workers where it compiles in parallel, else None."""
    try:
        from torch._inductor.async_compile import AsyncCompile
        return AsyncCompile.process_pool() if AsyncCompile.use_process_pool() else None
    except Exception:  # noqa: BLE001 - no pool here: the tuner compiles as before
        return None


class Ahead:
    """The compiles handed to ``pool`` for one kernel's tuning, by config."""

    def __init__(self, kernel, tuner, pool):
        from torch._inductor import config as inductor_config
        from torch._inductor.runtime.runtime_utils import triton_config_to_hashable
        self.key, self.tuner, self.pool = triton_config_to_hashable, tuner, pool
        self.path, self.name = kernel.filename, kernel.inductor_meta.get("kernel_name")
        self.env = {v: os.environ[v] for v in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "TRITON_PTXAS_PATH")
                    if v in os.environ}
        self.patch = ({"use_static_triton_launcher": inductor_config.use_static_triton_launcher}
                      if hasattr(inductor_config, "use_static_triton_launcher") else {})
        self.futures: dict = {}

    def around(self, config) -> None:
        """Hand every config one step from ``config`` not yet handed or timed to the workers (two
        steps ahead, the ring after each move too, was no faster: 137.7 s against 138.0 s)."""
        for candidate in neighbours(self.tuner, config):
            key = self.key(candidate)
            if _STUCK or key in self.futures or self.tuner.lookup_in_cache(candidate) is not None:
                continue
            try:
                self.futures[key] = self.pool.submit(compile_candidate, self.path, self.name,
                                                     candidate, self.env, self.patch)
            except Exception:  # noqa: BLE001 - a pool that cannot take it: compiled when timed
                return
            COUNTS["ahead"] += 1

    def wait(self, config) -> None:
        """Until ``config``'s compile in a worker has come back, if it was handed to one."""
        future = self.futures.get(self.key(config))
        if future is not None and not _STUCK:
            COUNTS["timed"] += 1
            try:
                future.result(timeout=WAIT_S)
            except Exception as e:  # noqa: BLE001 - failed or slow: the tuner compiles it itself
                COUNTS["failed"] += 1
                if isinstance(e, (TimeoutError, concurrent.futures.TimeoutError)):  # one class from 3.11
                    _STUCK.append(self.name)


def tuning(kernel, run, pool=None):
    """``run()`` (Inductor's coordinate descent over ``kernel``) with the neighbours of each best
    config compiled ahead in ``pool`` (Inductor's compile workers where none is given)."""
    tuner = getattr(kernel, "coordesc_tuner", None)
    pool = pool if pool is not None else None if _STUCK else _pool()
    if pool is None or tuner is None or not getattr(kernel, "filename", None) \
            or not (getattr(kernel, "inductor_meta", None) or {}).get("kernel_name"):
        return run()
    same_ptxas_as_workers()
    ahead, walk = Ahead(kernel, tuner, pool), tuner.autotune

    def autotune(func, baseline_config, baseline_timing=None):
        best = [baseline_timing]
        ahead.around(baseline_config)

        def timed(config):
            ahead.wait(config)
            ms = func(config)
            if best[0] is None or tuner.has_improvement(best[0], ms):
                best[0] = ms
                ahead.around(config)  # the tuner walks on from this config
            return ms
        return walk(timed, baseline_config, baseline_timing)

    tuner.autotune = autotune
    try:
        return run()
    finally:
        tuner.__dict__.pop("autotune", None)
