"""Compile the variants' steps in parallel processes before the warm-up.

With Inductor, every variant (shape) of the step is a separate compile of the model's forward
and backward: about a minute each for ResNet-50, one after another in the warm-up. Most of that
is single-threaded host work. So, while the main process compiles its first variant itself, one
child process per further variant builds the same plan and runs that variant's step once. That
fills Inductor's on-disk caches (the FX graph and AOTAutograd caches); when the warm-up reaches
the variant, the main process traces it and loads the compiled code instead of compiling it.

Nothing the children compute is used: they only warm caches. A child that fails (out of memory,
a compile error) costs nothing but its time; the main process then compiles that variant
itself, as it would have without precompilation.
"""
from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

CONTEXT_BYTES = 768 * 2**20  # a CUDA context, cuBLAS/cuDNN handles and workspaces per child
PARENT_VAR = "TR_HYDRA_PRECOMPILE_PARENT"  # the pid of the process that started a child
PR_SET_PDEATHSIG = 1  # linux/prctl.h
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
                 "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT")


def requested_workers(spec, n_variants: int, world_size: int, cpus: int, first: bool = False) -> int:
    """Children wanted by ``runtime.precompile`` (``auto`` or a count; 0 is off), before the
    device-memory limit: never more than the variants after the first (all of them with
    ``first``: ``runtime.precompile_first``); ``auto`` uses a third of the cores (each compile is
    one busy host thread plus Triton's compile pool) and stays off under ddp, where the ranks
    already compile side by side."""
    todo = n_variants if first else n_variants - 1
    if todo < 1:
        return 0
    if spec == "auto":
        if world_size > 1:
            return 0
        return max(0, min(todo, cpus // 3))
    return max(0, min(todo, int(spec)))


def memory_limited(workers: int, free_bytes: int, arena_bytes: int, act_bytes: int, headroom: float) -> int:
    """How many of ``workers`` fit in free device memory: each child holds a whole arena, the
    step's activations and a CUDA context; the main process still needs its own activations."""
    child = int((arena_bytes + act_bytes) * headroom) + CONTEXT_BYTES
    spare = free_bytes - int(act_bytes * headroom)
    return max(0, min(workers, spare // child)) if spare > 0 else 0


def caches_enabled() -> bool:
    try:
        import torch._inductor.config as ic
    except Exception:  # noqa: BLE001 - no Inductor: nothing to warm
        return False
    return bool(getattr(ic, "fx_graph_cache", False))


@dataclass
class _Child:
    name: str
    train: bool
    also: tuple[str, ...] = ()  # variants stepped after it in the same child (runtime.dynamic_batch)
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
                 also: dict[str, list[str]] | None = None):
        """``also``: for a variant, others of the same split that its child steps after it
        (``runtime.dynamic_batch``: they share its graph, or, where Dynamo's guards do not
        admit their batch size, compile their own in the child rather than here)."""
        self.log = log
        self.device_index = device_index
        self.workers = workers
        self.children = [_Child(n, t, tuple((also or {}).get(n, ()))) for n, t in variants]
        self._tmp = tempfile.TemporaryDirectory(prefix="tr_hydra_precompile_")
        self._pc_path = os.path.join(self._tmp.name, "plan.pkl")
        with open(self._pc_path, "wb") as f:
            pickle.dump(pc, f)
        # the child imports this package from wherever the parent did (the run's cwd may differ)
        import tr_hydra
        root = os.path.dirname(os.path.dirname(os.path.abspath(tr_hydra.__file__)))
        env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARS}  # a child joins no group
        self._env = dict(env, PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p),
                         **{PARENT_VAR: str(os.getpid())})
        self._queue = list(self.children)
        self._fill()

    def _fill(self) -> None:
        running = sum(1 for c in self.children if c.proc is not None and c.ok is None)
        while self._queue and running < self.workers:
            c = self._queue.pop(0)
            c.log_path = os.path.join(self._tmp.name, f"{c.name}.log")
            try:
                with open(c.log_path, "w") as out:
                    c.proc = subprocess.Popen(
                        [sys.executable, "-m", "tr_hydra.runtime.precompile", self._pc_path, ",".join((c.name,) + c.also),
                         "train" if c.train else "val", str(self.device_index)],
                        stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=self._env)
            except OSError as e:  # no process to be had: this variant compiles in the main process
                c.ok = False
                self.log(f"  {c.name}: could not start a parallel compile ({e.strerror}); compiling it here")
                continue
            c.started = time.perf_counter()
            c.started_wall = time.time()
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
        if c.ok:
            self.log(f"  {c.name}: compiled in a parallel process in {c.seconds:.0f}s")
        else:
            last = next((ln for ln in reversed(text.splitlines()) if ln.strip()), f"exit status {rc}")
            self.log(f"  {c.name}: parallel compile failed ({last.strip()[:160]}); compiling it here")
        return True

    def wait(self, name: str) -> None:
        """Block until ``name``'s child is done (starting queued children as others finish)."""
        target = next((c for c in self.children if c.name == name), None)
        if target is None:
            return
        if target.proc is None and target in self._queue:  # not started yet: quicker here
            self._queue.remove(target)
            return
        while True:
            for c in self.children:
                self._reap(c, block=False)
            self._fill()
            if target.ok is not None:
                return
            time.sleep(0.05)

    def next_ready(self, names: list[str]) -> str:
        """The first of ``names`` (in order) that needs no waiting: its child is done, or it has
        none (the main process compiles it). If every one waits on a running child, block until
        one of them finishes. So the main process loads each variant as soon as it is compiled."""
        by_name = {c.name: c for c in self.children}
        while True:
            for c in self.children:
                self._reap(c, block=False)
            self._fill()
            for n in names:
                c = by_name.get(n)
                if c is None or c.ok is not None or (c.proc is None and c in self._queue):
                    return n
            time.sleep(0.05)

    def close(self) -> None:
        for c in self.children:
            if c.proc is not None and c.ok is None and c.proc.poll() is None:
                c.proc.kill()
                c.proc.wait()
        self._queue = []
        self._tmp.cleanup()

    def summary(self) -> dict:
        return {c.name: {"ok": c.ok, "seconds": round(c.seconds, 1), **c.counters} for c in self.children}


# Dynamo's and Inductor's own phase timers, summed over the child's compiles: where its time goes
PHASES = (("trace", "bytecode_tracing"), ("aot", "create_aot_dispatcher_function"),
          ("inductor", "compile_fx_inner"), ("triton_wait", "async_compile.wait"),
          ("autotune", "CachingAutotuner.benchmark_all_configs"))


def _phases() -> dict:
    try:
        from torch._dynamo.utils import compilation_time_metrics as m
    except ImportError:
        return {}
    return {short: round(sum(m[key]), 2) for short, key in PHASES if m.get(key)}


def _counters() -> dict:
    from torch._dynamo.utils import counters
    out = {}
    for group, keys in (("inductor", ("fxgraph_cache_hit", "fxgraph_cache_miss", "fxgraph_cache_bypass")),
                        ("aot_autograd", ("autograd_cache_hit", "autograd_cache_miss", "autograd_cache_bypass"))):
        for k in keys:
            out[k] = int(counters[group][k])
    return out


def die_with_parent(var: str = PARENT_VAR) -> bool:
    """In a child: end with the process that started it. A trainer killed outright (SIGKILL, the
    kernel's out-of-memory killer) cannot stop its children, and each holds a CUDA context, an
    arena and a share of the host's cores for a minute or more; a run started again at once
    would find them in its way. On Linux the kernel sends the child SIGKILL when its parent dies
    (``PR_SET_PDEATHSIG``). If the parent died before that was set, the child's parent is no
    longer the pid it was given (in the environment variable ``var``): returns False, and the
    child ends at once. Elsewhere (no prctl) the child runs to its end as before. tr-bench's
    cold epoch mix runs each mode's process the same way."""
    parent = os.environ.pop(var, None)  # the process's own children get a var of their own
    if sys.platform.startswith("linux"):
        try:
            import ctypes
            import signal
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        except (OSError, AttributeError):
            pass
    return not (parent and parent.isdigit() and os.getppid() != int(parent))


def _child_main(argv: list[str]) -> int:
    """One variant's step, once, in a fresh process (or several variants', comma-separated, one
    after another): the compiles land in the shared caches."""
    if not die_with_parent():
        print("the process that started this compile has ended; nothing to do", flush=True)
        return 1
    path, names, split, index = argv
    t0 = time.perf_counter()
    with open(path, "rb") as f:
        pc = pickle.load(f)
    import dataclasses
    import torch
    from tr_hydra.runtime.runner import Trainer
    t_import = time.perf_counter()
    # under ddp: the same plan (world size included, so the same graphs) on the rank's own
    # device, with no process group; the children only compile
    pc = dataclasses.replace(pc, dist=dataclasses.replace(pc.dist, mode="none"))
    if torch.cuda.is_available():
        torch.cuda.set_device(int(index))
    with tempfile.TemporaryDirectory(prefix="tr_hydra_precompile_run_") as run_dir:
        tr = Trainer(pc, run_dir, log=lambda *_: None, telemetry=False, source=False)
        t_trainer = time.perf_counter()  # with the CUDA context
        # cuDNN's algorithm search is the main process's to do (it times on the shared GPU); the
        # compiled code does not depend on it (cudnn.benchmark is not in Inductor's cache key)
        torch.backends.cudnn.benchmark = False
        for name in names.split(","):
            if split == "train":
                tr.ex.train_step(name, "A")
            else:
                tr.model.eval()
                with tr.ex.folded():
                    tr.ex.val_step(name, "A")
        if tr.device.type == "cuda":
            torch.cuda.synchronize(tr.device)
    t_end = time.perf_counter()
    out = dict(_counters(), variants=names.split(","), import_s=round(t_import - t0, 2), trainer_s=round(t_trainer - t_import, 2),
               step_s=round(t_end - t_trainer, 2), phases_s=_phases(), done_at=time.time())
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_child_main(sys.argv[1:]))
