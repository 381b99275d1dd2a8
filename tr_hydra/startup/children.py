"""Compile the variants' steps in parallel processes before the warm-up.

With Inductor, every variant (shape) of the step is a separate compile of the model's forward
and backward: about a minute each for ResNet-50, one after another in the warm-up. Most of that
is single-threaded host work. So, while the training process compiles one variant itself, one
child process per further variant builds the same plan, compiles that variant's forward and
backward whole (``saved_compile``), saves it, loads it back and runs its step once through what
it loaded (Triton's autotuning lands in Inductor's caches). The training process loads the file
when its warm-up reaches the variant: it traces nothing.

A child that fails (out of memory, a compile error) costs nothing but its time: the training
process then compiles that variant itself. Children are forked from a ``Launcher`` where
possible (Linux), else started as fresh processes.
"""
from __future__ import annotations

import json
import os
import pickle
import subprocess
import tempfile
import time
from dataclasses import dataclass, field

from tr_hydra.startup.launcher import Launcher, _spawn, child_env, fork_available

CONTEXT_BYTES = 768 * 2**20  # a CUDA context, cuBLAS/cuDNN handles and workspaces per child
SAVE_FLAG = "--save-forward="  # a child's argument: compile its variant's forward whole and save it here


def requested_workers(spec, todo: int, world_size: int, cpus: int) -> int:
    """Children wanted by ``runtime.precompile`` (``auto`` or a count; 0 is off) for ``todo``
    variants, before the device-memory limit: ``auto`` uses a third of the cores (each compile
    is one busy host thread plus Triton's compile pool) and stays off under ddp, where the ranks
    already compile side by side."""
    if todo < 1:
        return 0
    if spec == "auto":
        return 0 if world_size > 1 else max(0, min(todo, cpus // 3))
    return max(0, min(todo, int(spec)))


def memory_limited(workers: int, free_bytes: int, arena_bytes: int, act_bytes: int, headroom: float) -> int:
    """How many of ``workers`` fit in free device memory: each child holds a whole arena, the
    step's activations and a CUDA context; the main process still needs its own activations."""
    child = int((arena_bytes + act_bytes) * headroom) + CONTEXT_BYTES
    spare = free_bytes - int(act_bytes * headroom)
    return max(0, min(workers, spare // child)) if spare > 0 else 0


def caches_enabled() -> bool:
    """Inductor's FX graph cache is on: the children's Triton code and autotuning reach the
    training process through it."""
    from tr_hydra.internals.inductor import fx_graph_cache_on
    return fx_graph_cache_on()


def launcher_wanted(pc, device_type: str, cpus: int) -> bool:
    """Whether a run starts a ``Launcher`` as it begins: its start-up will run parallel compiles
    (CUDA, captured graphs, Inductor, ``runtime.precompile`` wanting children) and they can be
    forked. Free device memory, checked later, may still leave no room for a child; the
    launcher is then closed unused."""
    rt = pc.runtime
    if device_type != "cuda" or not rt.cuda_graph or rt.compile not in ("auto", "inductor"):
        return False
    if not fork_available() or not caches_enabled():
        return False
    return requested_workers(rt.precompile, len(pc.variants) - 1, pc.world_size, cpus) > 0


def cpu_count() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


@dataclass
class _Child:
    name: str
    train: bool
    saved: str = ""  # where the child saves its variant's forward compiled whole
    proc: subprocess.Popen | None = None
    log_path: str = ""
    started: float = 0.0
    started_wall: float = 0.0
    seconds: float = 0.0
    ok: bool | None = None
    counters: dict = field(default_factory=dict)


class Precompiler:
    """Runs one child per variant (``workers`` at a time, in the order the warm-up needs them).
    ``wait(name)`` blocks until that variant's child is done; ``close()`` stops the rest."""

    def __init__(self, pc, variants: list[tuple[str, bool]], workers: int, log=print, device_index: int = 0,
                 launcher: Launcher | None = None, saved: bool = True):
        """``variants``: (name, is training) in the order the warm-up wants them. ``launcher``:
        fork the children from it (closed with the precompiler; one that fails starts them as
        fresh processes itself); None: each child is a fresh process. ``saved``: each child
        compiles its forward whole and saves it, for ``saved_forward`` to hand to the training
        process (False under ``runtime.recompute``, which a whole compile leaves out: the children
        then only fill the caches)."""
        self.log = log
        self.device_index = device_index
        self.workers = workers
        self._tmp = tempfile.TemporaryDirectory(prefix="tr_hydra_precompile_")
        self.children = [_Child(n, t, saved=os.path.join(self._tmp.name, f"{n}.forward") if saved else "")
                         for n, t in variants]
        self._pc_path = os.path.join(self._tmp.name, "plan.pkl")
        with open(self._pc_path, "wb") as f:
            pickle.dump(pc, f)
        self._env = child_env()
        self.launcher = launcher
        self._queue = list(self.children)
        self._fill()

    def saved_forward(self, name: str) -> str | None:
        """The file holding ``name``'s forward compiled whole by its child, once that child is
        done and wrote it; else None (no child, a failed one, or the child could not save it)."""
        c = next((c for c in self.children if c.name == name), None)
        if c is None or not c.saved or not c.ok or not os.path.exists(c.saved):
            return None
        return c.saved

    def _start(self, c: _Child) -> bool:
        c.log_path = os.path.join(self._tmp.name, f"{c.name}.log")
        argv = [self._pc_path, c.name, "train" if c.train else "val", str(self.device_index)]
        if c.saved:
            argv.append(f"{SAVE_FLAG}{c.saved}")
        try:
            c.proc = (self.launcher.start(argv, c.log_path) if self.launcher is not None
                      else _spawn(argv, c.log_path, self._env))
        except OSError as e:  # no process to be had: this variant compiles in the main process
            c.ok = False
            self.log(f"  {c.name}: could not start a parallel compile ({e.strerror}); compiling it here")
            return False
        c.started = time.perf_counter()
        c.started_wall = time.time()
        return True

    def _fill(self) -> None:
        running = sum(1 for c in self.children if c.proc is not None and c.ok is None)
        while self._queue and running < self.workers:
            if self._start(self._queue.pop(0)):
                running += 1

    def _reap(self, c: _Child, block: bool) -> bool:
        if c.proc is None or c.ok is not None:
            return c.ok is not None
        rc = c.proc.wait() if block else c.proc.poll()
        if rc is None:
            return False
        c.seconds = time.perf_counter() - c.started  # until reaped: the main process may look late
        c.ok = rc == 0
        with open(c.log_path, errors="replace") as f:
            text = f.read()
        for line in reversed(text.splitlines()):
            if line.startswith("{"):
                try:
                    c.counters = json.loads(line)
                except ValueError:
                    pass
                break
        done_at = c.counters.pop("done_at", None)
        if isinstance(done_at, (int, float)):  # when the child itself finished (same host clock)
            c.seconds = max(0.0, min(c.seconds, done_at - c.started_wall))
        last = next((ln for ln in reversed(text.splitlines()) if ln.strip()), f"exit status {rc}")
        if c.ok:
            self.log(f"  {c.name}: compiled in a parallel process in {c.seconds:.0f}s")
        else:
            self.log(f"  {c.name}: parallel compile failed ({last.strip()[:160]}); compiling it here")
        return True

    def _reap_all(self) -> None:
        for c in self.children:
            self._reap(c, block=False)

    def wait(self, name: str) -> None:
        """Block until ``name``'s child is done (starting queued children as others finish)."""
        target = next((c for c in self.children if c.name == name), None)
        if target is None:
            return
        if target.proc is None and target in self._queue:  # not started yet: quicker here
            self._queue.remove(target)
            return
        while True:
            self._reap_all()
            self._fill()
            if target.ok is not None:
                return
            time.sleep(0.05)

    def running_note(self) -> str | None:
        """``"3 parallel compiles running"``, or None when none is: for the warm-up's progress
        lines, from another thread. It asks the processes themselves (``poll``), since the main
        thread only reaps them between its own compiles."""
        n = sum(1 for c in list(self.children)
                if c.proc is not None and c.ok is None and c.proc.poll() is None)
        return f"{n} parallel compile{'s' if n != 1 else ''} running" if n else None

    def next_ready(self, names: list[str]) -> str:
        """The first of ``names`` (in order) that needs no waiting: its child is done, or it has
        none (the main process compiles it). If every one waits on a running child, block until
        one of them finishes. So the main process loads each variant as soon as it is compiled."""
        by_name = {c.name: c for c in self.children}
        while True:
            self._reap_all()
            self._fill()
            for n in names:
                c = by_name.get(n)
                if c is None or c.ok is not None or (c.proc is None and c in self._queue):
                    return n
            time.sleep(0.05)

    def close(self) -> None:
        if self.launcher is not None:  # first: its children end with it, forked or not yet
            self.launcher.close()
        for c in self.children:
            if c.proc is not None and c.ok is None and c.proc.poll() is None:
                c.proc.kill()
                c.proc.wait()
        self._queue = []
        self._tmp.cleanup()

    def summary(self) -> dict:
        """Each child's outcome, time and counters, by variant."""
        self._reap_all()
        return {c.name: {"ok": c.ok, "seconds": round(c.seconds, 1),
                         **({"start": getattr(c.proc, "start", "spawn")} if c.proc is not None else {}), **c.counters}
                for c in self.children}
