"""Runner: compile, allocate, bind, capture, then epochs of replayed steps and validation."""
from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tr_hydra.compiler.compile import Compiled, compile_plan, instantiate_model
from tr_hydra.config.plan_config import PlanConfig
from tr_hydra.errors import ConfigError
from tr_hydra.memory.arena import ArenaKeeper
from tr_hydra.memory.dtensor import DType
from tr_hydra.runtime.executor import StepExecutor
from tr_hydra.runtime.feeder import Feeder
from tr_hydra.runtime.model_prep import deterministic_pools, load_init, nchw_compute_on_cpu
from tr_hydra.runtime.schedule import epoch_schedule, lr_at, val_schedule


def pick_device(pc: PlanConfig) -> torch.device:
    want = pc.runtime.device
    if want == "cuda" and not torch.cuda.is_available():
        raise ConfigError("runtime.device=cuda: no CUDA device is available (use runtime.device=cpu)")
    if want == "auto":
        want = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(want)


_PYTORCH_CUDNN_LIMIT = torch.backends.cudnn.benchmark_limit  # PyTorch's own default (10)


def set_cudnn_benchmark_limit(limit: int | None) -> None:
    """``runtime.cudnn_benchmark_limit``: how many of cuDNN's algorithms ``cudnn.benchmark``
    times for each convolution shape (0: every one cuDNN offers). None restores PyTorch's own
    default, so a trainer after one with a limit in the same process gets the default back.
    A process-wide setting: ``tr-bench`` sets it once, for its PyTorch modes too."""
    torch.backends.cudnn.benchmark_limit = _PYTORCH_CUDNN_LIMIT if limit is None else int(limit)


def set_determinism(pc: PlanConfig) -> None:
    set_cudnn_benchmark_limit(pc.runtime.cudnn_benchmark_limit)
    if pc.runtime.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
    else:
        torch.use_deterministic_algorithms(False)
        torch.backends.cudnn.deterministic = False
        torch.backends.cudnn.benchmark = True


def atomic_save(obj, path: Path) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


from tr_hydra.memory.regions import Region as _R

_W_SPAN = (_R.W_BN_BIAS, _R.W_DEEP_CONV)  # the master weights, compared across ranks


def _jsonable(x):
    """Plain JSON types (tuples to lists, non-finite floats kept as floats)."""
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    return x


def _progress(total: int, desc: str, enabled: bool):
    if not enabled:
        return None
    from tqdm import tqdm
    return tqdm(total=total, desc=desc, unit="step", leave=False, dynamic_ncols=True)


class _Stop(Exception):
    """Leaves the epoch loop at a step boundary (preemption, or an error after a checkpoint)."""

    def __init__(self, step: int, epoch: int, error: Exception | None = None):
        super().__init__(step)
        self.step, self.epoch, self.error = step, epoch, error


@dataclass
class TrainResult:
    preempted: bool = False
    summary: dict = field(default_factory=dict)
    epochs: list[dict] = field(default_factory=list)
    steps: int = 0
    img_per_sec: float = 0.0
    arena_bytes: int = 0
    capture_seconds: float = 0.0
    start_wait_seconds: list[float] = field(default_factory=list)  # per rank, at the start barrier
    peak_device_bytes: int = 0
    final_path: str | None = None


def warm_up_order(shared: dict[str, str], pre=None, own: str | None = None):
    """The warm-up's choice of the next variant among those left (``names``): a variant that
    shares another's compiled graph (``shared``: ``Trainer.graph_of``) only after that one, so
    Dynamo reuses the graph rather than compiling it again; among the rest, ``own`` (the variant
    this process compiles itself, whose compile ends with cuDNN's search) while it is left, then
    with parallel compiles (``pre``) the first one ready, else the first."""
    def pick(names: list[str]) -> str:
        ok = [n for n in names if shared.get(n, n) == n or shared[n] not in names]
        if own in ok:
            return own
        return pre.next_ready(ok) if pre is not None else ok[0]
    return pick


def warm_up_progress(beat, pick, pre=None, loaded=None):
    """The warm-up's ``(next_variant, before_variant)`` hooks, telling ``beat`` (a
    ``progress.Heartbeat``) what the wait is: while ``pick`` (``warm_up_order``) waits for any
    parallel compile (``pre``) to finish; then for the chosen variant's own; then its warm-up, in
    which the main process compiles it or loads the child's work. ``loaded(v)``: once ``v``'s
    parallel compile is done, before its warm-up (loading what the child saved)."""
    def next_variant(names: list[str]) -> str:
        if pre is not None:
            beat.now("waiting for the parallel compiles")
        return pick(names)

    def before_variant(v: str) -> None:
        if pre is not None:
            beat.now(f"waiting for {v}'s parallel compile")
            pre.wait(v)
        if loaded is not None:
            loaded(v)
        beat.now(f"warming up {v}")
    return next_variant, before_variant


# the model forwards this process has compiled with a search ahead (see Trainer._search_ahead)
_COMPILED_FORWARDS: set = set()


class Trainer:
    def __init__(self, pc: PlanConfig, run_dir: str | Path = ".", log=print, telemetry: bool = True,
                 source: bool = True, launcher: bool = True):
        """``launcher``: False for a trainer that will not capture, such as a parallel compile's
        own (see ``precompile.Launcher``)."""
        from tr_hydra.runtime import distributed
        self.pc, self.run_dir = pc, Path(run_dir)
        self.data_wait = 0.0  # host seconds spent getting batches
        self.first_batch_wait = 0.0  # of the latest run_steps
        self.device = pick_device(pc)
        self.dist = distributed.init(pc.dist.mode, self.device.type, pc.dist.timeout_s)
        if self.device.type == "cuda" and self.dist.backend:
            self.device = torch.device("cuda", self.dist.local_rank)
        self.is_main = self.dist.is_main  # only rank 0 logs and writes files
        self.log = log if self.is_main else (lambda *_: None)
        self.telemetry = telemetry and self.is_main
        from tr_hydra import bytecode
        note = bytecode.note_once()
        if note:
            self.log(note)
        self._store = None  # saved_compile.Store (runtime.saved_store), set by _precompiler
        self._store_keys: dict[str, str] = {}  # per variant: its key there
        self._model_digest: str | None = None  # saved_compile.model_digest of the model as built
        # the parallel compiles' launcher imports PyTorch while this trainer is built (see capture);
        # one a command-line tool started before it imported PyTorch is taken, or closed
        self.launcher_head_start_s: float | None = None  # how long before this trainer it started
        self._launcher = self._start_launcher() if launcher else None
        self.launcher_ready_s: float | None = None  # seconds from its start until it could fork
        self.launcher_error = ""  # why it could not (its children then started as fresh processes)
        try:
            self._build(pc, source)
        except BaseException:  # a trainer that is not built leaves no launcher behind
            self._close_launcher()
            raise

    def _build(self, pc: PlanConfig, source: bool) -> None:
        from tr_hydra.runtime import distributed
        set_determinism(pc)
        from tr_hydra.runtime.executor import fused_kernels
        self.compiled: Compiled = compile_plan(
            pc, fused=fused_kernels(pc.runtime.kernels, self.device.type) is not None)
        distributed.check_same_plan(self.dist, pc.fingerprint(), pc.describe())
        self.lr_scale = 1.0
        if pc.dist.lr_scaling == "linear":
            self.lr_scale = pc.batch_size * pc.world_size / pc.dist.base_batch
        torch.manual_seed(pc.seed)
        model = instantiate_model(pc, "cpu")
        if self._store_wanted():  # the store's keys follow the model as built
            from tr_hydra.runtime import saved_compile
            digest = saved_compile.model_digest(model, pc.model.name)
            if digest != self._model_digest:  # the launcher's look was at another build
                self._model_digest, self._store_keys = digest, {}
        if pc.model.init_from:
            load_init(model, pc.model.init_from)
        model = model.to(self.device)
        if pc.runtime.channels_last:
            model = model.to(memory_format=torch.channels_last)
        from tr_hydra.models.stem import image_input_recomputed, stem_channel_multiple
        # the convolution over the image reads its input zero-padded to a multiple of this
        self.stem_channels = stem_channel_multiple(pc.runtime.stem_channels, self.device.type, pc.amp)
        self.stem_s2d: list[str] = []  # convs over the image computed in space-to-depth form
        if pc.runtime.stem == "space_to_depth" or (pc.runtime.stem == "auto" and self.device.type == "cuda"):
            from tr_hydra.models.stem import space_to_depth_stem
            self.stem_s2d = space_to_depth_stem(model, self.compiled.model_map.first_convs,
                                                self.stem_channels)
            if self.stem_s2d:
                self.log(f"runtime.stem: {', '.join(self.stem_s2d)} computed as a space-to-depth convolution")
            elif pc.runtime.stem == "space_to_depth":
                self.log("runtime.stem=space_to_depth: no convolution over the image qualifies "
                         "(stride 2, no dilation or groups, at most 4 channels); the model's own is used")
        image_input_recomputed(model, self.compiled.model_map.first_convs, self.stem_channels)
        if self.stem_channels:
            self.log(f"runtime.stem_channels={pc.runtime.stem_channels}: " + ", ".join(
                f"{name} reads {m.read_channels()} channels" for name, m in model.named_modules()
                if name in self.compiled.model_map.first_convs and hasattr(m, "read_channels")))
        from tr_hydra.ops.maxpool import gather_maxpools, uses_gather
        self.maxpools: list[str] = []  # max poolings whose backward is the gathering kernel
        if uses_gather(pc.runtime.maxpool, self.device.type, pc.runtime.compile):
            self.maxpools = gather_maxpools(model)
            if self.maxpools:
                self.log(f"runtime.maxpool: {', '.join(self.maxpools)}'s backward gathers each input element's "
                         "gradient in one kernel" + (" (Triton)" if self.device.type == "cuda" else ""))
        if self.device.type == "cpu":
            nchw_compute_on_cpu(model)
        if pc.runtime.deterministic:
            deterministic_pools(model)
        self.model = model
        half = torch.float16 if pc.amp_dtype == "fp16" else torch.bfloat16
        if self.device.type == "cuda":
            from tr_hydra.runtime.guards import check_memory
            free, _ = torch.cuda.mem_get_info(self.device)
            check_memory(self.compiled, free, str(self.device))
        self.arena = ArenaKeeper(self.compiled.plan, self.device, half)
        self.arena.bind(model, pc.amp, pc.ema)
        forward = model
        if pc.runtime.compile == "inductor" or (pc.runtime.compile == "auto" and self.device.type == "cuda"):
            import torch._dynamo as dynamo
            for knob in ("cache_size_limit", "recompile_limit"):
                if hasattr(dynamo.config, knob):
                    setattr(dynamo.config, knob, 64)
            from tr_hydra.runtime.recompute import fresh_compile_for
            options = dict(pc.runtime.inductor_options)
            user_options = bool(options)
            if pc.runtime.backward_streams == 2:
                from tr_hydra.runtime.backward_streams import aux_stream, inductor_options_for
                options = inductor_options_for(2, options, pc.runtime.backward_join)
                if self.device.type == "cuda":
                    aux_stream(self.device)  # made now, not first inside a capture
                self.log("runtime.backward_streams=2: each convolution's weight gradient runs on a second stream, "
                         "beside its input gradient, joined "
                         + ("before the convolution's backward ends" if pc.runtime.backward_join == "conv"
                            else "after the next convolution's input gradient (runtime.backward_join=next)")
                         + ("" if self.device.type == "cuda" else " (on CPU the two still run one after the other)"))
            from tr_hydra.runtime.executor import loss_and_metrics
            fwd_code = getattr(model.forward, "__code__", None)  # the frame Dynamo compiles
            # a forward without a code object of its own (a partial, a C function): reset Dynamo whole
            codes = (fwd_code, loss_and_metrics.__code__) if fwd_code is not None else ()
            key_options = options
            if pc.runtime.reuse_blocks:
                from tr_hydra.runtime.block_reuse import INDUCTOR_OPTIONS, mark_block_regions
                marked, distinct = mark_block_regions(model)
                self.log(f"runtime.reuse_blocks: {marked} residual blocks share the compiled code of {distinct}"
                         if marked else "runtime.reuse_blocks: no two residual blocks of this model are alike; "
                                        "it is compiled whole")
                if marked:
                    options = {**options, **INDUCTOR_OPTIONS}  # over the user's: without them the code is wrong
                    # blocks made regions trace to another graph: a change of it counts as one of options
                    key_options = {**options, "tr_hydra.reuse_blocks": True}
            if fresh_compile_for(pc.runtime.recompute, key_options, codes):  # compiled code dropped: a compile will come
                _COMPILED_FORWARDS.clear()
            forward = torch.compile(model, dynamic=False, options=options) if options \
                else torch.compile(model, dynamic=False)
            if user_options:
                self.log("runtime.inductor_options: " + ", ".join(f"{k}={v}" for k, v in pc.runtime.inductor_options))
            from tr_hydra.runtime import inductor_compat
            if inductor_compat.apply() and options.get("coordinate_descent_tuning"):
                self.log("this PyTorch's Inductor would tune again every kernel it loads from its cache "
                         "(PyTorch issue 172819): the fixed check of later releases is used")
            if pc.runtime.recompute != "none":
                from tr_hydra.runtime.recompute import with_recompute
                forward = with_recompute(forward, pc.runtime.recompute)
                self.log(f"runtime.recompute={pc.runtime.recompute}: pointwise results recomputed in the backward")
        else:
            unused = ([f"runtime.recompute={pc.runtime.recompute}"] if pc.runtime.recompute != "none" else []) \
                + (["runtime.reuse_blocks"] if pc.runtime.reuse_blocks else []) \
                + (["runtime.inductor_options"] if pc.runtime.inductor_options else []) \
                + (["runtime.backward_streams=2"] if pc.runtime.backward_streams == 2 else [])
            for key in unused:
                self.log(f"{key} has no effect without Inductor (runtime.compile)")
        self.inductor = forward is not model
        self.precompile_summary: dict | None = None
        self.twin_wait_s: float | None = None  # how long the first variant's backward waited for its twin
        # runtime.precompile_saved: per variant, seconds to load its child's saved compile (or
        # the one kept from an earlier run: runtime.saved_store, those named in saved_from_store)
        self.saved_load_s: dict[str, float] = {}
        self.saved_from_store: list[str] = []
        self._stored: dict[str, str] = {}  # per variant: the file kept there, found at the capture
        self.saved_stored: list[str] = []  # the variants whose saved compile this run kept there
        # runtime.saved_store: the variants this process compiles itself, whole, to keep them
        # (set by _precompiler), and the seconds spent writing them into the store
        self._own_whole: list[str] = []
        self.saved_store_write_s = 0.0
        self._ahead_job = None  # the search ahead of the first compile, while it runs
        # with parallel compiles, the variant this process compiles itself (runtime.precompile_own;
        # set by _precompiler) and warms up first, or None
        self._own_first: str | None = None
        # per variant kept in the store: its compile loaded on a thread during cuDNN's search
        # (the SavedForward, or what loading raised), and the seconds it took there
        self._preloaded: dict[str, tuple[object, float]] = {}
        self.saved_preloaded: list[str] = []  # the variants whose kept compile loaded that way
        self.ex = StepExecutor(self.compiled, self.arena, model, forward, dist_ctx=self.dist,
                               compile_loss=forward is not model)
        self.feeder = Feeder(self.ex)
        self.source = self._make_source() if source else None  # no source: precompile children
        self.graphs = None
        self.cudnn_prime = None  # prime_cudnn's report
        # seconds of the capture's own steps: starting the parallel compiles, recording the
        # convolutions on the meta device (the warm-ups and graphs are in ``self.graphs``)
        self.capture_phases: dict[str, float] = {}
        self.autotune_flush = None  # runtime.autotune_flush's report (capture)
        self.steps_per_epoch = len(epoch_schedule(pc, pc.lowres_epochs))  # full-res epoch length
        # the schedule follows trainer.epochs; max_steps only stops early (so a run stopped and
        # resumed follows the same learning-rate curve as one that never stopped)
        self.total_steps = sum(len(epoch_schedule(pc, e)) for e in range(pc.trainer.epochs))

    def _start_launcher(self):
        """``runtime.precompile_start``: the launcher of the parallel compiles that ``capture``
        will start, or None (no parallel compiles to come, or each a fresh process). The one a
        command-line tool started early (``precompile.start_early``) where there is one."""
        from tr_hydra.runtime import precompile as pcm
        t = time.perf_counter()
        early = pcm.take_early()
        launcher = None
        try:
            launcher = self._new_launcher(early)
        finally:
            if early is not None and launcher is not early:
                early.close()
        if launcher is not None and launcher is early:
            self.launcher_head_start_s = max(0.0, t - early.started)
        return launcher

    def _new_launcher(self, early=None):
        from tr_hydra.runtime import precompile as pcm
        setting = self.pc.runtime.precompile_start
        if setting == "fork" and not pcm.fork_available():
            self.log("runtime.precompile_start=fork: not available here (it needs Linux); "
                     "each parallel compile starts as a fresh process")
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        if not pcm.launcher_wanted(self.pc, self.device.type, cpus):
            return None
        store = self._saved_store()
        if store is not None:  # an earlier run's saved compiles: no child may be needed at all
            from tr_hydra.compiler.compile import instantiate_model
            from tr_hydra.runtime import saved_compile
            try:  # the model's digest, from a build on the meta device (40 ms for ResNet-50)
                self._model_digest = saved_compile.model_digest(instantiate_model(self.pc, "meta"),
                                                                self.pc.model.name)
            except Exception:  # noqa: BLE001 - a model the meta device cannot build: start the launcher
                self._model_digest = None
            names = [v.name for v in self.pc.variants][0 if self.pc.runtime.precompile_first else 1:]
            if self._model_digest is not None and all(store.find(self._store_key(v)) for v in names):
                return None
        if early is not None:
            early.adopt(self.log)
            return early
        try:
            return pcm.Launcher(log=self.log)
        except OSError as e:
            self.log(f"runtime.precompile_start: no launcher ({e.strerror}); each parallel compile starts as a fresh process")
            return None

    def _close_launcher(self) -> None:
        if self._launcher is not None:
            self._launcher.close()
            self._launcher = None

    def close(self) -> None:
        """Release the captured graphs (before the process group is destroyed: see
        ``CudaGraphs.release``), and stop any work its data source still does ahead. The trainer
        cannot step afterwards."""
        self._close_launcher()
        if self.graphs is not None:
            self.graphs.release()
            self.graphs = None
        stop = getattr(self.source, "close", None)
        if stop is not None:
            stop()

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
        return DaliSource(pc, self.device, dt, shard_id=self.dist.rank, num_shards=pc.world_size, log=self.log)

    # ------------------------------------------------------------------ steps
    def _train_step(self, variant: str, buf: str) -> None:
        if self.graphs is not None:
            self.graphs.train_step(variant, buf)
        else:
            self.ex.train_step(variant, buf)

    def _val_step(self, variant: str, buf: str) -> None:
        if self.graphs is not None:
            self.graphs.val_step(variant, buf)
        else:
            self.ex.val_step(variant, buf)

    def capture(self) -> None:
        """On CUDA: warm up every variant (the compiles) and capture its graphs."""
        from tr_hydra.runtime import compile_gc
        with compile_gc.during_compiles(self.pc.runtime.compile_gc):
            self._capture()

    def _capture(self) -> None:
        pc = self.pc
        if self.device.type != "cuda" or not pc.runtime.cuda_graph:
            self._close_launcher()  # no parallel compiles here
        if self.device.type != "cuda":
            return
        if not pc.runtime.cuda_graph:
            self.prime_cudnn()
            return
        from tr_hydra.runtime import split_compile
        from tr_hydra.runtime.graphs import CudaGraphs
        from tr_hydra.runtime.progress import Heartbeat
        self.graphs = CudaGraphs(self.ex)
        train_v = [v.name for v in pc.variants if v.train]
        val_v = [v.name for v in pc.variants if not v.train]
        t = time.perf_counter()
        shared = self.graph_of()  # runtime.dynamic_batch: a compile per group, not per variant
        if len(set(shared.values())) < len(shared):
            groups = {}
            for v, g in shared.items():
                groups.setdefault(g, []).append(v)
            self.log(f"runtime.dynamic_batch: {len(shared)} variants share {len(groups)} compiled graphs ("
                     + "; ".join(", ".join(vs) for vs in groups.values()) + ")")
        pre = self._precompiler([v for v in train_v if shared[v] == v], [v for v in val_v if shared[v] == v],
                                also={g: [v for v in shared if shared[v] == g and v != g] for g in shared.values()})
        if pre is not None and pre.launcher is not None:
            self._launcher = None  # the precompiler's now: closed with it
        self._close_launcher()  # not used: no parallel compiles after all
        self.capture_phases["start_children"] = time.perf_counter() - t
        ahead = None
        # a line every 30 s while the search, a variant's compile or the wait for a parallel
        # one goes on: the first compile alone is 40-60 s on the H200, and nothing else is said
        beat = Heartbeat(self.log, extra=pre.running_note if pre else None)
        try:
            # cuDNN's search while the children compile; with Inductor, started on a thread
            # while this process compiles its first variant and finished here before that
            # variant's compiled code runs (see cudnn_prime.BeforeFirstRun)
            first = self._own_first or (train_v + val_v)[0]
            if self._own_whole:  # runtime.saved_store: compiled whole here, to be kept
                from tr_hydra.runtime.saved_compile import Recorder
                self.ex.recorder = Recorder({v: None for v in self._own_whole}, self.ex.compile_options,
                                            on_compiled=self._whole_compiled)
            ahead = self._ahead_job = self._search_ahead(first)
            if ahead is None and self.cudnn_prime is None:
                with beat:
                    beat.now("searching cuDNN's algorithms (runtime.prime_cudnn)")
                    # the compiles kept by an earlier run load on a thread meanwhile: the
                    # search runs no compile and the loads no convolution
                    with self._preloading():
                        self.prime_cudnn()

            def settle() -> None:  # before the first capture, which must see no other thread's work
                nonlocal ahead
                beat.close()
                if ahead is not None:
                    job, ahead = ahead, None
                    self._ahead_job = None
                    self._settle_search_ahead(job)
            next_variant, before_variant = warm_up_progress(beat, warm_up_order(shared, pre, self._own_first), pre,
                                                            loaded=lambda v: self._load_saved(pre, v))
            # this process's own first variant: its backward from its twin, once that is done
            twin = pre.twin_lock(train_v[0]) if pre is not None and train_v else None
            waited: list[float] = []
            with self._autotune_flush() as flush, beat, \
                    (split_compile.waits_for_twin(twin, waited) if twin else contextlib.nullcontext()):
                self.graphs.capture(train_v, val_v, pc.runtime.warmup_steps, before_variant=before_variant,
                                    next_variant=next_variant, before_capture=settle)
            self._keep_saved(pre)
            self._trim_store()
            own = [v for v in self.saved_stored if v in self._own_whole]
            kept = (f"kept for later runs: {', '.join(self.saved_stored)}"
                    + (f" ({', '.join(own)} compiled whole here, written in {self.saved_store_write_s:.1f}s)"
                       if own else "") if self.saved_stored else "")
            if self.saved_load_s:
                during = (f", {', '.join(self.saved_preloaded)} on a thread during cuDNN's search"
                          if self.saved_preloaded else "")
                self.log(f"loaded the saved compiles of {len(self.saved_load_s)} variants in "
                         f"{sum(self.saved_load_s.values()):.1f}s ("
                         + ", ".join(f"{v} {s:.1f}s" for v, s in self.saved_load_s.items()) + during + ")"
                         + (f"; {kept}" if kept else ""))
            elif kept:
                self.log(f"runtime.saved_store: {kept}")
            if waited:
                self.twin_wait_s = sum(waited)
                self.log(f"{train_v[0]}: waited {self.twin_wait_s:.1f}s for its backward's twin process")
            if flush is not None:
                self.autotune_flush = flush
                if flush.benchmarks or not flush.supported:
                    self.log(flush.line())
        except torch.cuda.OutOfMemoryError:
            from tr_hydra.runtime.guards import MemoryPlanError, capture_oom_message
            self.graphs = None
            torch.cuda.empty_cache()
            free, _ = torch.cuda.mem_get_info(self.device)
            raise MemoryPlanError(capture_oom_message(self.compiled, free, str(self.device))) from None
        finally:
            self._ahead_job = None
            if self.ex.recorder is not None and self._own_whole:
                self.ex.recorder.on_compiled = None
            if ahead is not None:  # the capture failed: its error is the one raised
                try:
                    ahead.close()
                except Exception:  # noqa: BLE001
                    pass
            if pre:
                self.precompile_summary = pre.summary()
                if pre.launcher is not None:
                    self.launcher_ready_s, self.launcher_error = pre.launcher.ready_s, pre.launcher.error
                pre.close()
        self.log(f"captured {len(self.graphs.train) + len(self.graphs.val)} CUDA graphs "
                 f"in {self.graphs.capture_seconds:.1f}s")

    @contextlib.contextmanager
    def _autotune_flush(self):
        """``runtime.autotune_flush=fit`` with Inductor: while every variant warms up, Triton's
        autotuning flushes L2 with at most the room under the memory high-water mark (see
        ``autotune_flush``); yields its report, or None."""
        if not self.inductor or self.pc.runtime.autotune_flush != "fit":
            yield None
            return
        from tr_hydra.runtime.autotune_flush import fit_under_peak
        with fit_under_peak(self.device) as rep:
            yield rep

    def prime_cudnn(self):
        """``runtime.prime_cudnn``: cuDNN's algorithm search for every convolution the steps run,
        done now, with only the arena alive, instead of inside the first step of each variant,
        where its workspace comes on top of every activation (see ``cudnn_prime``). Returns the
        report, or None when nothing searches (CPU, deterministic, the option off)."""
        calls = self._prime_calls()
        return None if calls is None else self._primed(self._search(calls))

    def _search(self, calls):
        """cuDNN's search for ``calls`` on this thread, on the stream the warm-up and capture use."""
        from tr_hydra.runtime import cudnn_prime
        from tr_hydra.runtime.graphs import capture_stream
        if self.device.type != "cuda":
            return cudnn_prime.prime(calls, self.device)
        stream = capture_stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            return cudnn_prime.prime(calls, self.device)

    def _primed(self, rep):
        if rep is None:
            return None
        where = "before the first step"
        if rep.in_first_compile:
            where = (f"at the end of the first compile, after a thread's search beside it "
                     f"({rep.ahead_seconds:.1f}s, waited {rep.waited:.1f}s),")
            if rep.ahead_error:
                where = (f"at the end of the first compile (the thread's search beside it failed: "
                         f"{rep.ahead_error}),")
        self.log(f"runtime.prime_cudnn: cuDNN searched {rep.calls} convolutions {where} in {rep.seconds:.1f}s")
        self.cudnn_prime = rep
        return rep

    def graph_of(self) -> dict[str, str]:
        """Each variant's compiled graph, named by the first variant that compiles it: its own,
        or with ``runtime.dynamic_batch`` and Inductor the first of its split and resolution
        (a batch of 1 keeps its own: Dynamo specializes it)."""
        first: dict = {}
        out = {}
        for v in self.pc.variants:
            key = (v.train, v.res) if self.inductor and self.pc.runtime.dynamic_batch and v.batch > 1 else v.name
            out[v.name] = first.setdefault(key, v.name)
        return out

    def _settle_search_ahead(self, job) -> None:
        """End the search ahead (its thread stopped and joined) and report it."""
        try:
            rep = job.close()
        except torch.cuda.OutOfMemoryError:
            raise
        except Exception as e:  # noqa: BLE001 - the steps searched for themselves instead
            why = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), type(e).__name__)
            self.log(f"runtime.prime_cudnn: the search at the end of the first compile failed "
                     f"({why}); cuDNN searched inside the first steps instead")
            return
        if rep is None:
            self.log("runtime.prime_cudnn: no compile came in the warm-up; cuDNN searched inside the first steps")
        self._primed(rep)

    def _search_ahead(self, first: str | None = None):
        """With Inductor: ``cudnn_prime.BeforeFirstRun`` for every variant's convolutions, or None
        (nothing to search, searched already, no compile-end callback in this PyTorch, or no
        compile before the first variant's convolutions run: ``first``, the variant warmed up
        first, loads a compile kept by an earlier run)."""
        from tr_hydra.runtime import cudnn_prime
        from tr_hydra.runtime.graphs import capture_stream
        if self.cudnn_prime is not None or not self.inductor or not cudnn_prime.can_search_ahead():
            return None
        if first in self._stored:
            return None
        # the main search waits for a compile: only where one is sure to come. A whole compile
        # of the first variant always comes (``_own_whole``: the recorder tells the job). Dynamo
        # keeps a compiled forward per code object, guarded on the module's structure, so a later
        # trainer of the same model in this process (a sweep's next job) may reuse it and compile nothing
        if first not in self._own_whole:
            code = getattr(type(self.model).forward, "__code__", None)
            if code is None or code in _COMPILED_FORWARDS:
                return None
            _COMPILED_FORWARDS.add(code)
        calls = self._prime_calls()  # on the meta device, before Dynamo touches the model
        if calls is None:
            return None
        stream = capture_stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        return cudnn_prime.BeforeFirstRun(calls, self.device, stream, lambda: self._search(calls))

    def _prime_calls(self):
        """Every variant's convolutions, recorded on the meta device, or None (nothing searches)."""
        from tr_hydra.runtime import cudnn_prime
        pc = self.pc
        if not pc.runtime.prime_cudnn or not cudnn_prime.searches(self.device):
            return None
        dt = self.arena.half_dtype if pc.amp else torch.float32
        calls = []
        t = time.perf_counter()
        try:
            for v in pc.variants:
                calls += cudnn_prime.record(self.model, v.batch, pc.data.channels, v.res, dt, v.train,
                                            pc.runtime.channels_last)
        except Exception as e:  # a model the meta device cannot run: the steps search, as without
            why = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), type(e).__name__)
            self.log(f"runtime.prime_cudnn: the model does not run on the meta device ({why}); "
                     f"cuDNN searches inside the first steps instead")
            return None
        finally:
            self.capture_phases["record_convs"] = self.capture_phases.get("record_convs", 0.0) + time.perf_counter() - t
        return calls

    def _precompiler(self, train_v: list[str], val_v: list[str], also: dict[str, list[str]] | None = None):
        """Parallel compiles of every variant after the first (``runtime.precompile``; the first
        too with ``runtime.precompile_first``, the main process then loading all of them, Triton's
        autotuning results included, from the caches), or None."""
        from tr_hydra.runtime import precompile as pcm
        from tr_hydra.runtime.guards import HEADROOM
        self._own_first = None
        if not self.inductor or not pcm.caches_enabled():
            return None
        first = self.pc.runtime.precompile_first
        every = [(v, True) for v in train_v] + [(v, False) for v in val_v]
        self._find_stored([v for v, _ in every])
        order = [(v, t) for v, t in (every if first else every[1:]) if v not in self._stored]
        # runtime.saved_store: what this process compiles itself it compiles whole and keeps;
        # narrowed below to its first variant when children take the others
        self._own_whole = [v for v, _ in every if v not in self._stored] if self._store is not None else []
        if not order:  # nothing left for a child: every one loads from the store
            return None
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        want = pcm.requested_workers(self.pc.runtime.precompile, len(order), self.pc.world_size, cpus, True)
        free, _ = torch.cuda.mem_get_info(self.device)
        n = pcm.memory_limited(want, free, self.compiled.plan.total_bytes + self.compiled.gradient_transient
                               + self.compiled.library_workspace,
                               self.compiled.activation_estimate, HEADROOM)
        if n == 0:
            if want:
                self.log("runtime.precompile: no room on the device for a parallel compile; compiling in turn")
            return None
        mine = [] if first else [v for v, _ in every[:1] if v not in self._stored]
        own = self._own_variants(mine[0], [v for v, t in order if not t]) if mine else mine
        if own != mine:  # the children take the first variant instead, if each gets a child of its own
            rest = [(mine[0], True)] + [(v, t) for v, t in order if v not in own]
            if n >= len(rest):
                order, mine, n = rest, own, len(rest)
        self._own_first = mine[0] if mine else None
        here = f"{' and '.join(mine)} here, " if mine else ""
        twins = self._twins(mine + [v for v, t in order if t], n, free)
        saved = self._saved_wanted(bool(twins))
        self._own_whole = mine if saved and self._store is not None else []
        self.log(f"compiling {len(every) - len(self._stored)} variants: {here}"
                 f"{len(order)} in {n} parallel process{'es' if n > 1 else ''}"
                 + (f"; the backward of {', '.join(twins)} in a twin process each" if twins else "")
                 + (f"; their launcher started {self.launcher_head_start_s:.1f}s before the trainer"
                    if self.launcher_head_start_s and self._launcher is not None else ""))
        return pcm.Precompiler(self.pc, order, n, log=self.log, device_index=self.device.index or 0, also=also,
                               launcher=self._launcher, twins=tuple(twins), saved=saved,
                               share_training=not val_v)  # a run without validation: training children share

    def _own_variants(self, first: str, val_v: list[str]) -> list[str]:
        """``runtime.precompile_own``: the variants this process compiles itself, in that order,
        while each other variant compiles in a child of its own. ``auto``: the first of ``val_v``
        (validation variants a child would compile), whose compile, a forward only, ends well
        before a training variant's, so the cuDNN search this process does after its compile
        (see ``cudnn_prime.BeforeFirstRun``) no longer comes after the slowest compile;
        ``validation``: all of ``val_v``, one after another, so that one process fewer compiles
        beside the training variants' children; ``first`` (and with ``precompile_backward``,
        whose twins pair with training variants): ``first``."""
        rt = self.pc.runtime
        if rt.precompile_own not in ("auto", "validation") or rt.precompile_backward or not val_v:
            return [first]
        return list(val_v) if rt.precompile_own == "validation" else val_v[:1]

    def _saved_wanted(self, twins: bool) -> bool:
        """``runtime.precompile_saved``: whether the children save their variant's compile whole
        for this process to load (see ``saved_compile``); says why not where it was asked for
        but cannot be."""
        from tr_hydra.runtime import saved_compile
        rt = self.pc.runtime
        if not rt.precompile_saved:
            return False
        why = saved_compile.supported()
        for on, what in ((rt.dynamic_batch, "runtime.dynamic_batch"), (rt.recompute != "none", "runtime.recompute"),
                         (rt.reuse_blocks, "runtime.reuse_blocks"), (rt.backward_streams != 1, "runtime.backward_streams"),
                         (twins, "runtime.precompile_backward")):
            if not why and on:
                why = f"not with {what}"
        if why:
            self.log(f"runtime.precompile_saved: not used ({why}); each variant is traced here and its code "
                     f"found in the caches")
            return False
        return True

    def whole_compile_s(self) -> dict[str, float]:
        """Per variant this process compiled whole itself (``_own_whole``), the seconds it took
        (failed attempts included)."""
        rec = self.ex.recorder
        return {v: t for v, t in rec.seconds.items() if v in self._own_whole} if rec and self._own_whole else {}

    def _whole_compiled(self) -> None:
        """A variant this process compiles whole (``_own_whole``) is compiled, before its code
        first runs: the search ahead's main search, if it waits for that (once)."""
        if self._ahead_job is not None:
            self._ahead_job.compiled()

    @contextlib.contextmanager
    def _preloading(self):
        """While the body runs (cuDNN's search before the warm-up), the compiles kept by an
        earlier run (``_stored``) load on a thread, into ``_preloaded``; joined at the end."""
        from tr_hydra.runtime import saved_compile
        todo = list(self._stored.items())
        if not todo:
            yield
            return

        def load_all():
            for v, path in todo:
                t = time.perf_counter()
                try:
                    f = saved_compile.load(path, self.model, v)
                except Exception as e:  # noqa: BLE001 - reported where the variant warms up
                    f = e
                self._preloaded[v] = (f, time.perf_counter() - t)
        th = threading.Thread(target=load_all, name="tr_hydra-load-saved", daemon=True)
        th.start()
        try:
            yield
        finally:
            th.join()

    def _load_saved(self, pre, v: str) -> None:
        """Use ``v``'s saved compile, if its child wrote one or an earlier run kept one
        (``runtime.saved_store``; loaded already if ``_preloading`` did); one line if it does
        not load (the variant is then traced here: its code found in the caches, or, for a
        kept file, compiled here; that file is dropped from the store)."""
        kept = self._stored.get(v)
        path = kept or (pre.saved_forward(v) if pre is not None else None)
        if path is None:
            return
        t = time.perf_counter()
        got = self._preloaded.pop(v, None) if kept else None
        try:
            if got is None:
                self.ex.load_saved_forward(v, path)
            elif isinstance(got[0], BaseException):
                raise got[0]
            else:
                self.ex.saved_forwards[v] = got[0]
                t -= got[1]  # its load, on the thread
                self.saved_preloaded.append(v)
        except Exception as e:  # noqa: BLE001 - the ordinary load still works
            why = f"{type(e).__name__}: {str(e)[:160]}"
            if kept:
                self._store.drop(self._store_keys[v])
                self.log(f"  {v}: the saved compile kept by an earlier run did not load ({why}); "
                         f"compiling it here (and dropping that file)")
            else:
                self.log(f"  {v}: its saved compile did not load ({why}); tracing it here")
            return
        self.saved_load_s[v] = time.perf_counter() - t
        if kept:
            self._store.touch(kept)  # used now: the last one trim drops
            self.saved_from_store.append(v)

    def _store_wanted(self) -> bool:
        """``runtime.saved_store`` is on and the saved compiles themselves are used (see
        ``_saved_wanted``)."""
        from tr_hydra.runtime import saved_compile
        rt = self.pc.runtime
        return bool(rt.saved_store and rt.precompile_saved and not saved_compile.supported()
                    and not rt.dynamic_batch and rt.recompute == "none" and not rt.reuse_blocks
                    and rt.backward_streams == 1 and not rt.precompile_backward)

    def _saved_store(self):
        """The ``saved_compile.Store`` this run reads and adds to (``runtime.saved_store``), or
        None."""
        from tr_hydra.runtime import saved_compile
        if not self._store_wanted():
            return None
        try:
            return saved_compile.Store()
        except OSError as e:  # no cache directory to be had: as without the option
            self.log(f"runtime.saved_store: not used ({e.strerror or e})")
            return None

    def _store_key(self, v: str) -> str:
        from tr_hydra.runtime import saved_compile
        if v not in self._store_keys:
            self._store_keys[v] = saved_compile.store_key(self.pc, v, self.device,
                                                          dict(self.pc.runtime.inductor_options),
                                                          self._model_digest or "")
        return self._store_keys[v]

    def _find_stored(self, names: list[str]) -> None:
        """The variants among ``names`` whose saved compile an earlier run kept (``_stored``):
        they are loaded, not compiled; one line names them."""
        self._store = self._saved_store()
        if self._store is None:
            return
        self._stored = {v: p for v in names if (p := self._store.find(self._store_key(v)))}
        if self._stored:
            self.log(f"runtime.saved_store: {len(self._stored)} of {len(names)} variants' compiles kept by an "
                     f"earlier run ({', '.join(self._stored)}): loaded, not compiled")

    def _keep_saved(self, pre) -> None:
        """After a capture: keep in the store, for the next run, each compile this run loaded
        from a child (it loaded here and its graphs were captured) and each this process
        compiled whole itself (``_own_whole``: its graphs were captured); drop a kept one that
        was made for another input than its variant's."""
        for v, why in self.ex.saved_mismatch.items():
            self.log(f"  {v}: its saved compile was made for another input ({why}); compiled here instead")
            self.saved_load_s.pop(v, None)
            if v in self.saved_from_store:
                self.saved_from_store.remove(v)
                self._store.drop(self._store_keys[v])
        if self._store is None:
            return
        rec = self.ex.recorder if self._own_whole else None
        if rec is not None:
            for v, why in rec.errors.items():
                self.log(f"runtime.saved_store: {v} could not be compiled whole here ({why.splitlines()[0]}); "
                         f"traced as usual, not kept")
            t = time.perf_counter()
            for v, f in rec.compiled.items():
                if v in self.ex.saved_mismatch:
                    continue
                try:
                    self._store.save(f, self._store_key(v))
                except Exception as e:  # noqa: BLE001 - a full disk, a compile that does not serialize:
                    # this run is not harmed, the next one compiles it
                    why = getattr(e, "strerror", None) or f"{type(e).__name__}: {str(e)[:160]}"
                    self.log(f"runtime.saved_store: {v}'s compile was not kept ({why})")
                    continue
                self.saved_stored.append(v)
            self.saved_store_write_s = time.perf_counter() - t
        if pre is None:
            return
        for v in self.saved_load_s:
            path = pre.saved_forward(v)
            if v in self._stored or path is None:
                continue
            try:
                self._store.put(path, self._store_key(v))
            except OSError as e:  # a full disk: this run is not harmed, the next one compiles
                self.log(f"runtime.saved_store: {v}'s saved compile was not kept ({e.strerror or e})")
                continue
            self.saved_stored.append(v)

    def _trim_store(self) -> None:
        """``runtime.saved_store_gb``: the store trimmed to that size, the least recently used
        compiles dropped first, never this run's; one line if any were."""
        gb = self.pc.runtime.saved_store_gb
        if self._store is None or gb is None:
            return
        mine = [self._store.path(k) for k in self._store_keys.values()]
        n, freed = self._store.trim(int(gb * 1e9), keep=mine)
        if n:
            self.log(f"runtime.saved_store: dropped the {n} least recently used kept compile{'s' if n > 1 else ''} "
                     f"({freed / 1e6:,.0f} MB) to hold the store under runtime.saved_store_gb={gb:g}")

    def _twins(self, candidates: list[str], workers: int, free: int) -> list[str]:
        """The training variants whose backward a twin process compiles
        (``runtime.precompile_backward``; see ``split_compile``), in warm-up order."""
        from tr_hydra.runtime import precompile as pcm
        from tr_hydra.runtime import split_compile
        from tr_hydra.runtime.guards import HEADROOM
        if not self.pc.runtime.precompile_backward or not candidates:
            return []
        why = split_compile.supported()
        if not why and self.pc.runtime.dynamic_batch:
            # on the H200 the children of graphs with a symbolic batch did not find their twins'
            # backward in the cache (they do on the CPU): compiling it twice gains nothing
            why = "not with runtime.dynamic_batch"
        if why:
            self.log(f"runtime.precompile_backward: not available ({why}); each variant compiles its own backward")
            return []
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        k = pcm.twins_limited(len(candidates), self.pc.runtime.precompile, cpus, workers, free,
                              self.compiled.plan.total_bytes + self.compiled.gradient_transient
                              + self.compiled.library_workspace, self.compiled.activation_estimate, HEADROOM)
        return candidates[:k]

    def _full_batch(self, split: str) -> int:
        """The batch size a source is asked for in ``split`` (a last batch is a part of one)."""
        return self.pc.batch_size if split == "train" else self.pc.variant("val_base").batch

    def _request_key(self, v) -> tuple[str, int, int]:
        split = "train" if v.train else "val"
        return (split, v.res, self._full_batch(split))

    def run_steps(self, steps: list[tuple[str, int, int]], split: str, step0: int = 0,
                  on_step=None, epoch: int = 0) -> int:
        """Feed and run ``steps``. Each step is launched first; the host then prepares the next
        batch and the feeder copies it into the idle buffer while the step runs."""
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
        for k, s in enumerate(steps):
            buf = bufs[k % 2]
            if split == "train":
                self.ex.set_lr(self.lr_scale * lr_at(self.pc.optimizer, step0 + k, self.steps_per_epoch,
                                                     self.total_steps))
            self.feeder.before_step(buf)
            if split == "train":
                self._train_step(s[0], buf)
            else:
                self._val_step(s[0], buf)
            self.feeder.after_step(buf)
            if k + 1 < len(steps):
                self.feeder.put(bufs[(k + 1) % 2], steps[k + 1][0], batch(steps[k + 1]))
                prefetch(k + 2)
            if on_step:
                on_step(k)
        return len(steps)

    def validate(self) -> dict[str, dict]:
        out = {}
        self.ex.sync_bn_stats()
        self.ex.before_validation()
        self.model.eval()
        with self.ex.folded():
            self.run_steps(val_schedule(self.pc), "val")
            out["val"] = self.ex.read_metrics("val")
            if self.pc.ema:
                with self.ex.ema_weights():
                    if self.pc.bn_folded:
                        self.ex.before_validation()
                    self.run_steps(val_schedule(self.pc), "val")
                if self.pc.bn_folded:
                    self.ex.before_validation()
                self.ex.acc["val_ema"].copy_(self.ex.acc["val"])
                self.ex.acc["val"].zero_()
                out["val_ema"] = self.ex.read_metrics("val_ema")
        self.model.train()
        return out

    # ------------------------------------------------------------------ loop
    def steps_before(self, epoch: int) -> int:
        return sum(len(epoch_schedule(self.pc, e)) for e in range(epoch))

    def _resume_point(self) -> tuple[int, int, list]:
        """(epoch, step, history) to start from; restores the arena when resuming."""
        from tr_hydra.runtime import checkpoint as ck
        from tr_hydra.runtime.distributed import broadcast
        pc = self.pc
        if not pc.resume:
            return 0, 0, []
        if pc.resume == "auto":
            # rank 0 picks the checkpoint; every rank loads that same file
            found = ck.newest_valid(self.run_dir, log=self.log) if self.is_main else None
            path = broadcast(self.dist, str(found) if found else None)
            if path is None:
                self.log(f"resume=auto: no checkpoint in {self.run_dir / 'checkpoints'}; starting fresh")
                return 0, 0, []
            path = Path(path)
        else:
            path = Path(pc.resume)
        state = ck.load(path)
        ck.check_compatible(state, self.arena, pc.fingerprint(), pc.describe(), path)
        ck.restore(state, self.arena)
        data = (state.get("extra") or {}).get("data")
        if data and len(data) == self.dist.world_size and hasattr(self.source, "restore"):
            self.source.restore(data[self.dist.rank])  # the input's augmentation state, per rank
        step = int(state["position"]["step"])
        epoch = 0
        while epoch < pc.trainer.epochs and self.steps_before(epoch + 1) <= step:
            epoch += 1
        self.log(f"resumed from {path} at epoch {epoch + 1}, step {step}")
        return epoch, step, list(state.get("history", []))

    def save_checkpoint(self, epoch: int, step: int, history: list) -> Path | None:
        from tr_hydra.runtime import checkpoint as ck
        from tr_hydra.runtime.distributed import all_gather, barrier
        self.ex.sync_bn_stats()  # every rank: the collective needs them all
        # every rank's input state (where its train stream stands, its augmentation generators)
        data = all_gather(self.dist, self._input_state())
        d = self.run_dir / "checkpoints"
        if not self.is_main:
            barrier(self.dist)
            return None
        d.mkdir(parents=True, exist_ok=True)
        path = ck.save(d / f"ckpt_e{epoch:04d}_s{step:08d}.pt", self.arena,
                       position=ck.Position(epoch, step), fingerprint=self.pc.fingerprint(),
                       config=_jsonable(self.pc.to_dict()), describe=self.pc.describe(),
                       history=_jsonable(history), extra={"data": data} if any(data) else None)
        ck.prune(self.run_dir, self.pc.trainer.keep_checkpoints)
        barrier(self.dist)
        return path

    def _input_state(self):
        """The source's state for a checkpoint; a source that cannot give it (a pipeline broken by
        the error that stops the run) must not cost the checkpoint itself."""
        if not hasattr(self.source, "state"):
            return None
        try:
            return self.source.state()
        except Exception as e:  # noqa: BLE001 - the checkpoint matters more
            self.log(f"checkpoint: the input state is not saved ({str(e).splitlines()[0] if str(e) else type(e).__name__}); "
                     f"a run resumed from it draws fresh crops")
            return None

    def _start_together(self) -> list[float]:
        """Under ddp, every rank waits here until all have compiled and captured: the first
        all-reduce would wait anyway, but inside the clock of the first steps. Returns each
        rank's wait (the largest is the ranks' start-up skew)."""
        if self.dist.world_size <= 1:
            return []
        from tr_hydra.runtime.distributed import all_gather, barrier
        t = time.perf_counter()
        barrier(self.dist)
        waits = all_gather(self.dist, time.perf_counter() - t)
        self.log("all {} ranks ready; waited for the others: {}".format(
            len(waits), ", ".join(f"rank {r} {w:.1f}s" for r, w in enumerate(waits))))
        return waits

    def fit(self) -> TrainResult:
        from tr_hydra.telemetry.tensorboard import Telemetry
        res = TrainResult(arena_bytes=self.compiled.plan.total_bytes)
        start_epoch, step, history = self._resume_point()
        self.capture()  # after the restore: warm-up snapshots and restores the resumed state
        res.capture_seconds = self.graphs.capture_seconds if self.graphs else 0.0
        res.start_wait_seconds = self._start_together()
        tel = Telemetry(self.run_dir, self.compiled, self.arena, enabled=self.telemetry,
                        grads_16bit=self.ex.grads_read_16bit, grad16_sumsq=self.ex.grad16_sumsq)
        tel.start(step)
        images, train_time, t_run = 0, 0.0, time.perf_counter()
        self.model.train()
        from tr_hydra.runtime import compile_gc
        from tr_hydra.runtime.guards import PreemptionGuard
        with PreemptionGuard() as guard:
            try:
                # compiles in the steps themselves (no CUDA graphs: Inductor on the CPU, or
                # runtime.cuda_graph=false) follow runtime.compile_gc too
                with compile_gc.during_compiles(self.pc.runtime.compile_gc):
                    step, images, train_time = self._epochs(start_epoch, step, history, tel, guard,
                                                            images, train_time)
            except _Stop as stop:
                step = stop.step
                self._sync()
                path = self.save_checkpoint(stop.epoch, step, history)
                self.write_metrics(history)
                tel.close()
                if stop.error is not None:
                    self.log(f"checkpoint before stopping: {path}")
                    raise stop.error
                self.log(f"stopped by {guard.stop.signal_name} at step {step}; checkpoint {path}; "
                         f"continue with resume=auto (same run dir)")
                res.epochs, res.steps, res.preempted = history, step, True
                return res
        res.epochs = history
        res.steps = step
        res.img_per_sec = images / train_time if train_time else 0.0
        if self.device.type == "cuda":
            res.peak_device_bytes = torch.cuda.max_memory_allocated(self.device)
        res.final_path = str(self.save_final())
        vals = [r["val"]["top1"] for r in history if "val" in r]
        summary = {"best_val_top1": max(vals) if vals else float("nan"),
                   "final_val_loss": next((r["val"]["loss"] for r in reversed(history) if "val" in r), float("nan")),
                   "img_per_sec": res.img_per_sec, "total_seconds": time.perf_counter() - t_run,
                   "arena_bytes": res.arena_bytes, "peak_device_bytes": res.peak_device_bytes,
                   "steps": step}
        if res.start_wait_seconds:
            summary["start_wait_seconds"] = res.start_wait_seconds
        res.summary = summary
        self.write_metrics(history, summary)
        tel.close(_jsonable(self.pc.to_dict()), summary)
        self.log(f"summary: best val top1 {summary['best_val_top1']:.2f}  total {summary['total_seconds']:.1f}s  "
                 f"{res.img_per_sec:,.1f} img/s  arena {res.arena_bytes:,} bytes  "
                 f"peak device memory {res.peak_device_bytes / 2**20:,.1f} MiB")
        return res

    def _check_health(self, step: int) -> None:
        """At each metrics read: stop on repeated non-finite steps or a collapsed fp16 scale."""
        from tr_hydra.runtime.guards import NonFiniteError
        pc = self.pc
        bad = self.ex.scalar("nonfinite")
        if bad >= max(pc.trainer.max_nonfinite, 1):
            raise NonFiniteError(f"training stopped: {int(bad)} steps with non-finite loss or gradients "
                                 f"(trainer.max_nonfinite={pc.trainer.max_nonfinite}), "
                                 f"{self.ex.nonfinite_report()}; those steps were skipped, the weights are finite")
        if self.ex.fp16 and self.ex.scalar("loss_scale") < 2.0 ** -14:
            raise NonFiniteError(f"training stopped: the fp16 loss scale collapsed to "
                                 f"{self.ex.scalar('loss_scale'):.3g} after {int(self.ex.scalar('skipped'))} "
                                 f"skipped steps ({self.ex.nonfinite_report()}); try amp_dtype=bf16 or a lower lr")

    def _epochs(self, start_epoch, step, history, tel, guard, images, train_time):
        pc = self.pc
        for epoch in range(start_epoch, pc.trainer.epochs):
            sched = epoch_schedule(pc, epoch)[step - self.steps_before(epoch):]  # skip what is done
            if pc.trainer.max_steps:
                sched = sched[:max(pc.trainer.max_steps - step, 0)]
            if not sched:
                break
            self._sync()
            t0 = time.perf_counter()
            totals = {"loss": 0.0, "top1": 0.0, "top5": 0.0, "count": 0.0}
            bar = _progress(len(sched), f"epoch {epoch + 1}/{pc.trainer.epochs}",
                            pc.trainer.progress and sys.stderr.isatty())
            mark = {"t": t0, "k": -1, "wait": 0.0}

            def on_step(k, _n=len(sched), _step0=step, _epoch=epoch):
                if bar:
                    bar.update(1)
                if self._should_stop(guard, k + 1 == _n or (k + 1) % pc.trainer.log_every == 0):
                    raise _Stop(_step0 + k + 1, _epoch)
                # the host reads the device accumulator once per log interval, never per step
                if (k + 1) % pc.trainer.log_every == 0 or k + 1 == _n:
                    m = self.ex.read_metrics("train")
                    now = time.perf_counter()
                    n_steps = k - mark["k"]
                    n_img = sum(s[2] for s in sched[mark["k"] + 1:k + 1])
                    for key in ("loss", "top1", "top5"):
                        totals[key] += m[key] * m["count"]
                    totals["count"] += m["count"]
                    rate = n_img / max(now - mark["t"], 1e-9)
                    tel.train(_step0 + k + 1, m, lr=self.ex.scalar("lr"), img_per_sec=rate,
                              step_time_ms=1000 * (now - mark["t"]) / n_steps,
                              data_wait_ms=1000 * (self.data_wait - mark["wait"]) / n_steps,
                              loss_scale=self.ex.scalar("loss_scale") if self.ex.fp16 else None,
                              skipped=self.ex.scalar("skipped"))
                    if bar:
                        bar.set_postfix(loss=f"{m['loss']:.4f}", img_s=f"{rate:,.0f}")
                    mark.update(t=now, k=k, wait=self.data_wait)
                    try:
                        self._check_health(_step0 + k + 1)
                    except Exception as e:
                        raise _Stop(_step0 + k + 1, _epoch, error=e) from None
            self.run_steps(sched, "train", step0=step, on_step=on_step, epoch=epoch)
            if bar:
                bar.close()
            self._sync()
            dt = time.perf_counter() - t0
            n_img = sum(s[2] for s in sched)
            step, images, train_time = step + len(sched), images + n_img, train_time + dt
            n = max(totals["count"], 1.0)
            train = {k: totals[k] / n for k in ("loss", "top1", "top5")} | {"count": totals["count"]}
            rec = {"epoch": epoch + 1, "step": step, "train": train,
                   "img_per_sec": n_img / dt, "lr": self.ex.scalar("lr")}
            complete = step == self.steps_before(epoch + 1)
            if complete and pc.trainer.sema_every and pc.ema and (epoch + 1) % pc.trainer.sema_every == 0:
                self.ex.sema_switch()
            if complete and ((epoch + 1) % pc.trainer.val_every == 0 or epoch + 1 == pc.trainer.epochs):
                rec.update(self.validate())
                for name in ("val", "val_ema"):
                    if name in rec:
                        tel.val(step, name, rec[name])
            rec["nonfinite"] = self.ex.scalar("nonfinite")
            rec["skipped"] = self.ex.scalar("skipped")
            history.append(rec)
            self.log(format_epoch(rec))
            last = epoch + 1 == pc.trainer.epochs or (pc.trainer.max_steps and step >= pc.trainer.max_steps)
            if pc.trainer.checkpoint_every and ((epoch + 1) % pc.trainer.checkpoint_every == 0 or last):
                self.save_checkpoint(epoch + 1 if complete else epoch, step, history)
            self.write_metrics(history)
        return step, images, train_time

    def _should_stop(self, guard, at_log: bool) -> bool:
        """A preemption signal stops at a step boundary; with several ranks, all ranks agree
        (at log intervals) so none is left waiting in a collective."""
        if self.dist.world_size <= 1:
            return guard.stop.requested
        if not at_log:
            return False
        flag = torch.tensor([1.0 if guard.stop.requested else 0.0], device=self.device)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        return bool(flag.item())

    def write_metrics(self, history: list, summary: dict | None = None) -> None:
        import json
        if not self.is_main:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        path = self.run_dir / "metrics.json"
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps({"history": _jsonable(history), "summary": _jsonable(summary or {}),
                                   "describe": self.pc.describe()}, indent=1))
        os.replace(tmp, path)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def final_state_dict(self) -> dict[str, torch.Tensor]:
        return self.arena.state_dict_from_arena(self.model, int(self.ex.scalar("step_count")))

    def save_final(self) -> Path:
        from tr_hydra.runtime.distributed import weights_agree
        if not weights_agree(self.dist, self.arena.span(*_W_SPAN)):
            raise RuntimeError("data parallel: the ranks ended with different weights")
        if self.pc.world_size > 1:
            self.log(f"weights identical on all {self.pc.world_size} ranks")
        self.ex.sync_bn_stats()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if not self.is_main:
            return self.run_dir / "model_final.pt"
        path = self.run_dir / "model_final.pt"
        atomic_save(self.final_state_dict(), path)
        return path


def format_epoch(rec: dict) -> str:
    t = rec["train"]
    s = (f"epoch {rec['epoch']:>3}  step {rec['step']:>6}  train loss {t['loss']:.4f} "
         f"top1 {t['top1']:6.2f} top5 {t['top5']:6.2f}  {rec['img_per_sec']:9.1f} img/s  lr {rec['lr']:.4g}")
    for k in ("val", "val_ema"):
        if k in rec:
            v = rec[k]
            s += f"  | {k} loss {v['loss']:.4f} top1 {v['top1']:6.2f} top5 {v['top5']:6.2f}"
    if rec.get("skipped"):
        s += f"  skipped {int(rec['skipped'])}"
    return s
