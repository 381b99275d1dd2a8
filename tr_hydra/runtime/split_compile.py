"""A training variant's backward compiled in a process of its own, beside its forward.

Inductor compiles a training graph's forward and then its backward, one after the other, in one
Python thread: on the H200's host, a ResNet-50 training variant's forward took 13-15 s of
Inductor's time and its backward 8-9 s, and those compiles decide when the first steps come.
The backward cannot simply be compiled first elsewhere: AOTAutograd gives the backward's
inputs the strides that the compiled forward chose for the tensors it saves, and those strides
are part of the backward's cache key. But Inductor chooses them when it lowers the forward's
graph, before it generates any code, and generating the code is most of a compile.

So a backward twin (``backward_only``) traces the step as usual, lowers the forward only as far
as its output strides, hands them to AOTAutograd as a compiled forward would, skips the
forward's code, and compiles the backward at once. Its backward lands in Inductor's FX graph
cache, where the process compiling the whole variant finds it when it reaches its own backward
(``waits_for_twin``: it waits for the twin while the twin runs, then loads the backward instead
of compiling it). The twin saves nothing else: not its forward (there is none), and no
AOTAutograd cache entry (that one names the forward too); the whole variant's process saves
that entry, with both halves, as before. Nothing the twin does is ever run.

A lock file says whether the twin runs: the twin holds it (``hold``) from its start to its end,
which the kernel ends for it if the process dies, however it dies.
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import threading
import time

TWIN_WAIT_S = 600.0  # a whole variant's process waits at most this long for its twin


class ForwardSkipped(Exception):
    """Raised where a backward twin's step would run its forward, whose code was never made."""


def supported() -> str:
    """"" where this PyTorch has what a twin uses, else what it lacks."""
    try:
        import torch._functorch.config as fc
        import torch._inductor.compile_fx as cfx
        import torch.fx.experimental.symbolic_shapes as ss
        from torch._inductor import utils as iu
        from torch._inductor.graph import GraphLowering
    except Exception as e:  # noqa: BLE001 - no Inductor
        return f"Inductor does not import ({type(e).__name__})"
    for ok, what in ((hasattr(ss, "SymExprPrinter"), "symbolic_shapes.SymExprPrinter"),
                     (hasattr(cfx, "_compile_fx_inner"), "compile_fx._compile_fx_inner"),
                     (hasattr(GraphLowering, "compile_to_module"), "GraphLowering.compile_to_module"),
                     (hasattr(iu, "set_tracing_context_output_strides"), "utils.set_tracing_context_output_strides"),
                     (hasattr(fc, "force_non_lazy_backward_lowering"), "functorch's force_non_lazy_backward_lowering"),
                     (hasattr(fc, "enable_autograd_cache"), "functorch's enable_autograd_cache")):
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


@contextlib.contextmanager
def backward_only():
    """Within it, every training graph's forward that Inductor compiles is lowered, not
    generated, and its callable raises ``ForwardSkipped``; the backward is compiled at once
    (not at the first backward call) and saved in the FX graph cache; AOTAutograd's cache is
    neither read nor written. Inference graphs compile as usual. Restores everything after."""
    import torch._functorch.config as fc
    import torch._inductor.compile_fx as cfx
    from torch._inductor import utils as iu
    from torch._inductor.graph import GraphLowering

    orig_inner, orig_to_module = cfx._compile_fx_inner, GraphLowering.compile_to_module
    state = threading.local()

    def to_module(self, *a, **k):
        if getattr(state, "forward", False):
            state.outputs = output_strides(self.graph_outputs)
            raise ForwardSkipped("forward lowered for its output strides only")
        return orig_to_module(self, *a, **k)

    def skipped(args):
        raise ForwardSkipped("a backward twin's forward is not run")
    skipped._boxed_call = True  # AOTAutograd calls compiled code with the list of inputs

    def inner(gm, example_inputs, *a, **kw):
        if kw.get("is_backward") or kw.get("is_inference"):
            return orig_inner(gm, example_inputs, *a, **kw)
        state.forward, state.outputs = True, None
        try:
            # found in the cache (another process compiled the whole variant first): Inductor
            # has given AOTAutograd its output strides; the step is not run here either way
            orig_inner(gm, example_inputs, *a, **kw)
            return skipped
        except Exception:  # noqa: BLE001 - Inductor wraps it in its own error
            if state.outputs is None:  # a real failure, not the skip
                raise
            strides = state.outputs
        finally:
            state.forward = False
        from types import SimpleNamespace
        iu.set_tracing_context_output_strides(example_inputs, SimpleNamespace(output_strides=strides))
        return skipped

    saved = (fc.force_non_lazy_backward_lowering, fc.enable_autograd_cache)
    cfx._compile_fx_inner, GraphLowering.compile_to_module = inner, to_module
    fc.force_non_lazy_backward_lowering, fc.enable_autograd_cache = True, False
    try:
        yield
    finally:
        cfx._compile_fx_inner, GraphLowering.compile_to_module = orig_inner, orig_to_module
        fc.force_non_lazy_backward_lowering, fc.enable_autograd_cache = saved


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
    """The whole variant's side: if the twin holding ``path`` has started and not ended, block
    until it ends (at most ``timeout`` s). Returns the seconds waited, or None where there was
    no twin to wait for (never started, no file)."""
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


@contextlib.contextmanager
def waits_for_twin(path: str, waited: list | None = None, timeout: float = TWIN_WAIT_S):
    """Within it, before Inductor compiles a backward graph, wait for the twin of ``path``
    (``wait_for``), so that the compile finds the twin's backward in the cache. The seconds
    waited are appended to ``waited``. Restores Inductor after."""
    import torch._inductor.compile_fx as cfx
    orig_inner = cfx._compile_fx_inner

    def inner(gm, example_inputs, *a, **kw):
        if kw.get("is_backward"):
            w = wait_for(path, timeout)
            if w is not None and waited is not None:
                waited.append(w)
        return orig_inner(gm, example_inputs, *a, **kw)

    cfx._compile_fx_inner = inner
    try:
        yield
    finally:
        cfx._compile_fx_inner = orig_inner
