"""A line every so often while a long, silent wait goes on: the warm-up before the first step,
where the first variant's compile alone takes most of a minute (minutes with
``coordinate_descent_tuning``), and where nothing else is printed until the graphs are captured.
The thread only prints; it makes no CUDA call, so it can run beside a compile and is stopped
before any capture."""
from __future__ import annotations

import os
import threading
import time

EVERY_S = 30.0  # seconds between lines


class Heartbeat:
    """``now(what)`` starts timing ``what`` (e.g. "warming up train_base"); while it lasts,
    every ``every`` seconds the thread logs ``  still <what> after <n>s`` and, if ``extra``
    gives one, a note after it (``; 3 parallel compiles running``). ``now(None)`` or leaving
    the ``with`` block stops the lines; the thread is joined on leaving."""

    def __init__(self, log, every: float | None = None, extra=None, clock=time.monotonic,
                 poll: float | None = None):
        self.log, self.every = log, EVERY_S if every is None else every
        self.extra, self.clock = extra, clock
        self.poll = min(1.0, self.every) if poll is None else poll  # how often the thread looks
        self._lock = threading.Lock()
        self._what: str | None = None
        self._since = self._next = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.lines = 0  # how many were logged

    def now(self, what: str | None) -> None:
        with self._lock:
            self._what = what
            self._since = self.clock()
            self._next = self._since + self.every

    def __enter__(self) -> "Heartbeat":
        """Starts the thread (again, after a close: one wait after another)."""
        self._stop = threading.Event()
        if self.every > 0:
            self._thread = threading.Thread(target=self._run, name="tr_hydra-heartbeat", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.now(None)
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def _line(self) -> str | None:
        with self._lock:
            t = self.clock()
            if self._what is None or t < self._next:
                return None
            self._next = t + self.every
            line = f"  still {self._what} after {t - self._since:.0f}s"
        note = None
        if self.extra is not None:
            try:
                note = self.extra()
            except Exception:  # noqa: BLE001 - a progress note must never break the wait it reports
                note = None
        return f"{line}; {note}" if note else line

    def _run(self) -> None:
        stop = self._stop  # this thread's: a later __enter__ makes a new one
        while not stop.wait(self.poll):
            line = self._line()
            if line is not None:
                self.lines += 1
                self.log(line)


def process_age_s(stat_path: str = "/proc/self/stat", uptime_path: str = "/proc/uptime") -> float | None:
    """Seconds since this process started (Linux's ``/proc``: its start time in clock ticks after
    boot, against the host's uptime; to 10 ms), or None where they cannot be read."""
    try:
        with open(stat_path) as f:
            stat = f.read()
        with open(uptime_path) as f:
            up = float(f.read().split()[0])
        start = int(stat.rsplit(")", 1)[1].split()[19])  # field 22, starttime; the name may hold spaces
        return max(0.0, up - start / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError, AttributeError):
        return None
