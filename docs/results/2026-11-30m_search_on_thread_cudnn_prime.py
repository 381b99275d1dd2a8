# What was added to tr_hydra/runtime/cudnn_prime.py for the search on a thread (not kept; see
# docs/benchmarks.md, session m). PrimeReport also had `beside_compile: bool` and `waited: float`.
# The runner's side is 2026-11-30m_search_on_thread_runner.diff.
import threading
import time

import torch

from tr_hydra.runtime.cudnn_prime import ConvCall, PrimeReport, prime


def _end_callbacks():
    """Dynamo's compile-end callback registry (register, remove), or None in a PyTorch without it."""
    try:
        from torch._dynamo.callback import callback_handler as h
    except ImportError:
        return None
    reg, rem = getattr(h, "register_end_callback", None), getattr(h, "remove_end_callback", None)
    return (reg, rem) if reg and rem else None


def can_run_beside_compile() -> bool:
    return _end_callbacks() is not None


class BackgroundPrime:
    """``prime(calls, device)`` on a thread, on ``stream``: started now; joined when Dynamo
    finishes its next compile (its end callback runs after the backend has compiled the graph
    and before the compiled code runs), or at ``close()``. ``close()`` returns the report and
    raises what the search raised (an out-of-memory error, say)."""

    def __init__(self, calls: list[ConvCall], device: torch.device, stream=None):
        reg_rem = _end_callbacks()
        if reg_rem is None:
            raise RuntimeError("this PyTorch has no Dynamo compile-end callback")
        self._reg, self._rem = reg_rem
        self.report: PrimeReport | None = None
        self._error: BaseException | None = None
        self._waited = 0.0
        self._lock = threading.Lock()

        def run():
            try:
                if stream is not None:
                    with torch.cuda.stream(stream):
                        self.report = prime(calls, device)
                else:
                    self.report = prime(calls, device)
            except BaseException as e:  # noqa: BLE001 - handed to the main thread at close()
                self._error = e
        self._thread = threading.Thread(target=run, name="tr_hydra-prime-cudnn", daemon=True)
        self._cb = self._reg(self._on_compile_end)
        self._thread.start()

    def _on_compile_end(self, *_args) -> None:
        self.join()  # never raises inside Dynamo: the error waits for close()

    def join(self) -> None:
        with self._lock:
            if self._thread.is_alive():
                t = time.perf_counter()
                self._thread.join()
                self._waited += time.perf_counter() - t

    def close(self) -> PrimeReport | None:
        self.join()
        try:
            self._rem(self._cb)
        except ValueError:  # already gone
            pass
        if self._error is not None:
            e, self._error = self._error, None
            raise e
        if self.report is not None:
            self.report.beside_compile = True
            self.report.waited = self._waited
        return self.report
