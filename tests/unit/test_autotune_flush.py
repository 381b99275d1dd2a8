"""The autotune flush: the size Inductor's benchmarker gives its L2-flush buffer, under the
wrapper, against the room it is told; the benchmarker restored afterwards. The sizing goes
through InductorBenchmarker's own ``get_device_cache_size`` (the code that sizes the real buffer);
only the timing body is replaced, since it needs a GPU."""
from __future__ import annotations

import pytest

from tr_hydra.internals import autotune_flush as af

bm = pytest.importorskip("torch._inductor.runtime.benchmarking")

L2 = 60 * 2**20


class Recording(bm.InductorBenchmarker):
    """The real benchmarker but for the timing: records the flush size it would allocate."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def benchmark_gpu(self, _callable, **kwargs):
        self.seen.append(self.get_device_cache_size("cuda") if hasattr(self, "get_device_cache_size")
                         else self.L2_cache_size)
        return _callable()


def make():
    b = Recording()
    b.__dict__["L2_cache_size"] = L2  # the device's L2, as a GPU would report it
    return b


def test_each_benchmark_flushes_at_most_the_room_under_the_peak():
    b = make()
    rooms = iter([0, 10 * 2**20 + 3, 100 * 2**20, -5, 100 * 2**20])
    copies = {4: 50 * 2**20}  # the fifth candidate's call copies 50 MiB of arguments
    calls = []

    def own(fn):  # what one call of the candidate allocates; it is called once for it
        calls.append(fn())
        return copies.get(calls[-1], 0)
    with af.fit_under_peak(benchmarker=b, room=lambda: next(rooms), own=own) as rep:
        assert [b.benchmark_gpu((lambda k=k: k)) for k in range(5)] == [0, 1, 2, 3, 4]
    assert calls == [0, 1, 2, 3, 4]
    # multiples of 4 bytes (int32), never negative, and the copies come off the room
    assert b.seen == [0, 10 * 2**20, L2, 0, 50 * 2**20]
    assert (rep.full_bytes, rep.benchmarks, rep.cut, rep.smallest_bytes) == (L2, 5, 4, 0)
    assert "4 flushed L2 with less than its 60 MiB" in rep.line()
    # restored: the class's method, and the size override that was there before
    assert "benchmark_gpu" not in vars(b) and b.L2_cache_size == L2
    b.benchmark_gpu(lambda: None)
    assert b.seen[-1] == L2


def test_without_an_override_before_none_is_left_after(monkeypatch):
    b = Recording()  # sizes from the device's properties: stands in for the GPU's answer here
    monkeypatch.setattr(af, "_full_size", lambda _b: L2)
    with af.fit_under_peak(benchmarker=b, room=lambda: 4096, own=lambda fn: 0) as rep:
        b.benchmark_gpu(lambda: None)
    assert b.seen == [4096] and rep.cut == 1 and rep.full_bytes == L2
    assert "L2_cache_size" not in vars(b) and "benchmark_gpu" not in vars(b)


def test_restored_when_a_benchmark_raises():
    b = make()

    def boom():
        raise RuntimeError("invalid configuration")
    with pytest.raises(RuntimeError):
        with af.fit_under_peak(benchmarker=b, room=lambda: 0, own=lambda fn: 0):
            b.benchmark_gpu(boom)
    assert "benchmark_gpu" not in vars(b) and b.__dict__["L2_cache_size"] == L2


def test_a_benchmarker_without_the_override_is_left_alone():
    class Other:  # e.g. the Triton benchmarker, whose buffer is Triton's own
        def benchmark_gpu(self, f, **kw):
            return f()
    o = Other()
    with af.fit_under_peak(benchmarker=o, room=lambda: 0) as rep:
        assert o.benchmark_gpu(lambda: 7) == 7
    assert not rep.supported and "benchmark_gpu" not in vars(o)
    assert "no L2-size override" in rep.line()


def test_this_pytorch_sizes_its_buffer_from_the_override():
    """The mechanism the wrapper relies on, in the installed PyTorch: the default benchmarker is
    an InductorBenchmarker and reads an instance's L2_cache_size first."""
    from torch._inductor import config
    b = bm.InductorBenchmarker()
    b.__dict__["L2_cache_size"] = 1234
    size = b.get_device_cache_size("cuda") if hasattr(b, "get_device_cache_size") else b.L2_cache_size
    assert size == 1234
    # 2.11 picks InductorBenchmarker only where CUDA is available (its module's own flag)
    experimental = getattr(bm, "use_experimental_benchmarker", config.use_experimental_benchmarker)
    if experimental and not getattr(config, "use_torch_profiler_benchmarker", False):
        assert af._overridable(bm.benchmarker)


def test_the_warm_up_uses_it_only_with_inductor(tmp_path):
    from tests.helpers import small_config
    from tr_hydra import startup
    from tr_hydra.runtime.build import Runtime
    rt = Runtime(small_config(device="cpu"), log=lambda *_: None, source=False)
    with startup._flush_fit(rt) as rep:
        assert rep is None  # eager on the CPU: nothing autotunes
