"""A training variant's backward compiled in a process of its own beside its forward: a twin.

Inductor compiles a training graph's forward and then its backward, one after the other, in one
Python thread; for ResNet-50 the backward is about a quarter of the variant's compile (8.9 of
36.0 s lowered on a CPU). Where the host has cores to spare (a short run: one training variant
compiling beside the training process's validation variant), a twin takes the backward.

The backward cannot simply be compiled first elsewhere: AOTAutograd gives the backward's inputs
the strides that the compiled forward chose for the tensors it saves, and those strides are part
of the backward's cache key. But Inductor chooses them when it lowers the forward's graph, before
it generates any code, and generating the code is most of a compile. So the twin
(``backward_only``) traces the variant as its parallel compile does (``saved_compile``: a whole
compile), lowers the forward only as far as its output strides, hands them to AOTAutograd as a
compiled forward would, and compiles the backward into Inductor's FX graph cache. The variant's
own process (``from_twin``) waits for the twin when it reaches its backward and finds it there.

A whole compile bundles its graphs for saving and, for that, reads and writes no FX graph cache
(``bundled_autograd_cache``); both sides compile their backward with it off, so the backward is
looked up as an ordinary compile's is. What the variant's process then saves is the same code;
where the twin's backward is not found (another key, the twin failed), it compiles its own.

A lock file says whether the twin runs: the twin holds it (``hold``) from its start to its end,
which the kernel ends for it if the process dies, however it dies.
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import threading
import time
from types import SimpleNamespace

TWIN_WAIT_S = 600.0  # a variant's process waits at most this long for its twin


class ForwardSkipped(Exception):
    """Raised where a twin's step would run its forward, whose code was never made."""


def supported() -> str:
    """'' where this PyTorch has what a twin uses, else what it lacks."""
    try:
        import torch._inductor.compile_fx as cfx
        import torch.fx.experimental.symbolic_shapes as ss
        from torch._inductor import utils as iu
        from torch._inductor.graph import GraphLowering
    except Exception as e:  # noqa: BLE001 - no Inductor
        return f"Inductor does not import ({type(e).__name__})"
    for ok, what in ((hasattr(ss, "SymExprPrinter"), "symbolic_shapes.SymExprPrinter"),
                     (hasattr(cfx, "_compile_fx_inner"), "compile_fx._compile_fx_inner"),
                     (hasattr(GraphLowering, "compile_to_module"), "GraphLowering.compile_to_module"),
                     (hasattr(iu, "set_tracing_context_output_strides"), "utils.set_tracing_context_output_strides")):
        if not ok:
            return f"this PyTorch has no {what}"
    return ""


def output_strides(graph_outputs) -> list:
    """The strides of a lowered graph's outputs, as Inductor's compiled graph records them
    (``CompiledFxGraph.output_strides``: strings of sizes' expressions, None where an output
    is no tensor)."""
    from torch._inductor.ir import IRNode
    from torch.fx.experimental.symbolic_shapes import SymExprPrinter, free_unbacked_symbols
    p = SymExprPrinter()  # as Inductor prints them, for AOTAutograd to read back
    out = []
    for o in graph_outputs or ():
        if isinstance(o, IRNode) and o.has_tensor_output() and not free_unbacked_symbols(o.get_stride()):
            out.append(tuple(p.doprint(s) for s in o.get_layout().stride))
        else:
            out.append(None)
    return out


def _unbundled():
    """The FX graph cache read and written even within a whole compile (see the module's note)."""
    import torch._functorch.config as fc
    return fc.patch(bundled_autograd_cache=False) if hasattr(fc, "bundled_autograd_cache") else contextlib.nullcontext()


@contextlib.contextmanager
def _inner_patched(make):
    """Inductor's ``_compile_fx_inner`` replaced by ``make(original)`` within the block."""
    import torch._inductor.compile_fx as cfx
    orig = cfx._compile_fx_inner
    cfx._compile_fx_inner = make(orig)
    try:
        yield
    finally:
        cfx._compile_fx_inner = orig


@contextlib.contextmanager
def backward_only():
    """Within it, every training graph's forward that Inductor compiles is lowered, not
    generated, and its callable raises ``ForwardSkipped``; the backward is compiled and saved in
    the FX graph cache. Inference graphs compile as usual. The whole compile around them then
    fails or returns code that raises; nothing the twin compiles is ever run."""
    from torch._inductor import utils as iu
    from torch._inductor.graph import GraphLowering

    orig_to_module = GraphLowering.compile_to_module
    state = threading.local()

    def to_module(self, *a, **k):
        if getattr(state, "forward", False):
            state.outputs = output_strides(self.graph_outputs)
            raise ForwardSkipped("forward lowered for its output strides only")
        return orig_to_module(self, *a, **k)

    def skipped(args):
        raise ForwardSkipped("a twin's forward is not run")
    skipped._boxed_call = True  # AOTAutograd calls compiled code with the list of inputs

    def make(orig):
        def inner(gm, example_inputs, *a, **kw):
            if kw.get("is_backward"):
                with _unbundled():
                    return orig(gm, example_inputs, *a, **kw)
            if kw.get("is_inference"):
                return orig(gm, example_inputs, *a, **kw)
            state.forward, state.outputs = True, None
            try:
                orig(gm, example_inputs, *a, **kw)
                return skipped  # found whole in a cache: AOTAutograd has its strides already
            except Exception:  # noqa: BLE001 - Inductor wraps the skip in its own error
                if state.outputs is None:  # a real failure, not the skip
                    raise
                strides = state.outputs
            finally:
                state.forward = False
            iu.set_tracing_context_output_strides(example_inputs, SimpleNamespace(output_strides=strides))
            return skipped
        return inner

    GraphLowering.compile_to_module = to_module
    try:
        with _inner_patched(make):
            yield
    finally:
        GraphLowering.compile_to_module = orig_to_module


@contextlib.contextmanager
def from_twin(path: str, waited: list | None = None, timeout: float = TWIN_WAIT_S):
    """Within it, before Inductor compiles a backward graph, wait for the twin holding ``path``
    (``wait_for``; the seconds go into ``waited``), then compile it through the FX graph cache,
    where the twin left it."""
    def make(orig):
        def inner(gm, example_inputs, *a, **kw):
            if not kw.get("is_backward"):
                return orig(gm, example_inputs, *a, **kw)
            w = wait_for(path, timeout)
            if w is not None and waited is not None:
                waited.append(w)
            with _unbundled():
                return orig(gm, example_inputs, *a, **kw)
        return inner

    with _inner_patched(make):
        yield


_HELD: list[int] = []  # the descriptors of the locks this process holds, open to its end


def hold(path: str) -> int:
    """The twin's side: take ``path``'s lock for the rest of the process and say so in the file.
    Returns the descriptor (kept open here); the lock goes when the process ends."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.write(fd, f"{os.getpid()}\n".encode())
    os.fsync(fd)
    _HELD.append(fd)
    return fd


def wait_for(path: str, timeout: float = TWIN_WAIT_S, poll: float = 0.05) -> float | None:
    """The variant's side: if the twin holding ``path`` has started and not ended, block until
    it ends (at most ``timeout`` s). Returns the seconds waited, or None where there was no twin
    to wait for (never started, no file)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    t0 = time.monotonic()
    try:
        if os.fstat(fd).st_size == 0:  # the twin writes after it has the lock: not started
            return None
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                return time.monotonic() - t0
            except BlockingIOError:
                if time.monotonic() - t0 >= timeout:
                    return time.monotonic() - t0
                time.sleep(poll)
    finally:
        os.close(fd)
