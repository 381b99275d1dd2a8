"""Whole-step CUDA graphs: one per (variant, input buffer), all in one memory pool, so the
activation memory is the max over variants, not the sum."""
from __future__ import annotations

import time

import torch

from tr_hydra.internals.dynamo import compile_counts, compile_work_since, phase_seconds, phase_seconds_since
from tr_hydra.runtime.executor import BUFFERS, StepExecutor


_CAPTURE_STREAMS: dict[int, torch.cuda.Stream] = {}

def capture_stream(device: torch.device) -> torch.cuda.Stream:
    """The one stream per device on which every warm-up and capture of this process runs.
    cuBLAS keeps a workspace per stream (tens of MiB) for the life of the process, so
    trainers built one after another (a sweep's jobs, tr-bench's modes) share one set instead
    of adding one each."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _CAPTURE_STREAMS:
        _CAPTURE_STREAMS[index] = torch.cuda.Stream(device=index)
    return _CAPTURE_STREAMS[index]


def own_blas_workspaces() -> None:
    """Let the capture that follows allocate its BLAS workspaces inside the graphs' pool.

    cuBLAS and cuBLASLt keep a workspace per (handle, stream), allocated at the stream's first
    matrix product: here in the warm-up, from the ordinary allocator, outside the pool. A graph
    captured with it writes into those bytes at every replay, yet the graph does not own them:
    whoever clears the workspaces (``torch.compile(mode="reduce-overhead")`` does at each warm-up
    and recording of its CUDA graph trees) hands them back to the allocator, the next tensor
    lands there, and the replays corrupt it (an illegal address, or a segmentation fault
    in the trees' next replay). Cleared here, the capture allocates the workspaces inside the
    pool: bytes the graphs hold for as long as they live, whoever clears them later. The warm-up's
    set goes back to the allocator's cache, so the peak does not move. The CUDA graph trees do
    the same for theirs."""
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()


class CudaGraphs:
    def __init__(self, executor: StepExecutor):
        self.ex = executor
        self.pool = torch.cuda.graph_pool_handle()
        # warm-up and capture on one stream (per device, shared by every trainer of the
        # process): a second stream would hold a second cuBLAS workspace set for good
        self.stream = capture_stream(executor.device)
        self.train: dict[tuple[str, str], torch.cuda.CUDAGraph] = {}
        self.val: dict[tuple[str, str], torch.cuda.CUDAGraph] = {}
        self.capture_seconds = 0.0  # warm-up and capture, all variants
        self.graph_seconds = 0.0  # of it, capturing the graphs
        self.warmup_seconds: dict[str, float] = {}  # per variant: waiting for its compile, then warm-up
        self.warmup_work: dict[str, dict[str, int]] = {}  # per variant: compile_work_since, over its warm-up
        self.warmup_phases: dict[str, dict[str, float]] = {}  # per variant: phase_seconds_since (compiler timers), over its warm-up
        self.peak_after_warmup = 0  # the process's peak allocated bytes once warm-up is done

    def capture(self, train_variants: list[str], val_variants: list[str], warmup_steps: int,
                before_variant=None, next_variant=None, before_capture=None) -> None:
        """Warm up eagerly on a side stream (cuDNN autotuning, lazy init, Inductor compiles), then
        capture. Warm-up changes weights and statistics, so the arena is restored afterwards; the
        random numbers it draws (dropout, stochastic depth) are put back by ``startup.get_ready``
        around the whole start-up (``runtime.rng``).
        ``before_variant(name)`` runs before a variant's first warm-up step (the parallel
        precompiler waits there for that variant's compile). ``next_variant(names)`` picks which
        of the variants not yet warmed up goes next (the precompiler: one whose compile is done);
        without it, training variants first, in order, then validation ones. ``before_capture()``
        runs once every variant is warmed up, before the first graph is captured (a capture must
        see no other thread's device work: the cuDNN search's thread is ended there)."""
        ready = before_variant or (lambda _name: None)
        pick = next_variant or (lambda names: names[0])
        t0 = time.perf_counter()
        ex, model = self.ex, self.ex.model
        # host copy: a device copy would add the arena's size to the peak memory
        snapshot = ex.arena.arena.to("cpu", copy=True)
        side = self.stream
        side.wait_stream(torch.cuda.current_stream())
        todo = list(train_variants) + list(val_variants)
        with torch.cuda.stream(side):
            while todo:
                t = time.perf_counter()
                v = pick(list(todo))
                todo.remove(v)
                ready(v)
                work, phases = compile_counts(), phase_seconds()
                if v in train_variants:
                    for _ in range(max(warmup_steps, 1)):
                        ex.train_step(v, "A")
                else:
                    model.eval()
                    try:
                        with ex.folded():
                            ex.val_step(v, "A")
                    finally:
                        model.train()
                side.synchronize()
                self.warmup_seconds[v] = time.perf_counter() - t
                self.warmup_work[v] = compile_work_since(work)
                self.warmup_phases[v] = phase_seconds_since(phases)
        torch.cuda.current_stream().wait_stream(side)
        if before_capture is not None:
            before_capture()
        torch.cuda.synchronize()
        # where the peak comes from: warm-up (eager side stream, autotuning) or the capture
        self.peak_after_warmup = torch.cuda.max_memory_allocated()
        t = time.perf_counter()
        own_blas_workspaces()
        self._capture_each(train_variants, ex.train_step, self.train)
        model.eval()
        with ex.folded():
            self._capture_each(val_variants, ex.val_step, self.val)
        model.train()
        torch.cuda.synchronize()
        self.graph_seconds = time.perf_counter() - t
        ex.arena.arena.copy_(snapshot)
        del snapshot
        torch.cuda.synchronize()
        self.capture_seconds = time.perf_counter() - t0

    def _capture_each(self, variants: list[str], step, into: dict) -> None:
        for v in variants:
            for buf in BUFFERS:
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=self.pool, stream=self.stream):
                    step(v, buf)
                into[(v, buf)] = g

    def train_step(self, variant: str, buffer: str) -> None:
        self.train[(variant, buffer)].replay()

    def val_step(self, variant: str, buffer: str) -> None:
        self.val[(variant, buffer)].replay()

    def release(self) -> None:
        """Destroy every captured graph once the device is done with them. A graph that recorded
        an NCCL collective holds a reference on the communicator, and destroying the process
        group waits for those references: without this, a ddp run hangs at exit."""
        torch.cuda.synchronize(self.ex.device)
        for g in (*self.train.values(), *self.val.values()):
            g.reset()
        self.train.clear()
        self.val.clear()
