"""The L2-flush buffer of Inductor's runtime autotuning, sized to fit under the memory
high-water mark while the training process warms up.

With a cold cache, Inductor autotunes a Triton kernel the first time it launches. Before each
timed run of a candidate it clears the L2 cache by zeroing a buffer the size of L2 (tens of MiB),
allocated for the benchmark. For the backward's kernels that first launch is in the
first warm-up step, with every saved activation alive, so the buffer lands on top of the
step's peak. Inductor already keeps the copies of the arguments a candidate overwrites under
the high-water mark (``copy_args_to_cpu_if_needed``: the room is ``max_memory_allocated() -
memory_allocated()``). The same rule applies here to the flush buffer: while the training
process warms up, each benchmark's buffer is at most that room less those copies (they are
allocated on top of it, in each timed call), so autotuning never raises the peak (``docs/memory.md``). Where the room is smaller than L2 the
candidates are timed with part of L2 warm; they are still timed alike, each after the same
flush. The parallel compiles' children keep Inductor's own buffer.

This works through the benchmarker's own override of the cache size (an ``L2_cache_size`` in
the instance's ``__dict__``, read first by ``InductorBenchmarker``); a benchmarker without it is
left alone and reported as such.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable, Iterator

@dataclass
class FlushReport:
    supported: bool = True
    full_bytes: int = 0          # the device's L2 size: Inductor's buffer
    benchmarks: int = 0          # benchmarks run while active
    cut: int = 0                 # of them, with the buffer cut below full_bytes
    smallest_bytes: int | None = None
    sizes: list[int] = field(default_factory=list, repr=False)

    def line(self) -> str:
        if not self.supported:
            return ("autotune flush: this PyTorch's benchmarker has no L2-size override; "
                    "Inductor's autotuning flushes L2 with its own buffer")
        if not self.benchmarks:
            return "autotune flush: no Triton autotuning in this process (the caches had it)"
        small = self.smallest_bytes if self.smallest_bytes is not None else self.full_bytes
        return (f"autotune flush: {self.benchmarks} autotuning benchmarks; {self.cut} flushed L2 with "
                f"less than its {self.full_bytes / 2**20:.0f} MiB to stay under the peak "
                f"(smallest {small / 2**20:.1f} MiB)")


def _benchmarker():
    try:
        from torch._inductor.runtime import benchmarking
    except Exception:  # no Inductor: nothing autotunes
        return None
    return getattr(benchmarking, "benchmarker", None)


def _overridable(b) -> bool:
    """True when ``b`` sizes its flush buffer from an ``L2_cache_size`` that an instance attribute
    overrides (InductorBenchmarker: ``get_device_cache_size`` looks in ``__dict__`` first, or the
    ``L2_cache_size`` cached property, which the instance's ``__dict__`` shadows)."""
    try:
        from torch._inductor.runtime.benchmarking import InductorBenchmarker
    except Exception:
        return False
    return isinstance(b, InductorBenchmarker) and hasattr(type(b), "L2_cache_size")


def _cuda_room(device) -> Callable[[], int]:
    import torch

    def room() -> int:
        return torch.cuda.max_memory_allocated(device) - torch.cuda.memory_allocated(device)
    return room


def _cuda_own(device) -> Callable[[Callable[[], object]], int]:
    """Bytes one call of the benchmarked callable allocates: Inductor's candidate call clones the
    arguments the kernel overwrites, and those copies sit on top of the flush buffer."""
    import torch

    def own(fn) -> int:
        key = "allocated_bytes.all.allocated"
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_stats(device).get(key, 0)
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.memory_stats(device).get(key, 0) - before
    return own


def _full_size(b) -> int:
    if hasattr(b, "get_device_cache_size"):
        return int(b.get_device_cache_size())
    return int(b.L2_cache_size)


@contextlib.contextmanager
def fit_under_peak(device=None, benchmarker=None, room: Callable[[], int] | None = None,
                   own: Callable[[Callable[[], object]], int] | None = None,
                   check: Callable[[object], bool] = _overridable) -> Iterator[FlushReport]:
    """While active, each ``benchmarker.benchmark_gpu(fn)`` call flushes L2 with a buffer of at
    most ``room() - own(fn)`` bytes: the room under the device's high-water mark, less what one
    call of ``fn`` allocates (run once for that, as the benchmark's own warm-up call does).
    Restores the benchmarker on exit."""
    b = benchmarker if benchmarker is not None else _benchmarker()
    if b is None or not check(b):
        yield FlushReport(supported=b is None)  # no Inductor at all: nothing to cut
        return
    room = room or _cuda_room(device)
    own = own or _cuda_own(device)
    rep = FlushReport(full_bytes=_full_size(b))
    had_method = "benchmark_gpu" in vars(b)
    had_size = "L2_cache_size" in vars(b)
    old_method = vars(b).get("benchmark_gpu")
    old_size = vars(b).get("L2_cache_size")
    inner = b.benchmark_gpu  # the bound method (or an earlier instance override)

    def benchmark_gpu(*args, **kwargs):
        fn = args[0] if args else kwargs.get("_callable")
        copies = own(fn) if callable(fn) else 0
        size = max(0, min(rep.full_bytes, int(room()) - copies))
        size -= size % 4  # int32 elements
        rep.benchmarks += 1
        rep.sizes.append(size)
        if size < rep.full_bytes:
            rep.cut += 1
            rep.smallest_bytes = size if rep.smallest_bytes is None else min(rep.smallest_bytes, size)
        b.__dict__["L2_cache_size"] = size
        try:
            return inner(*args, **kwargs)
        finally:
            if had_size:
                b.__dict__["L2_cache_size"] = old_size
            else:
                b.__dict__.pop("L2_cache_size", None)

    b.benchmark_gpu = benchmark_gpu
    try:
        yield rep
    finally:
        if had_method:
            b.benchmark_gpu = old_method
        else:
            b.__dict__.pop("benchmark_gpu", None)
