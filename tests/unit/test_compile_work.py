"""The main process's compiler work per variant's warm-up (``graphs.compile_work_since``):
counted around real Inductor compiles on the CPU, a fresh one and one loaded from the cache."""
from __future__ import annotations

import torch

from tr_hydra.internals.dynamo import compile_counts, compile_work_since, phase_seconds, phase_seconds_since


def _f(x):
    return torch.relu(x * 2.0 + 1.0).sum(0)


def test_a_compile_counts_as_compiled_and_the_same_graph_again_as_loaded(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    from torch._inductor.codecache import PyCodeCache
    x = torch.randn(16, 8)
    torch._dynamo.reset()
    before, phases = compile_counts(), phase_seconds()
    assert phase_seconds_since(phases) == {}
    with torch.no_grad():  # one graph, no backward
        y = torch.compile(_f, backend="inductor")(x)
    first, first_phases = compile_work_since(before), phase_seconds_since(phases, least=0.0, most=100)
    assert torch.allclose(y, _f(x))
    assert first == {"compiled": 1, "loaded": 0, "coordesc_benchmarks": 0}, first

    torch._dynamo.reset()  # a new process's view: only the disk cache is left
    PyCodeCache.cache_clear()
    before, phases = compile_counts(), phase_seconds()
    with torch.no_grad():
        y = torch.compile(_f, backend="inductor")(x)
    second, second_phases = compile_work_since(before), phase_seconds_since(phases, least=0.0, most=100)
    assert torch.allclose(y, _f(x))
    assert second == {"compiled": 0, "loaded": 1, "coordesc_benchmarks": 0}, second
    # where the time went: both traced; Inductor's part is a compile (C++ on the CPU) the first
    # time, a load from the cache the second
    assert first_phases["bytecode_tracing"] > 0 and first_phases["compile_fx_inner"] > 0, first_phases
    assert second_phases["bytecode_tracing"] > 0, second_phases
    assert second_phases.get("compile_fx_inner", 0.0) < first_phases["compile_fx_inner"] / 2, (first_phases, second_phases)
    assert list(first_phases.values()) == sorted(first_phases.values(), reverse=True)
    torch._dynamo.reset()
