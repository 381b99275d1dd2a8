"""runtime.compile_gc: Python's full collections deferred while the step compiles, and only then."""
import gc

import pytest
import torch

from tr_hydra.runtime import compile_gc


@pytest.fixture(autouse=True)
def _python_thresholds():
    """Python's default thresholds around each test, whatever the suite set before."""
    before = gc.get_threshold()
    gc.set_threshold(700, 10, 10)
    yield
    gc.set_threshold(*before)


def _compile_and_look(seen: list, churn: int = 0):
    """A real Dynamo compile of a small function whose backend records Python's thresholds and
    counts the full collections while it runs (``churn`` cyclic objects made there, kept alive
    until the compile ends, as a compile's graphs are). Dynamo is reset first by the caller,
    outside the context: a reset clears Dynamo's callbacks, the context's too."""
    fulls = []

    def count(phase, info):
        if phase == "stop" and info["generation"] == 2:
            fulls.append(1)

    def backend(gm, example_inputs):
        seen.append(gc.get_threshold())
        gc.callbacks.append(count)
        try:
            kept = []
            for _ in range(churn):
                a, b = [], []
                a.append(b)
                b.append(a)
                kept.append(a)
        finally:
            gc.callbacks.remove(count)
        seen.append(len(fulls))
        return gm.forward

    f = torch.compile(lambda x: torch.relu(x) * 2 + 1, backend=backend, dynamic=False)
    x = torch.randn(4, 3)
    assert torch.equal(f(x), torch.relu(x) * 2 + 1)
    return seen


def test_deferred_raises_the_full_threshold_during_a_dynamo_compile_only():
    seen = []
    torch._dynamo.reset()
    with compile_gc.during_compiles("deferred"):
        assert gc.get_threshold() == (700, 10, 10)  # not before a compile starts
        _compile_and_look(seen)
        assert gc.get_threshold() == (700, 10, 10)  # put back at its end
    assert seen[0] == (700, 10, compile_gc.DEFERRED_THRESHOLD2)
    assert gc.get_threshold() == (700, 10, 10)


def test_python_mode_and_no_context_leave_the_collector_alone():
    seen = []
    torch._dynamo.reset()
    with compile_gc.during_compiles("python"):
        _compile_and_look(seen)
    torch._dynamo.reset()
    _compile_and_look(seen)  # outside any context
    assert seen[0] == (700, 10, 10) and seen[2] == (700, 10, 10)


def test_no_full_collection_during_a_deferred_compile_and_some_without():
    """The reference: CPython's own collector, counted through gc.callbacks, with a compile that
    builds a large heap of cyclic objects as Inductor does."""
    n = 400_000
    python, deferred = [], []
    torch._dynamo.reset()
    with compile_gc.during_compiles("python"):
        _compile_and_look(python, churn=n)
    torch._dynamo.reset()
    with compile_gc.during_compiles("deferred"):
        _compile_and_look(deferred, churn=n)
    assert python[1] > 0, "Python ran no full collection while the heap grew (the test's premise)"
    assert deferred[1] == 0
    # the clock saw them as during a compile
    rep = compile_gc.report()
    assert rep["full"] >= python[1] and rep["seconds"] > 0


def test_a_deferred_full_collection_comes_after_the_compile():
    """Not skipped: once the threshold is back, Python runs the full collection it owes, and the
    cycles made during the compile are freed."""
    import weakref

    class Node:
        pass

    refs = []
    with compile_gc.during_compiles("deferred"):
        with compile_gc.compiling():
            for _ in range(200_000):
                a, b = Node(), Node()
                a.other, b.other = b, a
                refs.append(weakref.ref(a))
            del a, b
    fulls = []

    def count(phase, info):
        if phase == "stop" and info["generation"] == 2:
            fulls.append(1)
    gc.callbacks.append(count)
    try:
        junk = []
        for _ in range(200_000):  # ordinary work after the compile
            junk.append([])
    finally:
        gc.callbacks.remove(count)
    assert fulls, "no full collection after the compile"
    assert sum(r() is not None for r in refs) < len(refs) // 100


def test_whole_compiles_nesting_threads_and_errors():
    d = compile_gc.DEFERRED_THRESHOLD2
    with compile_gc.compiling():  # no context: nothing
        assert gc.get_threshold() == (700, 10, 10)
    with compile_gc.during_compiles("deferred"):
        with compile_gc.during_compiles("python"):  # nested: the outermost one's mode
            with compile_gc.compiling():
                assert gc.get_threshold() == (700, 10, d)
                with compile_gc.compiling():
                    assert gc.get_threshold() == (700, 10, d)
                assert gc.get_threshold() == (700, 10, d)  # the outer compile still runs
            assert gc.get_threshold() == (700, 10, 10)
        with pytest.raises(RuntimeError):
            with compile_gc.compiling():
                raise RuntimeError("compile failed")
        assert gc.get_threshold() == (700, 10, 10)
        # a compile on another thread still running when the context ends
        compile_gc._enter()
        assert gc.get_threshold() == (700, 10, d)
    assert gc.get_threshold() == (700, 10, 10)
    compile_gc._leave()  # its end, later: nothing to put back
    assert gc.get_threshold() == (700, 10, 10)


def test_thresholds_changed_during_a_compile_are_kept_and_collection_off_is_left_off():
    with compile_gc.during_compiles("deferred"):
        with compile_gc.compiling():
            gc.set_threshold(1000, 20, 30)  # someone else's change
        assert gc.get_threshold() == (1000, 20, 30)
        gc.set_threshold(0, 10, 10)  # collection off through the threshold
        with compile_gc.compiling():
            assert gc.get_threshold() == (0, 10, 10)


def test_dynamo_reset_inside_the_context_is_harmless():
    seen = []
    with compile_gc.during_compiles("deferred"):
        torch._dynamo.reset()  # clears every Dynamo callback, ours included
        _compile_and_look(seen)
    assert seen[0] == (700, 10, 10)  # that compile was not heard of: nothing changed
    assert gc.get_threshold() == (700, 10, 10)
    torch._dynamo.reset()
    with compile_gc.during_compiles("deferred"):  # registered again by the next context
        _compile_and_look(seen)
    assert seen[-2] == (700, 10, compile_gc.DEFERRED_THRESHOLD2)


def test_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="deferred, python"):
        with compile_gc.during_compiles("off"):
            pass


def test_the_bench_says_so_under_its_tables_and_per_child():
    from tr_hydra.cli._common import compose
    from tr_hydra.cli.bench import _precompile_line, settings_lines
    from tr_hydra.config.plan_config import plan_config_from
    on = settings_lines(plan_config_from(compose(["runtime.compile=inductor"])), "cuda")
    off = settings_lines(plan_config_from(compose(["runtime.compile=inductor", "runtime.compile_gc=python"])), "cuda")
    assert [ln for ln in on if "runtime.compile_gc=deferred" in ln]
    assert not [ln for ln in off if "compile_gc" in ln]
    line = _precompile_line({"train_last": {"ok": True, "seconds": 50.0, "start": "fork", "step_s": 48.0,
                                            "gc": {"seconds": 0.94, "full": 0, "full_seconds": 0.0, "full_outside": 1}}},
                            2.0)
    assert "train_last 50.0s (step 48.0s, Python's collector 0.9s in its compiles, 0 full)" in line, line
