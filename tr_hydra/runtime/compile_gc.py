"""``runtime.compile_gc``: Python's full garbage collections deferred while the step compiles.

A compile of ResNet-50's training step makes about a million Python objects (FX nodes, sympy
expressions, Inductor's IR) that live until the compile ends. CPython runs a full collection
(generation 2, every tracked object in the process: PyTorch's own modules included) each time ten
generation-1 collections have run and the objects that reached generation 2 grew by a quarter
since the last one, so it walks that growing heap again and again. Measured on the CPU, for
ResNet-50's forward and backward compiled once: 5.05-5.17 s in the collector, 3.65-3.97 s of
it in 9 full collections; with the full ones deferred, 1.05 s in all.

``deferred`` (the default) raises the generation-2 threshold while a compile runs and puts it back
after: the young generations are still collected throughout, and objects without cycles are freed
by their reference counts the moment they die, so what waits is only cyclic garbage old enough to
reach generation 2. It is not skipped: with the threshold back, the next generation-1 collection
that finds it due runs the full one. A compile here is every compile Dynamo starts (its
compile-start and compile-end callbacks) and each whole compile (``saved_compile.compile_forward``,
which Dynamo's callbacks do not hear of), while ``during_compiles`` is entered (the warm-up of the
training process and the work of a parallel-compile child). Nested and concurrent compiles share
the outermost one's change. ``python``: Python's collector as it is.

Where Python's thresholds are not counts of generations (``gc.get_threshold()[0] == 0``, collection
off, or a Python whose collector ignores the third threshold), nothing changes.
"""
from __future__ import annotations

import contextlib
import gc
import threading
import time

MODES = ("deferred", "python")
# the generation-2 threshold while a compile runs: in effect, never due (CPython keeps counts in
# a C int)
DEFERRED_THRESHOLD2 = 1_000_000_000

_lock = threading.RLock()
_active = 0  # during_compiles contexts entered
_defer = False  # the outermost one's mode is deferred
_depth = 0  # compiles running now
_saved: tuple[int, ...] | None = None  # the thresholds before the outermost compile
_set: tuple[int, ...] | None = None  # what that compile set (put back only if still so)


class CollectorClock:
    """Time in Python's collector, per generation, split by whether a compile ran (gc.callbacks).
    One per process, installed by ``during_compiles``."""

    def __init__(self):
        self.t0 = 0.0
        self.in_compile = False
        # generation -> [collections, seconds], during compiles and outside them
        self.compiling = {0: [0, 0.0], 1: [0, 0.0], 2: [0, 0.0]}
        self.other = {0: [0, 0.0], 1: [0, 0.0], 2: [0, 0.0]}

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self.t0 = time.perf_counter()
            self.in_compile = _depth > 0
        else:
            g = min(int(info.get("generation", 2)), 2)
            d = (self.compiling if self.in_compile else self.other)[g]
            d[0] += 1
            d[1] += time.perf_counter() - self.t0

    def report(self) -> dict:
        """Seconds in the collector during the compiles, and how many full collections ran then
        and outside them."""
        return {"seconds": round(sum(s for _, s in self.compiling.values()), 3),
                "full": self.compiling[2][0], "full_seconds": round(self.compiling[2][1], 3),
                "full_outside": self.other[2][0]}


_clock: CollectorClock | None = None


def clock() -> CollectorClock:
    global _clock
    with _lock:
        if _clock is None:
            _clock = CollectorClock()
            gc.callbacks.append(_clock)
        return _clock


def report() -> dict:
    """The process's ``CollectorClock.report()`` (zeros before any ``during_compiles``)."""
    return clock().report() if _clock is not None else CollectorClock().report()


def _enter() -> None:
    global _depth, _saved, _set
    with _lock:
        _depth += 1
        if _depth > 1 or _active == 0 or not _defer:
            return
        th = gc.get_threshold()
        if len(th) < 3 or th[0] <= 0 or th[2] >= DEFERRED_THRESHOLD2:
            return
        _saved = th
        gc.set_threshold(th[0], th[1], DEFERRED_THRESHOLD2)
        _set = gc.get_threshold()


def _leave() -> None:
    global _depth, _saved, _set
    with _lock:
        _depth = max(0, _depth - 1)
        if _depth == 0 and _saved is not None:
            if gc.get_threshold() == _set:  # unless changed meanwhile by someone else
                gc.set_threshold(*_saved)
            _saved = _set = None


@contextlib.contextmanager
def compiling():
    """Around a compile Dynamo's callbacks do not hear of (a whole compile): full collections
    deferred, if a ``during_compiles(\"deferred\")`` is entered."""
    _enter()
    try:
        yield
    finally:
        _leave()


def _dynamo_callbacks():
    """Dynamo's (register_start, register_end, remove_start, remove_end), or None."""
    try:
        from torch._dynamo.callback import callback_handler as h
    except ImportError:
        return None
    names = ("register_start_callback", "register_end_callback", "remove_start_callback", "remove_end_callback")
    fns = tuple(getattr(h, n, None) for n in names)
    return fns if all(fns) else None


def _on_start(*_args) -> None:
    _enter()


def _on_end(*_args) -> None:
    _leave()


@contextlib.contextmanager
def during_compiles(mode: str):
    """While the body runs, each compile of the step defers Python's full collections
    (``mode="deferred"``; ``python``: not), and either way the collector's time during the
    compiles is counted (``report()``). Nested contexts follow the outermost one's mode."""
    global _active
    if mode not in MODES:
        raise ValueError(f"runtime.compile_gc: expected one of {', '.join(MODES)}, got {mode!r}")
    global _defer
    clock()
    cbs = _dynamo_callbacks()
    with _lock:
        _active += 1
        if _active == 1:  # the outermost context decides, and registers the callbacks
            _defer = mode == "deferred"
        if _active == 1 and cbs is not None:
            cbs[0](_on_start)
            cbs[1](_on_end)
    try:
        yield
    finally:
        with _lock:
            _active -= 1
            if _active == 0:
                if cbs is not None:
                    # torch._dynamo.reset() clears every callback: ours may be gone already
                    for remove, fn in ((cbs[2], _on_start), (cbs[3], _on_end)):
                        with contextlib.suppress(ValueError):
                            remove(fn)
                _reset()


def _reset() -> None:
    """No compile counted any more, the thresholds as before the outermost one (after a compile
    on another thread whose end callback, removed above, will not come)."""
    global _depth, _saved, _set
    with _lock:
        if _saved is not None and gc.get_threshold() == _set:
            gc.set_threshold(*_saved)
        _depth, _saved, _set = 0, None, None
