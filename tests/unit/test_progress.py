"""The warm-up's progress lines (runtime/progress.py, wired by ``startup``), on a clock the test
moves."""
from __future__ import annotations

import time
from types import SimpleNamespace

from tr_hydra import startup
from tr_hydra.runtime.progress import Heartbeat
from tr_hydra.startup.children import Precompiler


def _until(cond, timeout=5.0):
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.002)


def _quiet(lines, n, for_s=0.05):
    time.sleep(for_s)  # the thread looks every 2 ms: many chances to say something
    assert len(lines) == n, lines


def test_a_line_every_interval_saying_what_is_waited_for_and_since_when():
    clock, lines = [0.0], []
    beat = Heartbeat(lines.append, every=30, extra=lambda: "2 parallel compiles running",
                     clock=lambda: clock[0], poll=0.002)
    with beat:
        beat.now("warming up train_base")
        clock[0] = 29.0
        _quiet(lines, 0)  # not before the interval
        clock[0] = 31.0
        _until(lambda: len(lines) == 1)
        assert lines[0] == "  still warming up train_base after 31s; 2 parallel compiles running"
        _quiet(lines, 1)  # once per interval, not at every look
        clock[0] = 61.0
        _until(lambda: len(lines) == 2)
        assert lines[1].startswith("  still warming up train_base after 61s")
        beat.now("waiting for train_last's parallel compile")  # a new wait is timed from its start
        clock[0] = 80.0
        _quiet(lines, 2)
        clock[0] = 91.2
        _until(lambda: len(lines) == 3)
        assert lines[2].startswith("  still waiting for train_last's parallel compile after 30s")
        beat.now(None)  # nothing waited for: silent
        clock[0] = 500.0
        _quiet(lines, 3)
    assert beat._thread is None and beat.lines == 3
    clock[0] = 900.0
    _quiet(lines, 3)  # closed: the thread is gone


def test_it_starts_again_after_a_close_and_a_failing_note_leaves_the_line_plain():
    clock, lines = [0.0], []

    def broken():
        raise RuntimeError("no children")
    beat = Heartbeat(lines.append, every=10, extra=broken, clock=lambda: clock[0], poll=0.002)
    with beat:
        beat.now("searching cuDNN's algorithms")
    with beat:  # the start-up uses one beat for the search, then for the warm-up
        beat.now("warming up train_base")
        clock[0] = 12.0
        _until(lambda: len(lines) == 1)
    assert lines == ["  still warming up train_base after 12s"]


def test_no_thread_with_no_interval():
    beat = Heartbeat(print, every=0)
    with beat:
        assert beat._thread is None


def test_the_warm_up_says_it_waits_for_the_parallel_compiles_then_that_it_warms_up():
    events = []
    beat = SimpleNamespace(now=lambda what: events.append(("now", what)))
    pre = SimpleNamespace(wait=lambda v: events.append(("wait", v)))

    def pick(names):  # startup._order: blocks until one of them is ready
        events.append(("pick", tuple(names)))
        return names[-1]

    def load(v):  # the child's saved compile put in place before the warm-up
        events.append(("load", v))
    next_variant, before_variant = startup.warm_up_hooks(beat, pick, pre, load)
    before_variant(next_variant(["val_base", "train_last"]))
    assert events == [("now", "waiting for the parallel compiles"), ("pick", ("val_base", "train_last")),
                      ("now", "waiting for train_last's parallel compile"), ("wait", "train_last"),
                      ("load", "train_last"), ("now", "warming up train_last")]
    events.clear()
    next_variant, before_variant = startup.warm_up_hooks(beat, pick, None, load)  # none: compiled here
    before_variant(next_variant(["train_base"]))
    assert events == [("pick", ("train_base",)), ("load", "train_base"), ("now", "warming up train_base")]


def test_the_note_counts_the_parallel_compiles_still_running():
    def child(started: bool, ok, exit_status=None):
        proc = SimpleNamespace(poll=lambda: exit_status) if started else None
        return SimpleNamespace(proc=proc, ok=ok)
    pre = SimpleNamespace(children=[child(True, None), child(True, None), child(True, True, 0),
                                    child(False, None), child(True, False, 1),
                                    child(True, None, 0)])  # ended, not yet reaped by the main thread
    assert Precompiler.running_note(pre) == "2 parallel compiles running"
    pre.children = pre.children[1:]
    assert Precompiler.running_note(pre) == "1 parallel compile running"
    pre.children = [child(True, True, 0), child(True, None, 0)]
    assert Precompiler.running_note(pre) is None


def test_get_ready_reports_its_waits_until_the_graphs_are_captured(monkeypatch):
    """``get_ready``'s CUDA path on the CPU, with the graphs, the parallel compiles and cuDNN's
    search replaced by stand-ins that take time: the progress lines come from its own wiring,
    name each wait, and end before the capture."""
    import dataclasses
    import threading
    import torch
    from tests.helpers import small_config
    from tr_hydra.runtime import graphs, progress
    from tr_hydra.runtime.build import Runtime
    from tr_hydra.startup import cudnn
    monkeypatch.setattr(progress, "EVERY_S", 0.02)
    events = []

    class Graphs:  # CudaGraphs.capture's contract: choose, prepare, warm up each; settle; capture
        def __init__(self, ex):
            self.train, self.val, self.capture_seconds, self.graph_seconds = {}, {}, 0.0, 0.0
            self.warmup_seconds, self.warmup_work, self.warmup_phases, self.peak_after_warmup = {}, {}, {}, 0

        def capture(self, train_v, val_v, warmup_steps, before_variant, next_variant, before_capture):
            todo = list(train_v) + list(val_v)
            while todo:
                v = next_variant(list(todo))
                todo.remove(v)
                events.append(("warm up", v))
                before_variant(v)
                time.sleep(0.25)  # the variant's compile or load
            before_capture()
            events.append(("capture", [t.name for t in threading.enumerate() if t.name == "tr_hydra-heartbeat"]))
            self.train = {(v, b): None for v in train_v for b in "AB"}
            self.val = {(v, b): None for v in val_v for b in "AB"}

    class Children:  # Precompiler's part that the warm-up uses
        launcher = None

        def __init__(self, pc, order, n, **kw):
            self.left = [v for v, _ in order]

        def next_ready(self, names):
            time.sleep(0.25)  # every remaining one still compiling in a child
            return names[0]

        def wait(self, name):
            if name in self.left:
                self.left.remove(name)

        def running_note(self):
            return f"{len(self.left)} parallel compiles running" if self.left else None

        def saved_forward(self, name):  # no saved compiles
            return None

        def summary(self):
            return {}

        def close(self):
            pass

    pc = small_config(train_size=64, val_size=32, lowres_epochs=1, epochs=2, lowres_res=12)
    pc = dataclasses.replace(pc, runtime=dataclasses.replace(pc.runtime, precompile=1, saved_store_gb=0))
    logs = []
    rt = Runtime(pc, log=logs.append, source=False)
    rt.device = torch.device("cuda")  # only its type is read on this path
    rt.inductor = True  # as on CUDA: the parallel compiles
    monkeypatch.setattr(graphs, "CudaGraphs", Graphs)
    monkeypatch.setattr(startup, "Precompiler", Children)
    monkeypatch.setattr(startup, "caches_enabled", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (100 * 2**30, 141 * 2**30))
    monkeypatch.setattr(startup, "_flush_fit", lambda rt: __import__("contextlib").nullcontext())
    monkeypatch.setattr(cudnn, "search_ahead", lambda *a, **k: None)
    monkeypatch.setattr(cudnn, "search_now", lambda *a, **k: (events.append(("search",)), time.sleep(0.25))[0])
    rep = startup.get_ready(rt, None, logs.append)
    names = [v.name for v in pc.variants]
    # one child for the two variants after the first: the first compiled here, warmed up first
    assert rep.own == names[0] and events[0] == ("search",) and events[1] == ("warm up", names[0]), (rep.own, events)
    still = [i for i, line in enumerate(logs) if line.startswith("  still ")]
    captured = next(i for i, line in enumerate(logs) if line.startswith("captured "))
    assert still and max(still) < captured, logs
    said = "\n".join(logs[i] for i in still)
    assert "still searching cuDNN's algorithms after" in said
    assert f"still warming up {rep.own} after" in said  # the main process's own compile
    assert "still waiting for the parallel compiles after" in said
    assert "parallel compiles running" in said
    assert events[-1] == ("capture", [])  # no progress thread left when the graphs are captured
    assert rep.graphs == 2 * len(names) and rt.graphs is not None
