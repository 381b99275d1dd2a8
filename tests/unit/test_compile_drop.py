"""A trainer whose compile differs from the last one in the process drops only its own compiled
code, so a torch.compile baseline built before it (tr-bench's reduce-overhead) keeps its code and
its CUDA graph trees."""
from __future__ import annotations

import torch

from tr_hydra.internals import recompute


def _counting(fn):
    calls = []

    def backend(gm, example_inputs):
        calls.append(1)
        return gm.forward
    return torch.compile(fn, backend=backend), calls


def _baseline(x):
    return torch.relu(x) * 2


def _trainers_step(x):
    return torch.sigmoid(x) + 1


def test_a_trainers_compile_change_drops_its_own_compiled_code_and_leaves_a_baseline_alone(monkeypatch):
    """fresh_compile_for with the trainer's code objects: the trainer's function compiles again
    after a change, a torch.compile baseline compiled before it keeps its code, and
    torch._dynamo.reset (which would also reset reduce-overhead's CUDA graph trees) is not called."""
    recompute._compiled_with.clear()
    torch._dynamo.reset()
    resets = []
    monkeypatch.setattr(torch._dynamo, "reset", lambda: resets.append(1))
    base, base_calls = _counting(_baseline)
    step, step_calls = _counting(_trainers_step)
    x = torch.randn(8)
    base(x), step(x), base(x), step(x)
    assert (len(base_calls), len(step_calls)) == (1, 1)
    codes = [_trainers_step.__code__]
    assert not recompute.fresh_compile_for("none", {}, codes)   # the first trainer: nothing dropped
    base(x), step(x)
    assert (len(base_calls), len(step_calls)) == (1, 1)
    assert recompute.fresh_compile_for("pointwise", {}, codes)  # another partition: dropped
    base(x), step(x)
    assert (len(base_calls), len(step_calls)) == (1, 2), "only the trainer's function compiles again"
    assert not resets
    recompute._compiled_with.clear()


def test_without_code_objects_the_whole_of_dynamo_is_reset(monkeypatch):
    recompute._compiled_with.clear()
    resets = []
    monkeypatch.setattr(torch._dynamo, "reset", lambda: resets.append(1))
    assert not recompute.fresh_compile_for("none", {})
    assert recompute.fresh_compile_for("pointwise", {})
    assert resets == [1]
    recompute._compiled_with.clear()


def test_a_resume_function_after_a_graph_break_is_dropped_with_its_code():
    """Dynamo compiles the code after a graph break as a resume function of its own: it goes
    with the function it came from."""
    torch._dynamo.reset()
    step, calls = _counting(_with_a_break)
    x = torch.randn(8)
    step(x), step(x)
    before = len(calls)
    assert before == 2  # the part before the break and the resume function
    assert recompute.drop_compiled([_with_a_break.__code__]) >= 2  # itself and its resume function(s)
    step(x)
    assert len(calls) == 2 * before


def _with_a_break(x):
    y = torch.relu(x)
    torch._dynamo.graph_break()
    return y * 3
