"""Coordinate descent's candidates compiled ahead (``tr_hydra.internals.compile_ahead``): Inductor's
own tuner walks as it would alone, and a config a worker compiled is one the tuner then loads."""
import copy
import functools
import math
import re
from concurrent.futures import Future

import pytest

triton = pytest.importorskip("triton")
cdt = pytest.importorskip("torch._inductor.runtime.coordinate_descent_tuner")

from tests.helpers import triton_code_on_cpu  # noqa: E402
from tr_hydra.internals import compile_ahead as ca  # noqa: E402


def _key(config):
    from torch._inductor.runtime.runtime_utils import triton_config_to_hashable
    return triton_config_to_hashable(config)


def _ms(config):
    """A kernel's time at ``config``: least at XBLOCK 512 and 8 warps, 64 and 4 to start from."""
    return 1 + (math.log2(config.kwargs["XBLOCK"]) - 9) ** 2 + 0.1 * (config.num_warps - 8) ** 2


class Pool:
    """Inductor's pool of compile workers, as the tuning uses it: each job recorded, done at once."""
    def __init__(self):
        self.jobs = []

    def submit(self, fn, *args):
        self.jobs.append((fn, args))
        done = Future()
        done.set_result(None)
        return done


class Kernel:
    """What the tuning reads of a CachingAutotuner: its tuner, module file and name."""
    def __init__(self):
        self.coordesc_tuner = cdt.CoordescTuner(name="k", size_hints={"x": 2 ** 22})
        self.filename, self.inductor_meta = "/cache/k.py", {"kernel_name": "k"}


def _walk(kernel, on_time):
    """Inductor's coordinate descent over ``kernel`` from XBLOCK 64, 4 warps; ``on_time`` sees
    each config as it is timed."""
    start = triton.Config({"XBLOCK": 64}, num_warps=4, num_stages=1)
    return kernel.coordesc_tuner.autotune(lambda c: (on_time(c), _ms(c))[1], start, None)


def test_the_tuner_walks_as_alone_and_times_only_configs_compiled_ahead(monkeypatch):
    alone, walked = [], []
    best_alone = _walk(Kernel(), alone.append)
    kernel, pool = Kernel(), Pool()
    submitted = lambda: {_key(args[2]) for fn, args in pool.jobs}  # noqa: E731

    def timed(config):
        # every config the tuner times after its start was handed to the workers first
        assert not walked or _key(config) in submitted(), config
        walked.append(config)
    monkeypatch.setattr(ca, "COUNTS", {"ahead": 0, "timed": 0, "failed": 0})
    best = ca.tuning(kernel, lambda: _walk(kernel, timed), pool)
    assert (best.kwargs, best.num_warps) == (best_alone.kwargs, best_alone.num_warps) == ({"XBLOCK": 512}, 8)
    assert [_key(c) for c in walked] == [_key(c) for c in alone]  # the same walk, in order
    assert len(walked) > 3
    assert all(fn is ca.compile_candidate and args[:2] == ("/cache/k.py", "k") for fn, args in pool.jobs)
    assert len(submitted()) == len(pool.jobs) == ca.COUNTS["ahead"]  # none handed twice
    assert ca.COUNTS["timed"] == len(walked) - 1 and ca.COUNTS["failed"] == 0
    assert "autotune" not in vars(kernel.coordesc_tuner)  # the tuner's own walk again afterwards


def test_neighbours_are_the_configs_the_tuner_times_next():
    tuner = Kernel().coordesc_tuner
    start = triton.Config({"XBLOCK": 64}, num_warps=4, num_stages=1)
    found = {_key(c) for c in ca.neighbours(tuner, start)}
    # the tuner's first round from ``start`` with every candidate as slow as the start: it times each
    # neighbour once and moves nowhere
    timed = []
    tuner.autotune(lambda c: (timed.append(c), 1.0)[1], start, 1.0)
    assert found == {_key(c) for c in timed} and found


def test_workers_that_do_not_answer_are_waited_for_once(monkeypatch):
    class Stuck(Pool):
        def submit(self, fn, *args):
            self.jobs.append((fn, args))
            return Future()  # never done
    monkeypatch.setattr(ca, "COUNTS", {"ahead": 0, "timed": 0, "failed": 0})
    monkeypatch.setattr(ca, "_STUCK", [])
    monkeypatch.setattr(ca, "WAIT_S", 0.01)
    kernel, pool, walked = Kernel(), Stuck(), []
    best = ca.tuning(kernel, lambda: _walk(kernel, walked.append), pool)
    assert (best.kwargs, best.num_warps) == ({"XBLOCK": 512}, 8)  # the tuner compiled them itself
    assert ca.COUNTS["failed"] == 1 and ca._STUCK == ["k"]
    handed = len(pool.jobs)
    monkeypatch.setattr(ca, "_pool", lambda: pool)
    ca.tuning(Kernel(), lambda: _walk(kernel, walked.append))  # later tunings: none handed
    assert len(pool.jobs) == handed


def test_without_a_pool_the_tuning_runs_as_inductors(monkeypatch):
    kernel = Kernel()
    monkeypatch.setattr(ca, "_pool", lambda: None)
    assert ca.tuning(kernel, lambda: "tuned") == "tuned"
    assert "autotune" not in vars(kernel.coordesc_tuner)


@functools.lru_cache(maxsize=None)
def _cuda_kernel_source():
    """The source of a Triton kernel module Inductor generates for a pointwise op over 2^20
    elements, made for a CUDA device of compute capability 9.0 (generated on the CPU)."""
    import torch
    with triton_code_on_cpu() as codes:
        torch.compile(lambda x: x * 2 + 1, dynamic=False)(torch.randn(1 << 20))
    found = re.findall(r"async_compile\.triton\('(\w+)', '''(.*?)'''", codes[0], re.S)
    if not found:
        pytest.skip("no Triton kernel in this Inductor's CPU code")
    name, source = found[0]
    h100 = ("DeviceProperties(type='cuda', index=0, multi_processor_count=132, cc=90, major=9, "
            "regs_per_multiprocessor=65536, max_threads_per_multi_processor=2048, "
            "max_threads_per_block=1024, warp_size=32)")
    source = re.sub(r"DeviceProperties\([^)]*\)", h100, source)
    return name, source.replace("set_driver_to_cpu()", "set_driver_to_gpu()")


def test_a_config_compiled_in_a_worker_is_loaded_by_the_tuners_compile(tmp_path, monkeypatch):
    pytest.importorskip("triton.backends.nvidia")
    from torch._inductor.codecache import PyCodeCache
    from torch._inductor.runtime import triton_helpers
    name, source = _cuda_kernel_source()
    monkeypatch.setattr(triton_helpers, "set_driver_to_gpu", lambda: None)  # no GPU to select here
    cache = tmp_path / "triton"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(cache))
    path = tmp_path / f"{name}.py"
    path.write_text(source)
    kernel = getattr(PyCodeCache.load(source, extra=str(tmp_path)), name)  # this test's own copy
    first, second, third = ca.neighbours(kernel.coordesc_tuner, copy.deepcopy(kernel.configs[0]))[:3]
    entries = lambda: len(list(cache.iterdir())) if cache.exists() else 0  # noqa: E731
    for config in (first, second):  # one worker's jobs, one after the other
        ca.compile_candidate(str(path), name, config, {"TRITON_CACHE_DIR": str(cache)}, {})
    compiled = entries()
    assert compiled >= 2
    kernel._precompile_config(first)  # the tuner's compiles of those candidates: Triton's cache has them
    kernel._precompile_config(second)
    assert entries() == compiled
    kernel._precompile_config(third)  # one no worker compiled is compiled here
    assert entries() > compiled


def test_a_kernel_the_rule_tunes_has_its_candidates_compiled_ahead(monkeypatch):
    th = pytest.importorskip("torch._inductor.runtime.triton_heuristics")
    from tr_hydra.internals import tuned_kernels as tk

    def tune(self, launcher, *args, **kwargs):  # Inductor's coordinate descent, from the launcher's config
        return self.coordesc_tuner.autotune(_ms, launcher.config, None)

    class Launcher:
        config = triton.Config({"XBLOCK": 64}, num_warps=4, num_stages=1)

    pool = Pool()
    monkeypatch.setattr(th.CachingAutotuner, "coordinate_descent_tuning", tune)
    monkeypatch.setattr(tk, "_APPLIED", [])
    monkeypatch.setattr(tk, "COUNTS", {"tuned": 0, "kept": 0, "unpaid": 0, "loaded": 0})
    monkeypatch.setattr(ca, "_pool", lambda: pool)
    assert tk.apply()
    kernel = Kernel()
    kernel.size_hints = {"x": 2 ** 22}
    with tk.for_variant(True):
        best = th.CachingAutotuner.coordinate_descent_tuning(kernel, Launcher())
    assert (best.kwargs, best.num_warps) == ({"XBLOCK": 512}, 8) and len(pool.jobs) > 3
    assert tk.COUNTS["tuned"] == 1


def test_this_process_compiles_with_the_workers_ptxas(monkeypatch):
    compiler = pytest.importorskip("triton.backends.nvidia.compiler")
    from torch._inductor.runtime import compile_tasks
    monkeypatch.setenv("TRITON_PTXAS_PATH", "unset")
    monkeypatch.delenv("TRITON_PTXAS_PATH")  # absent, and absent again after the test
    monkeypatch.setattr(ca, "_ALIGNED", [])
    made = []

    def workers_ptxas():  # as Inductor's workers set it where PyTorch ships a ptxas
        made.append(1)
        import os
        os.environ["TRITON_PTXAS_PATH"] = "/torch/bin/ptxas"
    monkeypatch.setattr(compile_tasks, "_set_triton_ptxas_path", workers_ptxas)
    compiler.get_ptxas_version(90)  # this process's version, kept for Triton's cache key
    ca.same_ptxas_as_workers()
    import os
    assert os.environ["TRITON_PTXAS_PATH"] == "/torch/bin/ptxas"
    assert compiler.get_ptxas_version.cache_info().currsize == 0  # read again from the new one
    ca.same_ptxas_as_workers()
    assert made == [1]


def test_a_ptxas_named_after_triton_read_its_version_is_read_again(monkeypatch):
    """Inductor names PyTorch's ptxas in this process too when it compiles a kernel here (as it does
    while its workers start), after Triton may have read its own one's version for a cache key: the
    version is read again, or no compile of a worker would be found here."""
    compiler = pytest.importorskip("triton.backends.nvidia.compiler")
    from torch._inductor.runtime import compile_tasks
    monkeypatch.setenv("TRITON_PTXAS_PATH", "unset")
    monkeypatch.delenv("TRITON_PTXAS_PATH")
    monkeypatch.setattr(ca, "_ALIGNED", [])
    compiler.get_ptxas_version(90)  # read for a cache key before any ptxas was named
    monkeypatch.setenv("TRITON_PTXAS_PATH", "/torch/bin/ptxas")  # Inductor's in-process compile
    monkeypatch.setattr(compile_tasks, "_set_triton_ptxas_path", lambda: pytest.fail("named already"))
    ca.same_ptxas_as_workers()
    assert compiler.get_ptxas_version.cache_info().currsize == 0


def _compile_without_gpu(*args):
    """``compile_candidate`` in a compile worker of this machine, which has no GPU to select."""
    from torch._inductor.runtime import triton_helpers
    triton_helpers.set_driver_to_gpu = lambda: None
    ca.compile_candidate(*args)


def test_inductors_workers_compile_the_candidates_the_tuner_then_loads(tmp_path, monkeypatch):
    pytest.importorskip("triton.backends.nvidia")
    from torch._inductor.codecache import PyCodeCache
    from torch._inductor.compile_worker.subproc_pool import SubprocPool
    from torch._inductor.runtime import triton_helpers
    name, source = _cuda_kernel_source()
    monkeypatch.setattr(triton_helpers, "set_driver_to_gpu", lambda: None)
    cache = tmp_path / "triton"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(cache))
    monkeypatch.setattr(ca, "COUNTS", {"ahead": 0, "timed": 0, "failed": 0})
    monkeypatch.setattr(ca, "_STUCK", [])
    kernel = getattr(PyCodeCache.load(source, extra=str(tmp_path)), name)  # this test's own copy
    start = copy.deepcopy(kernel.configs[0])
    candidates = ca.neighbours(kernel.coordesc_tuner, start)
    # this process as the tuning finds it: its ptxas Triton's own, unless PyTorch ships one
    monkeypatch.setenv("TRITON_PTXAS_PATH", "unset")
    monkeypatch.delenv("TRITON_PTXAS_PATH")
    monkeypatch.setattr(ca, "_ALIGNED", [])
    pytest.importorskip("triton.backends.nvidia.compiler").get_ptxas_version.cache_clear()
    pool = SubprocPool(1)  # Inductor's compile workers, started as Inductor starts them: one, so
    # that one worker compiles every candidate of the kernel
    ca.same_ptxas_as_workers()  # as the tuning does

    class WithoutGpu:
        def submit(self, fn, *args):
            assert fn is ca.compile_candidate
            return pool.submit(_compile_without_gpu, *args)
    try:
        ahead = ca.Ahead(kernel, kernel.coordesc_tuner, WithoutGpu())
        ahead.around(start)
        for candidate in candidates:
            ahead.wait(candidate)
    finally:
        pool.shutdown()
    assert ca.COUNTS == {"ahead": len(candidates), "timed": len(candidates), "failed": 0}
    compiled = len(list(cache.iterdir()))
    assert compiled >= len(candidates)
    for candidate in candidates:  # the tuner's compiles: each found in Triton's cache
        kernel._precompile_config(candidate)
    assert len(list(cache.iterdir())) == compiled
