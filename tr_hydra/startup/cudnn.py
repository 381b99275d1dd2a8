"""cuDNN's algorithm search, done before the first step.

With ``torch.backends.cudnn.benchmark``, the first call of a convolution with a new shape times
every candidate plan, on one workspace as large as the largest candidate asks for (PyTorch's
``generate_and_filter_plans``; tens of MiB for some of CIFAR ResNet-18's backward convolutions). Inside the first step that workspace is allocated while every
activation is alive, so it sets the run's peak memory. Here each convolution the steps will run
is run once, alone, on tensors of its shape, before the first step: the search then happens with
only the arena alive, and the step finds its plan in cuDNN's cache. That cache is keyed by the
shapes, dtype, memory format and pointer alignment of the tensors and by the convolution's
parameters, not by the data, so the plan found is the one the step would have found.

Which convolutions the steps run is found by running the model on the meta device (no memory,
no compute) under a dispatch mode that records every ``aten.convolution`` and
``aten.convolution_backward`` call: the forward and backward of each training variant, the
forward of each validation variant.

With Inductor, the search can start before the first compile (``BeforeFirstRun``). PyTorch keeps
cuDNN's search results per thread (``thread_local BenchmarkCache`` in ATen's ``Conv_v8.cpp``), so
a search on another thread does not serve the steps. But what makes the first search of a
process slow is process-wide: loading cuDNN's kernels (several times slower on a
freshly started machine). So a thread runs the search while the main thread compiles the first
variant (Dynamo, AOTAutograd and Inductor work on fake tensors and run no convolution; cuDNN
releases the GIL while it times its candidates), and the main thread runs it again, now with
everything loaded, when Dynamo finishes that compile: its compile-end callback runs after the
backend has compiled the graph and before the compiled code first runs, so the steps still find
every plan cached and the workspaces still come before any activation.

A first variant compiled whole (``aot_compile``, for the saved store) calls no
compile-end callback: its recorder calls ``BeforeFirstRun.compiled()`` instead. One loaded from
the store compiles nothing, so the search is done on the calling thread before the warm-up.
Splitting the search ahead over several threads does not shorten it: cuDNN's loading is serial
in the process (``docs/startup.md``)."""
from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass

import torch
import torch.nn as nn
from tr_hydra.internals.dispatch import DispatchMode
from tr_hydra.internals.dynamo import end_callbacks

aten = torch.ops.aten


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype

    @staticmethod
    def of(t: torch.Tensor) -> "TensorSpec":
        return TensorSpec(tuple(t.shape), tuple(t.stride()), t.dtype)

    def make(self, device: torch.device) -> torch.Tensor:
        """A tensor of this shape and layout holding small normal values (not uninitialised
        memory: NaNs or denormals could change which plan times fastest)."""
        t = torch.empty_strided(self.shape, self.stride, dtype=self.dtype, device=device)
        return t.normal_(0.0, 0.5) if t.is_floating_point() else t.zero_()

    @property
    def nbytes(self) -> int:
        if not self.shape:
            return torch.empty((), dtype=self.dtype).element_size()
        span = 1 + sum((n - 1) * s for n, s in zip(self.shape, self.stride) if n > 0)
        return span * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class ConvCall:
    """One convolution (``backward``: the gradients ``output_mask`` asks for) as the step runs it."""
    backward: bool
    x: TensorSpec
    w: TensorSpec
    stride: tuple[int, ...]
    padding: tuple[int, ...]
    dilation: tuple[int, ...]
    transposed: bool
    output_padding: tuple[int, ...]
    groups: int
    bias: TensorSpec | None = None                 # forward
    grad_out: TensorSpec | None = None             # backward
    bias_sizes: tuple[int, ...] | None = None      # backward
    output_mask: tuple[bool, bool, bool] | None = None  # backward

    def run(self, device: torch.device) -> None:
        """Run it once on ``device``. A backward runs through autograd, as the step's does: cuDNN
        keeps its plans per thread, and the backward of a CUDA tensor runs on autograd's thread
        for that device, so a ``convolution_backward`` called here would fill this thread's
        cache and leave the step's backward to search again."""
        x, w = self.x.make(device), self.w.make(device)
        geometry = (list(self.stride), list(self.padding), list(self.dilation), self.transposed,
                    list(self.output_padding), self.groups)
        if not self.backward:
            b = self.bias.make(device) if self.bias is not None else None
            aten.convolution.default(x, w, b, *geometry)
            return
        want_x, want_w, want_b = self.output_mask
        b = None
        if want_b:
            b = torch.zeros(self.bias_sizes, dtype=self.w.dtype, device=device, requires_grad=True)
        with torch.enable_grad():
            y = aten.convolution.default(x.requires_grad_(want_x), w.requires_grad_(want_w), b, *geometry)
        torch.autograd.backward(y, self.grad_out.make(device))


def _ints(v) -> tuple[int, ...]:
    return tuple(int(i) for i in v)


class _Recorder(DispatchMode):
    def __init__(self):
        super().__init__()
        self.calls: list[ConvCall] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is aten.convolution.default:
            x, w, b, stride, padding, dilation, transposed, out_pad, groups = args
            self.calls.append(ConvCall(False, TensorSpec.of(x), TensorSpec.of(w), _ints(stride),
                                       _ints(padding), _ints(dilation), bool(transposed), _ints(out_pad),
                                       int(groups), bias=TensorSpec.of(b) if b is not None else None))
        elif func is aten.convolution_backward.default:
            g, x, w, bias_sizes, stride, padding, dilation, transposed, out_pad, groups, mask = args
            self.calls.append(ConvCall(True, TensorSpec.of(x), TensorSpec.of(w), _ints(stride),
                                       _ints(padding), _ints(dilation), bool(transposed), _ints(out_pad),
                                       int(groups), grad_out=TensorSpec.of(g),
                                       # only a bias gradient needs them (else None or [0])
                                       bias_sizes=_ints(bias_sizes) if mask[2] else None,
                                       output_mask=tuple(bool(m) for m in mask)))
        return func(*args, **kwargs)


def _meta_like(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    dt = dtype if t.is_floating_point() else t.dtype
    return torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=dt, device="meta")


def record(model: nn.Module, batch: int, channels: int, res: int, dtype: torch.dtype, train: bool,
           channels_last: bool = True, memo: bool = True) -> list[ConvCall]:
    """The convolutions one step of ``model`` runs on a ``batch`` of ``res``² images, in order
    (duplicates included): found on the meta device, with every parameter and buffer replaced
    by a meta tensor of its shape and layout in the compute ``dtype`` (what autocast gives the
    convolutions), so ``model`` itself is not touched."""
    state = {n: _meta_like(p, dtype) for n, p in model.named_parameters()}
    state.update({n: _meta_like(b, dtype) for n, b in model.named_buffers()})
    x = torch.empty(batch, channels, res, res, device="meta", dtype=dtype)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    params = [state[n] for n, _ in model.named_parameters()]
    rec = _Recorder()
    from tr_hydra.compiler.analysis import MetaMemo
    fast = MetaMemo() if memo else contextlib.nullcontext()  # entered after rec: consulted first
    was = model.training
    model.train(train)
    try:
        if train:
            for p in params:
                p.requires_grad_(True)
            with rec, fast:
                out = torch.func.functional_call(model, state, (x,), strict=False)
                torch.autograd.grad(out, params, torch.ones_like(out), allow_unused=True)
        else:
            with torch.no_grad(), rec, fast:
                torch.func.functional_call(model, state, (x,), strict=False)
    finally:
        model.train(was)
    return rec.calls


def unique(calls: list[ConvCall]) -> list[ConvCall]:
    return list(dict.fromkeys(calls))


@dataclass
class PrimeReport:
    calls: int = 0          # distinct convolutions run
    seconds: float = 0.0
    largest_bytes: int = 0  # the largest call's tensors (its workspace comes on top)
    in_first_compile: bool = False  # BeforeFirstRun: done at the end of the first compile (so
    # inside the first variant's warm-up), after a thread's search beside that compile:
    ahead_seconds: float = 0.0  # the thread's search
    waited: float = 0.0     # BeforeFirstRun: how long the main thread then waited for the thread
    ahead_error: str = ""   # BeforeFirstRun: why the thread's search failed ("" if it did not)


def prime(calls: list[ConvCall], device: torch.device, stop: threading.Event | None = None) -> PrimeReport:
    """Run each distinct call once on ``device`` (on the current stream), tensors freed after
    each, so that cuDNN's search for it is done and its plan cached; ``stop``, once set, ends it
    after the call in progress."""
    t0 = time.perf_counter()
    todo = unique(calls)
    largest = done = 0
    for c in todo:
        if stop is not None and stop.is_set():
            break
        specs = [c.x, c.w, c.grad_out, c.bias]
        largest = max(largest, sum(s.nbytes for s in specs if s is not None))
        c.run(device)
        done += 1
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return PrimeReport(done, time.perf_counter() - t0, largest)


def searches(device: torch.device) -> bool:
    """Whether convolutions on ``device`` search for their plan (cuDNN with benchmark on)."""
    return (device.type == "cuda" and torch.backends.cudnn.enabled and torch.backends.cudnn.is_available()
            and torch.backends.cudnn.benchmark and not torch.backends.cudnn.deterministic)


def can_search_ahead() -> bool:
    return end_callbacks() is not None


class BeforeFirstRun:
    """The search for ``calls`` started on a thread now, on ``device`` and ``stream`` (loading
    cuDNN for the process), then done on the calling thread, whose cache the steps use, when
    Dynamo next finishes a compile there, before the compiled code runs: ``main_search()``, once,
    after waiting for the thread. ``close()`` returns the main search's report (``ahead_seconds``
    and ``waited`` filled in), or None if no compile came, and raises what the main search
    raised; nothing is raised inside Dynamo."""

    def __init__(self, calls: list[ConvCall], device: torch.device, stream, main_search):
        reg_rem = end_callbacks()
        if reg_rem is None:
            raise RuntimeError("this PyTorch has no Dynamo compile-end callback")
        self._reg, self._rem = reg_rem
        self._main_search = main_search
        self.report: PrimeReport | None = None
        self._ahead: PrimeReport | None = None
        self._error: BaseException | None = None
        self._waited = 0.0
        self._done = False
        self._owner = threading.get_ident()
        self._ahead_error = ""
        self._stop = threading.Event()
        # a new thread starts on device 0 and ``torch.cuda.set_device`` needs an index, which
        # ``torch.device("cuda")`` does not carry: take the owner's
        index = (device.index if device.index is not None else torch.cuda.current_device()) \
            if device.type == "cuda" else None

        def ahead():
            try:
                if index is not None:
                    torch.cuda.set_device(index)
                    with torch.cuda.stream(stream):
                        self._ahead = prime(calls, device, stop=self._stop)
                else:
                    self._ahead = prime(calls, device, stop=self._stop)
            except Exception as e:  # noqa: BLE001 - only a head start: the main search runs regardless
                self._ahead = None
                self._ahead_error = f"{type(e).__name__}: {e}".splitlines()[0]
        self._thread = threading.Thread(target=ahead, name="tr_hydra-cudnn-ahead", daemon=True)
        self._cb = self._reg(self._on_compile_end)
        self._thread.start()

    def compiled(self) -> None:
        """A compile Dynamo's callbacks do not hear of (a whole compile, ``aot_compile``) ended
        on this thread, before its code first runs: the same as Dynamo's compile-end callback."""
        self._on_compile_end()

    def _on_compile_end(self, *_args) -> None:
        if self._done or threading.get_ident() != self._owner:  # another thread's compile
            return
        self._done = True
        t = time.perf_counter()
        self._thread.join()
        self._waited = time.perf_counter() - t
        try:
            self.report = self._main_search()
        except BaseException as e:  # noqa: BLE001 - raised at close(), not inside Dynamo
            self._error = e

    def close(self) -> PrimeReport | None:
        """Ends the job: no compile-end search after this, and the thread is stopped (after the
        convolution in progress) and joined, so none of its device work overlaps what comes
        next (a CUDA graph capture must see no other thread's work)."""
        try:
            self._rem(self._cb)
        except ValueError:  # already gone
            pass
        self._stop.set()
        self._thread.join()
        if self._error is not None:
            e, self._error = self._error, None
            raise e
        if self.report is not None:
            self.report.in_first_compile = True
            self.report.ahead_seconds = self._ahead.seconds if self._ahead is not None else 0.0
            self.report.waited = self._waited
            self.report.ahead_error = self._ahead_error
        return self.report


# ---------------------------------------------------------------- for a runtime's variants
# the model forwards this process has compiled with a search ahead: Dynamo keeps a compiled
# forward per code object, so a later runtime of the same model in this process (a sweep's next
# job) may reuse it and compile nothing, and a search waiting for a compile would never run
_COMPILED_FORWARDS: set = set()


def calls_of(rt, log=print, phases: dict | None = None) -> list[ConvCall] | None:
    """Every variant's convolutions, recorded on the meta device, or None (nothing searches:
    CPU, deterministic, or a model the meta device cannot run). The seconds it took are added
    to ``phases["record_convs"]``."""
    pc = rt.pc
    if not searches(rt.device):
        return None
    dt = rt.arena.half_dtype if pc.amp else torch.float32
    calls = []
    t = time.perf_counter()
    try:
        for v in pc.variants:
            calls += record(rt.model, v.batch, pc.data.channels, v.res, dt, v.train)
    except Exception as e:  # noqa: BLE001 - the steps search for themselves, as without this
        why = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), type(e).__name__)
        log(f"cuDNN search: the model does not run on the meta device ({why}); "
            f"cuDNN searches inside the first steps instead")
        return None
    finally:
        if phases is not None:
            phases["record_convs"] = phases.get("record_convs", 0.0) + time.perf_counter() - t
    return calls


def search(rt, calls: list[ConvCall]) -> PrimeReport:
    """cuDNN's search for ``calls`` on this thread, on the stream the warm-up and capture use."""
    from tr_hydra.runtime.graphs import capture_stream
    if rt.device.type != "cuda":
        return prime(calls, rt.device)
    stream = capture_stream(rt.device)
    stream.wait_stream(torch.cuda.current_stream(rt.device))
    with torch.cuda.stream(stream):
        return prime(calls, rt.device)


def say(rep: PrimeReport | None, log=print) -> PrimeReport | None:
    if rep is None:
        return None
    where = "before the first step"
    if rep.in_first_compile:
        where = (f"at the end of the first compile, after a thread's search beside it "
                 f"({rep.ahead_seconds:.1f}s, waited {rep.waited:.1f}s),")
        if rep.ahead_error:
            where = f"at the end of the first compile (the thread's search beside it failed: {rep.ahead_error}),"
    log(f"cuDNN searched {rep.calls} convolutions {where} in {rep.seconds:.1f}s")
    return rep


def search_now(rt, log=print, phases: dict | None = None) -> PrimeReport | None:
    """cuDNN's search for every convolution the steps run, done now, with only the arena alive,
    instead of inside the first step of each variant, where its workspace comes on top of every
    activation. The report, or None when nothing searches."""
    calls = calls_of(rt, log, phases)
    return None if calls is None else say(search(rt, calls), log)


def search_ahead(rt, whole_first: bool, log=print, phases: dict | None = None) -> BeforeFirstRun | None:
    """With Inductor: a ``BeforeFirstRun`` for every variant's convolutions, or None (nothing to
    search, no compile-end callback in this PyTorch, or no compile sure to come before the first
    variant's convolutions run). ``whole_first``: the first variant is compiled whole here (its
    recorder tells the job: ``BeforeFirstRun.compiled``), so a compile is sure to come."""
    if not rt.inductor or not can_search_ahead():
        return None
    if rt.forwards.dropped:  # its compiled code was dropped: a compile will come
        _COMPILED_FORWARDS.clear()
    if not whole_first:
        code = getattr(type(rt.model).forward, "__code__", None)
        if code is None or code in _COMPILED_FORWARDS:
            return None
        _COMPILED_FORWARDS.add(code)
    calls = calls_of(rt, log, phases)  # on the meta device, before Dynamo touches the model
    if calls is None:
        return None
    from tr_hydra.runtime.graphs import capture_stream
    stream = capture_stream(rt.device)
    stream.wait_stream(torch.cuda.current_stream(rt.device))
    return BeforeFirstRun(calls, rt.device, stream, lambda: search(rt, calls))


def settle(job: BeforeFirstRun, log=print) -> PrimeReport | None:
    """End the search ahead (its thread stopped and joined) and report it."""
    try:
        rep = job.close()
    except torch.cuda.OutOfMemoryError:
        raise
    except Exception as e:  # noqa: BLE001 - the steps searched for themselves instead
        why = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), type(e).__name__)
        log(f"cuDNN search: the search at the end of the first compile failed ({why}); "
            f"cuDNN searched inside the first steps instead")
        return None
    if rep is None:
        log("cuDNN search: no compile came in the warm-up; cuDNN searched inside the first steps")
    return say(rep, log)
