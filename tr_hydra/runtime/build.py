"""Runtime: everything one process needs to run a plan's steps, built once: the device (and
process group), the compiled plan, the model bound to its arena, the executor with the model's
compiled forward, the A/B feeder and the data source. ``startup`` gets its variants compiled and
captured; ``train`` runs epochs of them."""
from __future__ import annotations

import os
import time

import torch

from tr_hydra.compiler.compile import Compiled, compile_plan, device_type_of, inductor_wanted, instantiate_model
from tr_hydra import internals
from tr_hydra.internals.compile import inductor_map
from tr_hydra.config.plan_config import PlanConfig
from tr_hydra.errors import ConfigError
from tr_hydra.memory.arena import ArenaKeeper
from tr_hydra.memory.dtensor import DType
from tr_hydra.runtime import distributed
from tr_hydra.runtime.executor import StepExecutor, fused_kernels, loss_and_metrics
from tr_hydra.runtime.feeder import Feeder
from tr_hydra.runtime.forwards import Forwards
from tr_hydra.runtime.model_prep import load_init, prepare


def pick_device(pc: PlanConfig) -> torch.device:
    if pc.runtime.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("runtime.device=cuda: no CUDA device is available (use runtime.device=cpu)")
    return torch.device(device_type_of(pc))


def set_determinism(pc: PlanConfig) -> None:
    if pc.runtime.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    if (torch.are_deterministic_algorithms_enabled() != pc.runtime.deterministic
            or torch.is_deterministic_algorithms_warn_only_enabled()):
        # only on a change: recent releases import Inductor here to set its flag too
        torch.use_deterministic_algorithms(pc.runtime.deterministic)
    torch.backends.cudnn.deterministic = pc.runtime.deterministic
    torch.backends.cudnn.benchmark = not pc.runtime.deterministic


class Runtime:
    """One plan made runnable in this process. ``source``: False for a process that only
    compiles (a parallel compile's child), which reads no data."""

    def __init__(self, pc: PlanConfig, log=print, source: bool = True):
        self.pc = pc
        self.device = pick_device(pc)
        self.dist = distributed.init(pc.dist.mode, self.device.type, pc.dist.timeout_s)
        if self.device.type == "cuda" and self.dist.backend:
            self.device = torch.device("cuda", self.dist.local_rank)
        self.is_main = self.dist.is_main  # only rank 0 logs and writes files
        self.log = log if self.is_main else (lambda *_: None)
        from tr_hydra import bytecode
        note = bytecode.note_once()  # where this run's processes keep Python's bytecode, once
        if note:
            self.log(note)
        self.data_wait = 0.0  # host seconds spent getting batches
        self.first_batch_wait = 0.0  # of the latest run_steps
        set_determinism(pc)
        self.compiled: Compiled = compile_plan(
            pc, fused=fused_kernels(pc.runtime.kernels, self.device.type) is not None)
        # runtime.tuning as chosen (full or none): what every process of the run compiles with
        self.pc = pc = self.compiled.config
        distributed.check_same_plan(self.dist, pc.fingerprint(), pc.describe())
        torch.manual_seed(pc.seed)
        model = instantiate_model(pc, "cpu")
        if pc.model.init_from:
            load_init(model, pc.model.init_from)
        model = model.to(self.device).to(memory_format=torch.channels_last)
        self.inductor = inductor_wanted(pc, self.device.type)
        self.prepared = prepare(model, self.compiled.model_map.first_convs, self.device, pc.amp,
                                self.inductor, pc.runtime.deterministic, self.log)
        self.model = model
        if self.device.type == "cuda":
            from tr_hydra.runtime.guards import check_memory
            free, _ = torch.cuda.mem_get_info(self.device)
            check_memory(self.compiled, free, str(self.device))
        half = torch.float16 if pc.amp_dtype == "fp16" else torch.bfloat16
        self.arena = ArenaKeeper(self.compiled.plan, self.device, half)
        self.arena.bind(model, pc.amp, pc.ema)
        forward, dropped = self._compiled_forward(model) if self.inductor else (model, False)
        if not self.inductor:
            for key, on in ((f"runtime.recompute={pc.runtime.recompute}", pc.runtime.recompute != "none"),
                            ("runtime.inductor_options", bool(pc.runtime.inductor_options))):
                if on:
                    self.log(f"{key} has no effect without Inductor (runtime.compile)")
        # which compiled forward serves each variant: the one above, or a whole compile startup hands over
        self.forwards = Forwards(model, forward, inductor_map(pc.runtime), dropped)
        self.ex = StepExecutor(self.compiled, self.arena, model, self.forwards, dist_ctx=self.dist,
                               compile_loss=self.inductor)
        self.feeder = Feeder(self.ex)
        self.source = self._make_source() if source else None
        self.graphs = None  # CudaGraphs, once startup has captured the variants (``use_graphs``)

    def use_graphs(self, graphs) -> None:
        """From now on the steps replay ``graphs`` (a ``CudaGraphs`` of every variant); None:
        they run eagerly."""
        self.graphs = graphs

    def _compiled_forward(self, model):
        """The model's forward under ``torch.compile`` (``internals.compile``), said in the log,
        and whether building it dropped Dynamo's compiled code of an earlier runtime."""
        from tr_hydra.internals import inductor_compat, tuned_kernels
        from tr_hydra.internals.compile import compile_forward
        pc = self.pc
        options = inductor_map(pc.runtime)
        self.log(self.compiled.tuning.describe())
        fwd_code = getattr(model.forward, "__code__", None)  # the frame Dynamo compiles
        # a forward without a code object of its own (a partial, a C function): reset Dynamo whole
        codes = (fwd_code, loss_and_metrics.__code__) if fwd_code is not None else ()
        forward, dropped = compile_forward(model, pc.runtime, codes, self.log)
        if pc.runtime.inductor_options:
            self.log("runtime.inductor_options: " + ", ".join(f"{k}={v}" for k, v in pc.runtime.inductor_options))
        if internals.is_open() and options.get("coordinate_descent_tuning") and inductor_compat.needed():
            self.log("this PyTorch's Inductor would tune again every kernel it loads from its cache "
                     "(PyTorch issue 172819): the fixed check of later releases is used")
        if internals.is_open() and options.get("coordinate_descent_tuning"):
            each = (f", and of those only where {tuned_kernels.KERNEL_GAIN:.0%} of their launches' time over the "
                    f"run exceeds the {tuned_kernels.KERNEL_SECONDS:.0f} s tuning one takes" if pc.tuned_steps else "")
            self.log(f"coordinate descent tunes kernels of {tuned_kernels.MIN_ELEMENTS:,} elements or more{each}; "
                     "the others keep Inductor's config")
        if internals.is_open() and pc.runtime.recompute != "none":
            self.log(f"runtime.recompute={pc.runtime.recompute}: pointwise results recomputed in the backward")
        return forward, dropped

    def _make_source(self):
        pc = self.pc
        dt = self.arena.torch_dtype(DType.FP16 if pc.amp else DType.FP32)
        if pc.data.name == "synthetic":
            from tr_hydra.data.synthetic import SyntheticSource
            # on CUDA the bank matches the input buffer's padded channels, so a batch's copy into
            # it is one contiguous host-to-device copy (a strided one would need a device temporary)
            pad = self.compiled.plan["input_A.data"].strides[2] if self.device.type == "cuda" else 0
            src = SyntheticSource(pc.model.num_classes, pc.data.channels, pc.seed + 1009 * self.dist.rank,
                                  self.device, dt, pc.train_size, pc.val_size, channel_pad=pad)
            # the banks every variant's batches come from, made while the steps compile
            src.build_ahead([self._request_key(v) for v in pc.variants])
            return src
        from tr_hydra.data.dali_source import DaliSource
        return DaliSource(pc.source_spec(), self.device, dt, shard_id=self.dist.rank, num_shards=pc.world_size,
                          log=self.log)

    def close(self) -> None:
        """Release the captured graphs (before the process group is destroyed: see
        ``CudaGraphs.release``), and stop any work the data source still does ahead."""
        if self.graphs is not None:
            self.graphs.release()
            self.graphs = None
        stop = getattr(self.source, "close", None)
        if stop is not None:
            stop()

    # ------------------------------------------------------------------ steps
    def train_step(self, variant: str, buf: str) -> None:
        (self.graphs or self.ex).train_step(variant, buf)

    def val_step(self, variant: str, buf: str) -> None:
        (self.graphs or self.ex).val_step(variant, buf)

    def _full_batch(self, split: str) -> int:
        """The batch size a source is asked for in ``split`` (a last batch is a part of one)."""
        return self.pc.batch_size if split == "train" else self.pc.variant("val_base").batch

    def _request_key(self, v) -> tuple[str, int, int]:
        split = "train" if v.train else "val"
        return (split, v.res, self._full_batch(split))

    def run_steps(self, steps: list[tuple[str, int, int]], split: str, lr=None, on_step=None,
                  epoch: int = 0) -> int:
        """Feed and run ``steps`` ((variant, batch index, size) each). Each step is launched
        first; the host then prepares the next batch and the feeder copies it into the idle
        buffer while the step runs. ``lr(k)``: the learning rate of the k-th training step."""
        if not steps:
            return 0
        src = self.source
        full = self._full_batch(split)

        def request(s):
            v, i, size = s
            return (split, i, full, size, self.pc.variant(v).res)

        def batch(s):
            t = time.perf_counter()
            out = src.batch(*request(s), epoch=epoch)
            self.data_wait += time.perf_counter() - t
            return out

        def prefetch(k):  # decode step k's batch in the background (sources that can)
            if k < len(steps) and hasattr(src, "prefetch"):
                src.prefetch(*request(steps[k]), epoch=epoch, after=self.feeder.last_copy_event())
        bufs = ("A", "B")
        t0 = self.data_wait
        self.feeder.put("A", steps[0][0], batch(steps[0]))
        self.first_batch_wait = self.data_wait - t0  # a new epoch's (or split's) first batch
        prefetch(1)
        step = self.train_step if split == "train" else self.val_step
        for k, s in enumerate(steps):
            buf = bufs[k % 2]
            if lr is not None and split == "train":
                self.ex.set_lr(lr(k))
            self.feeder.before_step(buf)
            step(s[0], buf)
            self.feeder.after_step(buf)
            if k + 1 < len(steps):
                self.feeder.put(bufs[(k + 1) % 2], steps[k + 1][0], batch(steps[k + 1]))
                prefetch(k + 2)
            if on_step:
                on_step(k)
        return len(steps)

    def validation(self, steps) -> None:
        """``steps`` of validation, in eval mode with BN folded where planned."""
        self.model.eval()
        try:
            with self.ex.folded():
                self.run_steps(steps, "val")
        finally:
            self.model.train()

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
