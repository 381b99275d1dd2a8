"""Guards that turn faults into clear stops instead of lost work: device memory checked before
the arena exists, preemption signals turned into a checkpoint, non-finite values named."""
from __future__ import annotations

import signal
from dataclasses import dataclass

from tr_hydra.errors import TrHydraError

GiB = 2**30
HEADROOM = 1.10  # cuDNN workspaces, the CUDA context, allocator rounding


class MemoryPlanError(TrHydraError):
    pass


def input_bytes_per_sample(compiled) -> int:
    t = compiled.plan["input_A.data"]
    _, h, w, _ = t.shape
    return 2 * h * w * t.strides[2] * t.dtype.itemsize  # A and B buffers


def check_memory(compiled, free_bytes: int, device: str = "cuda") -> None:
    """Refuse, before allocating, a plan whose predicted need exceeds free device memory, naming
    the figures and the largest batch that fits."""
    pc = compiled.config
    arena, grads, lib = compiled.plan.total_bytes, compiled.gradient_transient, compiled.library_workspace
    if int((compiled.fixed_need + compiled.activation_bound) * HEADROOM) <= free_bytes:
        return  # it fits even by eager autograd's count: no trace of Inductor's partition needed
    act = compiled.activation_estimate
    need = int(compiled.predicted_need * HEADROOM)
    if need <= free_bytes:
        return
    batch = pc.batch_size
    per_sample = (act / max(batch, 1) + input_bytes_per_sample(compiled)) * HEADROOM
    fixed = need - per_sample * batch
    fits = int((free_bytes - fixed) // per_sample) if free_bytes > fixed else 0
    advice = (f"the largest batch that fits is about {fits} (variants.batch_size={fits})" if fits >= 1
              else "even batch 1 does not fit: use a smaller model or resolution"
              + ("" if pc.amp else ", or amp=true"))
    raise MemoryPlanError(
        f"variants.batch_size={batch}: the plan needs about {need / GiB:.2f} GiB on {device} "
        f"(arena {arena / GiB:.2f} GiB + activations {act / GiB:.2f} GiB + gradients before their copy "
        f"{grads / GiB:.2f} GiB + BLAS workspaces {lib / GiB:.2f} GiB + 10% headroom) but only "
        f"{free_bytes / GiB:.2f} GiB are free; {advice}")


def capture_oom_message(compiled, free_bytes: int, device: str) -> str:
    try:
        check_memory(compiled, 0 if free_bytes is None else free_bytes, device)
    except MemoryPlanError as e:
        return "out of memory while capturing the step: " + str(e)
    return "out of memory while capturing the step (the plan's estimate said it fits: lower variants.batch_size)"


@dataclass
class StopRequest:
    signal_name: str | None = None

    @property
    def requested(self) -> bool:
        return self.signal_name is not None


class PreemptionGuard:
    """SIGTERM / SIGINT set a flag; the loop checks it after each step, writes a checkpoint and
    stops cleanly. A second signal is left to the default handler (a hard stop)."""

    def __init__(self):
        self.stop = StopRequest()
        self._old = {}

    def __enter__(self):
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                self._old[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread: no signal handling there
                pass
        return self

    def _handle(self, signum, frame):
        self.stop.signal_name = signal.Signals(signum).name
        signal.signal(signum, self._old.get(signum, signal.SIG_DFL))

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)
        return False


class NonFiniteError(TrHydraError):
    pass
