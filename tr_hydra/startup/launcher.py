"""The launcher of the parallel compiles: a process that imports PyTorch, tr_hydra and
Inductor once, while the training process builds its runtime, then forks one child per variant
to compile, so no child imports them again (several seconds each with five starting
together). Where forking is not available (not Linux) or the launcher fails, each child starts
as a fresh Python process instead (``python -m tr_hydra.startup.child``).

Standard library only at import: the launcher's own process imports what it preloads itself."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time

from tr_hydra.internals import PRELOAD

PARENT_VAR = "TR_HYDRA_PRECOMPILE_PARENT"  # the pid of the process that started a child
PR_SET_PDEATHSIG = 1  # linux/prctl.h
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
                 "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT")
CHILD_MODULE = "tr_hydra.startup.child"  # ``python -m`` it: a child, or with --launcher, a launcher

# what a launcher imports before it forks: PyTorch, what a child imports (the runtime, its
# compile timers, the whole compile), and the parts of Dynamo, AOTAutograd and Inductor that a
# first compile would otherwise import lazily
LAUNCHER_PRELOAD = ("torch", "tr_hydra.runtime.build", "tr_hydra.runtime.graphs",
                    "tr_hydra.internals.saved_compile") + PRELOAD

LAUNCHER_READY_TIMEOUT_S = 180.0  # its imports and the CUDA check: 5-15 s expected


def fork_available() -> bool:
    """Forked children need ``os.fork`` and, so that they end with the launcher, Linux's
    ``PR_SET_PDEATHSIG``."""
    return hasattr(os, "fork") and sys.platform.startswith("linux")



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
        return subprocess.Popen([sys.executable, "-m", CHILD_MODULE, *argv, repr(sent or time.time())],
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
    """A process that imports PyTorch, tr_hydra and Inductor (``LAUNCHER_PRELOAD``) once, and
    then forks one child per request, so no child imports them again. Start it early, while the
    training process builds its runtime: the import then overlaps that work. It never
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
        ``log``: where it says so."""
        self._cond = threading.Condition()
        self._children: dict[int, _Forked] = {}
        self._token = 0
        self.log = log or (lambda *_: None)
        self.ready = False
        self.error = ""
        self.started = time.perf_counter()
        self.ready_s: float | None = None  # seconds from the start until it could fork
        self._env = child_env()
        self._late = ""  # why the launcher was stopped before it was ready
        self._log = tempfile.NamedTemporaryFile(prefix="tr_hydra_launcher_", suffix=".log", delete=False)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", CHILD_MODULE, "--launcher", ",".join(preload)],
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
            self.log(f"parallel compiles: the launcher failed ({why}); "
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

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Block until the launcher can fork (True) or has failed (False)."""
        with self._cond:
            self._cond.wait_for(lambda: self.ready or self.error, timeout)
            return self.ready and not self.error

    def start(self, argv: list[str], log_path: str) -> _Forked:
        """A child running ``child.main(argv)`` with its output in ``log_path``. Returns at once,
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


def _launcher_main(preload: list[str], child_main) -> int:
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
                    pid = _fork_child(req, child_main)
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


def _fork_child(req: dict, child_main) -> int:
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
        rc = child_main(list(req["argv"]), sent=req.get("sent"))
    except BaseException:  # noqa: BLE001 - a child reports its error in its log, as a fresh process would
        import traceback
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(rc)



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


