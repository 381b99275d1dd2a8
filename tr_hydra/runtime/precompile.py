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

How a child starts (``runtime.precompile_start``): ``spawn`` starts each child as a fresh Python
process; ``fork`` (Linux) forks each child from a launcher process that imported PyTorch, the
trainer and Inductor while the training process was building its trainer, so the children skip
that import (7-10 s each on the H200's host with five of them starting together). ``auto``, the
default, is ``fork`` where it is available and ``spawn`` elsewhere.
"""
from __future__ import annotations

import atexit
import contextlib
import json
import os
import pickle
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field

CONTEXT_BYTES = 768 * 2**20  # a CUDA context, cuBLAS/cuDNN handles and workspaces per child
PARENT_VAR = "TR_HYDRA_PRECOMPILE_PARENT"  # the pid of the process that started a child
PR_SET_PDEATHSIG = 1  # linux/prctl.h
SHARE_FLAG = "--cudnn-share="  # a child's argument: its share k/n of the main process's cuDNN search
BACKWARD_FLAG = "--backward-only="  # a child's argument: it is the backward twin holding this lock
TWIN_FLAG = "--twin="  # a child's argument: its backward waits for the twin holding this lock
SAVE_FLAG = "--save-forward="  # a child's argument: compile its variant's forward whole and save it here
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


def twins_limited(candidates: int, spec, cpus: int, workers: int, free_bytes: int, arena_bytes: int,
                  act_bytes: int, headroom: float) -> int:
    """How many backward twins (``runtime.precompile_backward``) to start for ``candidates``
    training variants, beside ``workers`` whole-variant children: with ``auto`` parallel
    compiles up to a third of the cores, with a count up to that count; and as many as fit in
    the device memory the children leave. A twin holds an arena and a CUDA context, but runs no
    step, so no activations."""
    if candidates < 1 or workers < 0:
        return 0
    cap = cpus // 3 if spec == "auto" else int(spec)
    child = int((arena_bytes + act_bytes) * headroom) + CONTEXT_BYTES
    spare = free_bytes - int(act_bytes * headroom) - workers * child
    fit = spare // (int(arena_bytes * headroom) + CONTEXT_BYTES) if spare > 0 else 0
    return max(0, min(candidates, cap, fit))


# what a launcher imports before it forks: PyTorch, the trainer, and the parts of Dynamo,
# AOTAutograd and Inductor that a first compile would otherwise import lazily
LAUNCHER_PRELOAD = ("torch", "tr_hydra.runtime.runner", "torch._dynamo", "torch._functorch.aot_autograd",
                    "torch._inductor.compile_fx")


LAUNCHER_READY_TIMEOUT_S = 180.0  # its imports and the CUDA check: 5-15 s expected


def fork_available() -> bool:
    """Forked children need ``os.fork`` and, so that they end with the launcher, Linux's
    ``PR_SET_PDEATHSIG``."""
    return hasattr(os, "fork") and sys.platform.startswith("linux")


def start_method(setting: str) -> str:
    """``runtime.precompile_start`` resolved: ``fork`` where asked for (``fork``, or ``auto``,
    the default) and available, else ``spawn``."""
    return "fork" if setting in ("fork", "auto") and fork_available() else "spawn"


def child_env() -> dict:
    """The environment of a child (or a launcher): this one without torchrun's variables (a
    child joins no process group), with this package importable from wherever the parent
    imported it (the run's working directory may differ), and the parent's pid."""
    import tr_hydra
    root = os.path.dirname(os.path.dirname(os.path.abspath(tr_hydra.__file__)))
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARS}
    return dict(env, PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p),
                **{PARENT_VAR: str(os.getpid())})


def _spawn(argv: list[str], log_path: str, env: dict, sent: float | None = None) -> subprocess.Popen:
    """A child as a fresh Python process, its output in ``log_path``."""
    with open(log_path, "w") as out:
        return subprocess.Popen([sys.executable, "-m", "tr_hydra.runtime.precompile", *argv, repr(sent or time.time())],
                                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)


class _Forked:
    """A child asked of a ``Launcher``, with the part of ``subprocess.Popen`` that
    ``Precompiler`` uses: ``pid`` (None until forked), ``poll``, ``wait``, ``kill``. ``start``:
    ``fork``, or ``spawn`` once the launcher has failed and the child runs as a fresh process
    instead."""

    def __init__(self, launcher: "Launcher", argv: list[str], log_path: str, sent: float):
        self._launcher = launcher
        self.argv, self.log_path, self.sent = argv, log_path, sent
        self.pid: int | None = None
        self.returncode: int | None = None
        self.start = "fork"
        self._popen: subprocess.Popen | None = None
        self._kill = False

    def _spawned(self, popen: subprocess.Popen) -> None:  # with the launcher's lock held
        self._popen, self.pid, self.start = popen, popen.pid, "spawn"

    def poll(self):
        if self._popen is not None:
            return self._popen.poll()
        return self.returncode

    def wait(self, timeout: float | None = None):
        with self._launcher._cond:
            if not self._launcher._cond.wait_for(lambda: self.returncode is not None or self._popen is not None,
                                                 timeout):
                raise subprocess.TimeoutExpired("precompile child", timeout)
        if self._popen is not None:
            return self._popen.wait(timeout)
        return self.returncode

    def kill(self) -> None:
        with self._launcher._cond:
            if self._popen is not None:
                self._popen.kill()
                return
            if self.returncode is not None:
                return
            self._kill = True
            if self.pid is not None:
                _kill(self.pid)


def _kill(pid: int) -> None:
    import signal
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


class Launcher:
    """A process that imports PyTorch, the trainer and Inductor (``LAUNCHER_PRELOAD``) once, and
    then forks one child per request, so no child imports them again. Start it early, while the
    training process builds its trainer: the import then overlaps that work. It never
    initialises CUDA itself; before it says it is ready, it forks one short child that does, to
    check that a forked child can use the GPU. Each child initialises CUDA for itself. It ends
    with the training process (and its children with it, ``PR_SET_PDEATHSIG``), or when
    ``close`` closes its input.

    If it fails (an import, the check, or it ended), it says so once through ``log`` and every
    child asked of it, before or after, starts as a fresh process instead, at once: the training
    process need not look. ``error`` says why."""

    def __init__(self, preload: tuple[str, ...] = LAUNCHER_PRELOAD, log=None,
                 ready_timeout: float = LAUNCHER_READY_TIMEOUT_S):
        """``ready_timeout``: a launcher not ready by then is stopped and counts as failed.
        ``log``: where it says so; None keeps its lines until ``adopt`` names one."""
        self._cond = threading.Condition()
        self._children: dict[int, _Forked] = {}
        self._token = 0
        self._said: list[str] = []
        self.log = self._said.append if log is None else log
        self.ready = False
        self.error = ""
        self.started = time.perf_counter()
        self.ready_s: float | None = None  # seconds from the start until it could fork
        self._env = child_env()
        self._late = ""  # why the launcher was stopped before it was ready
        self._log = tempfile.NamedTemporaryFile(prefix="tr_hydra_launcher_", suffix=".log", delete=False)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tr_hydra.runtime.precompile", "--launcher", ",".join(preload)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, env=self._env, text=True, bufsize=1)
        self._reader = threading.Thread(target=self._read, name="tr_hydra-launcher", daemon=True)
        self._reader.start()
        self._timer = threading.Timer(ready_timeout, self._not_ready, args=(ready_timeout,))
        self._timer.daemon = True
        self._timer.start()

    def _not_ready(self, timeout: float) -> None:
        with self._cond:
            if self.ready or self.error or self._closing:
                return
            self._late = f"not ready after {timeout:.0f}s"
        self.proc.kill()  # the reader then sees it end, and fails it with that reason

    def _read(self) -> None:
        for line in self.proc.stdout:
            word, _, rest = line.strip().partition(" ")
            with self._cond:
                if word == "ready":
                    self.ready = True
                    self.ready_s = time.perf_counter() - self.started
                elif word == "error":
                    self._fail(rest)
                elif word in ("started", "exit"):
                    token, value = (int(x) for x in rest.split()[:2])
                    h = self._children.get(token)
                    if h is not None and word == "started":
                        h.pid = value
                        if h._kill:
                            _kill(value)
                    elif h is not None:
                        h.returncode = value
                self._cond.notify_all()
        self.proc.wait()
        with self._cond:
            if self._closing:
                for h in self._children.values():
                    if h.returncode is None and h._popen is None:
                        h.returncode = -9
            else:
                self._fail(self._late or self._last_log_line() or f"it ended (exit status {self.proc.returncode})")
            self._cond.notify_all()
            # the children started here as fresh processes die with this thread (PR_SET_PDEATHSIG
            # follows the thread that started them): it stays until the launcher is closed
            self._cond.wait_for(lambda: self._closing)

    def _fail(self, why: str) -> None:
        """With the lock held: the launcher cannot fork (any more). Every child it has not
        forked starts as a fresh process now; one it forked has ended with it."""
        if self.error:
            return
        self.error = why
        self.ready = False
        if not self._closing:
            self.log(f"runtime.precompile_start=fork: the launcher failed ({why}); "
                     "each parallel compile starts as a fresh process")
        for h in self._children.values():
            if h.returncode is not None or h._popen is not None:
                continue
            if h.pid is not None:
                h.returncode = -9  # forked, and ended with the launcher (PR_SET_PDEATHSIG)
            elif h._kill or self._closing:
                h.returncode = -9
            else:
                try:
                    h._spawned(_spawn(h.argv, h.log_path, self._env, h.sent))
                except OSError:
                    h.returncode = 1

    _closing = False

    def _last_log_line(self) -> str:
        try:
            with open(self._log.name, errors="replace") as f:
                lines = [ln.strip() for ln in f if ln.strip()]
            return lines[-1][:200] if lines else ""
        except OSError:
            return ""

    def adopt(self, log) -> None:
        """Hand the launcher to the trainer that will use it: what it said before (one started
        with no ``log``, see ``start_early``) and what it says from now on goes to ``log``."""
        with self._cond:
            said, self._said = self._said, []
            self.log = log
        for line in said:
            log(line)

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Block until the launcher can fork (True) or has failed (False)."""
        with self._cond:
            self._cond.wait_for(lambda: self.ready or self.error, timeout)
            return self.ready and not self.error

    def start(self, argv: list[str], log_path: str) -> _Forked:
        """A child running ``_child_main(argv)`` with its output in ``log_path``. Returns at once,
        also while the launcher is still importing (the child is forked when it is ready); once
        the launcher has failed, the child is started as a fresh process."""
        with self._cond:
            self._token += 1
            h = self._children[self._token] = _Forked(self, argv, log_path, time.time())
            if self.error:
                h._spawned(_spawn(argv, log_path, self._env, h.sent))
                return h
            req = json.dumps({"token": self._token, "argv": argv, "log": log_path, "sent": h.sent})
        try:
            self.proc.stdin.write(req + "\n")
            self.proc.stdin.flush()
        except (OSError, ValueError) as e:
            with self._cond:
                self._fail(f"its input is closed ({e})")
                self._cond.notify_all()
        return h

    def close(self) -> None:
        """Kill the children still running, close the launcher's input and wait for it (it reaps
        its children first)."""
        self._timer.cancel()
        with self._cond:
            self._closing = True
            self._cond.notify_all()
            running = [h for h in self._children.values() if h.returncode is None]
            ready = self.ready
        for h in running:
            h.kill()
        if not ready:  # still importing (or failed): it has forked nothing; any child just forked ends with it
            self.proc.kill()
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._reader.join(timeout=5)
        for h in running:
            if h._popen is not None:
                h._popen.wait()
        self._log.close()
        try:
            os.remove(self._log.name)
        except OSError:
            pass


def _cuda_check() -> str:
    """In the launcher, after its imports: fork a child that initialises CUDA and allocates on the
    GPU, as a compile's child will. "" if it could (or there is no GPU here), else why not. The
    launcher itself never initialises CUDA: after that, no forked child could."""
    import torch
    if not torch.cuda.is_available():  # NVML's count: the driver is not initialised
        return ""
    r, w = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        rc = 1
        try:
            torch.empty(1, device="cuda").add_(1)
            torch.cuda.synchronize()
            rc = 0
        except BaseException as e:  # noqa: BLE001 - reported to the launcher
            os.write(w, f"{type(e).__name__}: {e}".replace("\n", " ")[:200].encode())
        finally:
            os._exit(rc)
    os.close(w)
    rc, why = _wait_exit(pid, r, CUDA_CHECK_TIMEOUT_S)
    if rc is None:
        return f"a forked child did not finish initialising CUDA in {CUDA_CHECK_TIMEOUT_S:.0f}s"
    if rc != 0:
        return "a forked child could not use CUDA: " + (why or f"exit status {rc}")
    return ""


CUDA_CHECK_TIMEOUT_S = 60.0


def _wait_exit(pid: int, fd: int, timeout: float) -> tuple[int | None, str]:
    """Wait for child ``pid`` to end, reading what it writes to ``fd`` (closed here): its exit
    status and text, or (None, text) if it is still running after ``timeout`` s (it is killed)."""
    import select
    chunks, rc, open_ = [], None, True
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if open_ and select.select([fd], [], [], 0.05)[0]:
                chunk = os.read(fd, 4096)
                open_ = bool(chunk)
                chunks.append(chunk)
            elif not open_:
                time.sleep(0.01)
            if rc is None:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    rc = os.waitstatus_to_exitcode(status)
            if rc is not None and not open_:
                break
        if rc is None:
            _kill(pid)
            os.waitpid(pid, 0)
    finally:
        os.close(fd)
    return rc, b"".join(chunks).decode(errors="replace")


def _launcher_main(preload: list[str]) -> int:
    """The launcher's loop: import, say ``ready``, then fork a child per request line (JSON:
    token, argv, log, sent), answering ``started TOKEN PID`` and, when it ends,
    ``exit TOKEN STATUS``. At the end of its input it kills the children left and reaps them."""
    import importlib
    import select
    if not die_with_parent():
        return 1
    nvml_check = os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK")
    os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"  # torch.cuda.is_available() without the driver
    try:
        for name in preload:
            importlib.import_module(name)
    except Exception as e:  # noqa: BLE001 - reported; the precompiler starts fresh processes instead
        print(f"error importing {name}: {type(e).__name__}: {e}".replace("\n", " ")[:300], flush=True)
        return 1
    why = _cuda_check()
    if why:
        print(f"error {why}", flush=True)
        return 1
    if nvml_check is None:  # the children: PyTorch's own check, as in a fresh process
        os.environ.pop("PYTORCH_NVML_BASED_CUDA_CHECK", None)
    else:
        os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = nvml_check
    print("ready", flush=True)
    running: dict[int, int] = {}  # pid -> token
    fd = sys.stdin.fileno()
    buf, eof = b"", False
    while not eof or running:
        if not eof:
            r, _, _ = select.select([fd], [], [], 0.05)
            if r:
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    eof = True
                    for pid in running:  # the precompiler is done with them
                        _kill(pid)
                buf += chunk
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    req = json.loads(line)
                    pid = _fork_child(req)
                    running[pid] = req["token"]
                    print(f"started {req['token']} {pid}", flush=True)
        else:
            time.sleep(0.05)
        while running:
            try:
                pid, status = os.waitpid(-1, 0 if eof else os.WNOHANG)
            except ChildProcessError:
                running.clear()
                break
            if pid == 0:
                break
            token = running.pop(pid, None)
            if token is not None:
                print(f"exit {token} {os.waitstatus_to_exitcode(status)}", flush=True)
    return 0


def _fork_child(req: dict) -> int:
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return pid
    rc = 1
    try:
        out = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.close(out)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        os.environ[PARENT_VAR] = str(os.getppid())  # the launcher: the child ends with it
        rc = _child_main(list(req["argv"]), sent=req.get("sent"))
    except BaseException:  # noqa: BLE001 - a child reports its error in its log, as a fresh process would
        import traceback
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(rc)


def launcher_wanted(pc, device_type: str, cpus: int, caches: bool | None = None) -> bool:
    """Whether a trainer starts a ``Launcher`` as it begins: its capture will run parallel
    compiles (CUDA, captured graphs, Inductor, ``runtime.precompile`` wanting children for the
    variants) and they are to be forked. Free device memory, checked at the capture, may still
    leave no room for a child; the launcher is then closed unused. ``caches``: whether
    Inductor's caches are on (``caches_enabled()`` where None)."""
    rt = pc.runtime
    if device_type != "cuda" or not rt.cuda_graph or rt.compile not in ("auto", "inductor"):
        return False
    if start_method(rt.precompile_start) != "fork":
        return False
    if requested_workers(rt.precompile, len(pc.variants), pc.world_size, cpus, rt.precompile_first) == 0:
        return False
    return caches_enabled() if caches is None else caches


EARLY_ENV = "TR_HYDRA_EARLY_LAUNCHER"  # "off": a trainer starts its launcher itself, as it begins
_EARLY: Launcher | None = None  # started by a command-line tool before PyTorch's import


def gpu_visible(environ=None) -> bool:
    """Whether this host shows this process an NVIDIA GPU, told without importing PyTorch: the
    driver's control node exists and ``CUDA_VISIBLE_DEVICES`` does not hide every device."""
    environ = os.environ if environ is None else environ
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return False
    return os.path.exists("/dev/nvidiactl")


def early_launcher_wanted(pc, cpus: int, environ=None, gpu: bool | None = None) -> bool:
    """Whether a command-line tool starts the launcher before it imports PyTorch
    (``start_early``): ``launcher_wanted``, with the device and Inductor's cache told from the
    config and the environment (``gpu``: ``gpu_visible()`` where None). The trainer checks
    again with PyTorch and closes a launcher it does not want."""
    environ = os.environ if environ is None else environ
    if environ.get(EARLY_ENV, "").strip().lower() in ("off", "0", "false", "no"):
        return False
    gpu = gpu_visible(environ) if gpu is None else gpu
    device = "cuda" if pc.runtime.device != "cpu" and gpu else "cpu"
    return launcher_wanted(pc, device, cpus, caches=environ.get("TORCHINDUCTOR_FX_GRAPH_CACHE", "1") != "0")


def start_early(pc, cpus: int | None = None, before_torch: bool = True) -> bool:
    """Start the launcher of ``pc``'s trainer now, before this process imports PyTorch
    (``before_torch``: only if it has not yet), so that the launcher's imports overlap this
    process's own as well as the trainer's build, and the children fork as soon as they are
    asked for (the trainer takes it: ``take_early``). Whether one started. It ends with this
    process if no trainer takes it."""
    global _EARLY
    if _EARLY is not None or (before_torch and "torch" in sys.modules):
        return False
    cpus = cpus or (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1))
    if not early_launcher_wanted(pc, cpus):
        return False
    try:
        _EARLY = Launcher()
    except OSError:  # the trainer tries again, and says why if it cannot either
        return False
    atexit.register(close_early)
    return True


def take_early() -> Launcher | None:
    """The launcher ``start_early`` started, for the trainer to use or close; None if none."""
    global _EARLY
    launcher, _EARLY = _EARLY, None
    return launcher


def close_early() -> None:
    launcher = take_early()
    if launcher is not None:
        launcher.close()


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
    backward: bool = False  # a backward twin: compiles only the variant's backward (split_compile)
    lock: str = ""  # the twin's lock file: held by the twin, waited on by the whole variant's compile
    saved: str = ""  # where the child saves its variant's forward compiled whole (runtime.precompile_saved)
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
                 also: dict[str, list[str]] | None = None, launcher: Launcher | None = None,
                 twins: tuple[str, ...] = (), saved: bool = False, share_training: bool = True):
        """``also``: for a variant, others of the same split that its child steps after it
        (``runtime.dynamic_batch``: they share its graph, or, where Dynamo's guards do not
        admit their batch size, compile their own in the child rather than here).
        ``launcher``: fork the children from it (it is closed with the precompiler; one that
        fails starts them as fresh processes itself); None: each child is a fresh process.
        ``twins``: training variants whose backward a twin compiles beside the whole variant's
        compile (``runtime.precompile_backward``, see ``split_compile``): a child's variant, or
        the main process's own first one (``twin_lock`` gives its lock). The twins start first
        and are not counted in ``workers``. ``saved``: each child of one variant compiles its
        forward whole and saves it (``runtime.precompile_saved``, see ``saved_compile``), for
        ``saved_forward`` to hand to the main process. ``share_training``: where no child
        compiles a validation variant, whether the training variants' children share the main
        process's cuDNN search (see ``_sharers``)."""
        self.log = log
        self.share_training = share_training
        self.device_index = device_index
        self.workers = workers
        self._tmp = tempfile.TemporaryDirectory(prefix="tr_hydra_precompile_")
        self.twins = [_Child(n, True, backward=True, lock=os.path.join(self._tmp.name, f"{n}.backward.lock"))
                      for n in dict.fromkeys(twins)]
        for t in self.twins:
            open(t.lock, "w").close()  # empty until the twin holds it: nothing to wait for yet
        locks = {t.name: t.lock for t in self.twins}
        self.children = [_Child(n, t, tuple((also or {}).get(n, ())), lock=locks.get(n, "") if t else "")
                         for n, t in variants]
        if saved:
            for c in self.children:
                if not c.also and not c.lock:  # one static graph, compiled whole in the child
                    c.saved = os.path.join(self._tmp.name, f"{c.name}.forward")
        self._pc_path = os.path.join(self._tmp.name, "plan.pkl")
        with open(self._pc_path, "wb") as f:
            pickle.dump(pc, f)
        self._env = child_env()
        self.launcher = launcher
        self._queue = list(self.children)
        for t in self.twins:
            self._start(t)
        self._fill()

    def saved_forward(self, name: str) -> str | None:
        """The file holding ``name``'s forward compiled whole by its child, once that child is
        done and wrote it; else None (no child, a failed one, or the child could not save it)."""
        c = next((c for c in self.children if c.name == name), None)
        if c is None or not c.saved or not c.ok or not os.path.exists(c.saved):
            return None
        return c.saved

    def twin_lock(self, name: str) -> str | None:
        """The lock of ``name``'s backward twin, or None where it has none."""
        return next((t.lock for t in self.twins if t.name == name), None)

    def _start(self, c: _Child) -> bool:
        c.log_path = os.path.join(self._tmp.name, f"{c.name}{'.backward' if c.backward else ''}.log")
        argv = [self._pc_path, ",".join((c.name,) + c.also), "train" if c.train else "val", str(self.device_index)]
        if c.backward:
            argv.append(f"{BACKWARD_FLAG}{c.lock}")
        else:
            if c.lock:
                argv.append(f"{TWIN_FLAG}{c.lock}")
            if c.saved:
                argv.append(f"{SAVE_FLAG}{c.saved}")
            sharers = self._sharers()
            if c in sharers:
                argv.append(f"{SHARE_FLAG}{sharers.index(c)}/{len(sharers)}")
        try:
            c.proc = (self.launcher.start(argv, c.log_path) if self.launcher is not None
                      else _spawn(argv, c.log_path, self._env))
        except OSError as e:  # no process to be had: this variant compiles in the main process
            c.ok = False
            self.log(f"  {c.name}: could not start a backward twin ({e.strerror}); the variant's compile does "
                     f"its backward" if c.backward else
                     f"  {c.name}: could not start a parallel compile ({e.strerror}); compiling it here")
            return False
        c.started = time.perf_counter()
        c.started_wall = time.time()
        return True

    def _fill(self) -> None:
        running = sum(1 for c in self.children if c.proc is not None and c.ok is None)
        while self._queue and running < self.workers:
            if self._start(self._queue.pop(0)):
                running += 1

    def _sharers(self) -> list[_Child]:
        """The children that run a share of the main process's cuDNN search beside their compile
        (see ``cudnn_prime``): the validation variants', whose compile (a forward only) ends in
        about half the time of a training variant's, so their share delays no variant; where
        there are none, every child (none without ``share_training``). (Measured with every
        child sharing, on the H200's cold six-variant mix: the main process waited 3.3-4.0 s
        for the search instead of 15.9 s, but the training children, the last to finish, took
        5 s longer.)"""
        val = [c for c in self.children if not c.train]
        return val or (self.children if self.share_training else [])

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
        if c.backward:
            self.log(f"  {c.name}: backward compiled in a twin process in {c.seconds:.0f}s" if c.ok else
                     f"  {c.name}: backward twin failed ({last.strip()[:160]}); the variant's compile does its backward")
        elif c.ok:
            self.log(f"  {c.name}: compiled in a parallel process in {c.seconds:.0f}s")
        else:
            self.log(f"  {c.name}: parallel compile failed ({last.strip()[:160]}); compiling it here")
        return True

    def _reap_all(self) -> None:
        for c in self.children + self.twins:
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
        n = sum(1 for c in list(self.children) + list(self.twins)
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
        for c in self.children + self.twins:
            if c.proc is not None and c.ok is None and c.proc.poll() is None:
                c.proc.kill()
                c.proc.wait()
        self._queue = []
        self._tmp.cleanup()

    def summary(self) -> dict:
        """Each child's outcome, time and counters, by variant; a backward twin's as
        ``"<variant> backward"``."""
        self._reap_all()
        return {c.name + (" backward" if c.backward else ""):
                {"ok": c.ok, "seconds": round(c.seconds, 1),
                 **({"start": getattr(c.proc, "start", "spawn")} if c.proc is not None else {}), **c.counters}
                for c in self.children + self.twins}


# Dynamo's and Inductor's own phase timers, summed over the child's compiles: where its time goes
PHASES = (("trace", "bytecode_tracing"), ("aot", "create_aot_dispatcher_function"),
          ("inductor", "compile_fx_inner"), ("triton_wait", "async_compile.wait"),
          ("autotune", "CachingAutotuner.benchmark_all_configs"))


def phase_seconds() -> dict:
    try:
        from torch._dynamo.utils import compilation_time_metrics as m
    except ImportError:
        return {}
    return {short: round(sum(m[key]), 2) for short, key in PHASES if m.get(key)}


def _timers(least: float = 0.1, most: int = 30) -> dict:
    """Every one of Dynamo's and Inductor's phase timers that took ``least`` seconds or more in
    this process (summed over its compiles; nested timers overlap), longest first: what
    ``PHASES`` does not name, for finding where a compile's time goes."""
    try:
        from torch._dynamo.utils import compilation_time_metrics as m
    except ImportError:
        return {}
    tot = sorted(((round(sum(v), 2), k) for k, v in m.items() if v and sum(v) >= least), reverse=True)
    return {k: t for t, k in tot[:most]}


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


def _share_search(tr, share: tuple[int, int] | None):
    """This child's share ``(k, n)`` of the convolutions the main process will search (every
    variant's, as it records them), on a thread until the child's compile ends
    (``cudnn_prime.ShareBeforeRun``), or None: no share given, no search in the main process
    (``runtime.prime_cudnn`` off, not CUDA, deterministic), the driver's cache off, or no
    compile-end callback in this PyTorch."""
    from tr_hydra.runtime import cudnn_prime
    if share is None or tr.device.type != "cuda" or not cudnn_prime.jit_cache_shared() \
            or not cudnn_prime.can_search_ahead():
        return None
    calls = tr._prime_calls()
    mine = cudnn_prime.share_of(calls, *share) if calls else []
    if not mine:
        return None
    import torch
    return cudnn_prime.ShareBeforeRun(mine, tr.device,
                                      after=lambda: setattr(torch.backends.cudnn, "benchmark", False))


def _child_main(argv: list[str], sent: float | None = None) -> int:
    """One variant's step, once, in a fresh process or one forked by a launcher (or several
    variants', comma-separated, one after another): the compiles land in the shared caches.
    ``sent`` (or a fifth argument): when the precompiler asked for the child (``time.time()``),
    so that it reports how long it took to start."""
    t_start = time.time()
    if not die_with_parent():
        print("the process that started this compile has ended; nothing to do", flush=True)
        return 1
    share = None  # (k, n): this child's share of the main process's cuDNN search
    for a in [a for a in argv if a.startswith(SHARE_FLAG)]:
        argv.remove(a)
        k, n = a[len(SHARE_FLAG):].split("/")
        share = (int(k), int(n))
    backward_lock = twin_lock = save_to = None  # a backward twin / waits for one / saves its compile
    for a in [a for a in argv if a.startswith((BACKWARD_FLAG, TWIN_FLAG, SAVE_FLAG))]:
        argv.remove(a)
        if a.startswith(BACKWARD_FLAG):
            backward_lock = a[len(BACKWARD_FLAG):]
        elif a.startswith(SAVE_FLAG):
            save_to = a[len(SAVE_FLAG):]
        else:
            twin_lock = a[len(TWIN_FLAG):]
    from tr_hydra.runtime import split_compile
    if backward_lock:
        split_compile.hold(backward_lock)  # until this process ends
    if len(argv) == 5:
        sent = float(argv.pop())
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
        tr = Trainer(pc, run_dir, log=lambda *_: None, telemetry=False, source=False, launcher=False)
        t_trainer = time.perf_counter()  # with the CUDA context
        # cuDNN's algorithm search is the main process's to do (it times on the shared GPU); the
        # compiled code does not depend on it (cudnn.benchmark is not in Inductor's cache key).
        # Beside the compile, a share of that search runs here only to have the driver compile
        # cuDNN's kernels into its shared cache; it ends before the compiled code runs
        job = _share_search(tr, share) if backward_lock is None else None
        if job is None:
            torch.backends.cudnn.benchmark = False
        waited: list[float] = []
        skipped = None
        if save_to:
            from tr_hydra.runtime.saved_compile import Recorder
            tr.ex.recorder = Recorder({names.split(",")[0]: save_to}, tr.ex.compile_options,
                                      on_compiled=job.close if job is not None else None)
        from tr_hydra.runtime import compile_gc
        try:
            # runtime.compile_gc: Python's full collections deferred while the step compiles
            with compile_gc.during_compiles(pc.runtime.compile_gc):
                if backward_lock:  # the first variant's backward only: its forward is never run
                    with split_compile.backward_only():
                        try:
                            tr.ex.train_step(names.split(",")[0], "A")
                            skipped = False
                        except split_compile.ForwardSkipped:
                            skipped = True
                else:
                    with (split_compile.waits_for_twin(twin_lock, waited) if twin_lock else contextlib.nullcontext()):
                        for name in names.split(","):
                            if split == "train":
                                tr.ex.train_step(name, "A")
                            else:
                                tr.model.eval()
                                with tr.ex.folded():
                                    tr.ex.val_step(name, "A")
        finally:
            rep = job.close() if job is not None else None
        if tr.device.type == "cuda":
            torch.cuda.synchronize(tr.device)
    t_end = time.perf_counter()
    shared = None
    if job is not None:
        shared = {"calls": rep.calls if rep else 0, "of": job.calls, "seconds": round(rep.seconds, 2) if rep else 0.0,
                  **({"error": job.error} if job.error else {})}
    out = dict(_counters(), variants=names.split(","), start_s=round(max(0.0, t_start - sent), 2) if sent else None,
               import_s=round(t_import - t0, 2), trainer_s=round(t_trainer - t_import, 2),
               step_s=round(t_end - t_trainer, 2), phases_s=phase_seconds(), timers_s=_timers(), cudnn_share=shared,
               gc=compile_gc.report(),
               **({"forward_skipped": skipped} if backward_lock else {}),
               **({"twin_wait_s": round(sum(waited), 2)} if twin_lock else {}),
               **(tr.ex.recorder.report() if save_to else {}), done_at=time.time())
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--launcher"]:
        sys.exit(_launcher_main([m for m in sys.argv[2].split(",") if m] if len(sys.argv) > 2 else list(LAUNCHER_PRELOAD)))
    sys.exit(_child_main(sys.argv[1:]))
