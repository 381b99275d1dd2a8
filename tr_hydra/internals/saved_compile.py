"""A variant's compiled forward and backward saved whole, and loaded without Dynamo.

With Inductor's caches alone, a process still traces each variant another process compiled:
Dynamo runs the model's Python once more, builds guards, then finds the compiled code in the
caches (seconds a variant for ResNet-50). PyTorch can save a whole compile
instead: ``torch.compile(fn, fullgraph=True).aot_compile`` traces and compiles once (the
backward too) and keeps Dynamo's output, the bytecode that calls the compiled code, with the
code itself (``torch.compiler.load_compiled_function`` loads it, in 0.3-1.3 s there, tracing
nothing). A parallel compile's child compiles its variant that way and saves it; the training
process loads the file and calls it in place of the model (``startup``); the saved store keeps
such files for later runs (``startup.store``). The loss keeps its ordinary compile.

The saved function's own guards are not checked: in PyTorch 2.11 a loaded function fails its
tensor guard under autocast (the dispatch keys it recorded leave autocast's out). What they
stand for is checked here instead (``Signature``): the input's shape, strides, dtype and device,
the model's train/eval mode, grad mode and autocast. Everything else the compiled code reads
(the parameters, BatchNorm's statistics) it reads from the model at each call, through the same
bytecode as the ordinary compile, so it sees the arena's views.
"""
from __future__ import annotations

import contextlib
import io
import os
import pickle
import time
from dataclasses import dataclass

import torch

FORMAT = 1  # of the file written by ``save``


@contextlib.contextmanager
def _aot_enabled():
    """``aot_compile`` is behind ``torch._dynamo.config.enable_aot_compile`` in PyTorch 2.11 (on
    by default in later releases)."""
    cfg = torch._dynamo.config
    if hasattr(cfg, "enable_aot_compile"):
        with cfg.patch(enable_aot_compile=True):
            yield
    else:
        yield


@dataclass(frozen=True)
class Signature:
    """What the compiled code was specialized on, beside the model's own tensors."""
    shape: tuple
    stride: tuple
    dtype: str
    device: str
    training: bool
    grad: bool
    autocast: tuple  # (enabled, dtype) for the input's device type

    @classmethod
    def of(cls, model: torch.nn.Module, x: torch.Tensor) -> "Signature":
        kind = x.device.type
        on = torch.is_autocast_enabled(kind)
        cast = str(torch.get_autocast_dtype(kind)) if on else ""
        return cls(tuple(x.shape), tuple(x.stride()), str(x.dtype), str(x.device), bool(model.training),
                   torch.is_grad_enabled(), (on, cast))

    def differs(self, other: "Signature") -> str:
        """'' when alike, else the first field that differs, both ways, in a few words."""
        for k in self.__dataclass_fields__:
            a, b = getattr(self, k), getattr(other, k)
            if a != b:
                return f"{k} {a} (compiled) against {b}"
        return ""


class SavedForward:
    """A model's forward compiled for one input signature, called like the model (``f(x)``)."""

    def __init__(self, fn, model: torch.nn.Module, signature: Signature, name: str = ""):
        self.fn, self.model, self.signature, self.name = fn, model, signature, name

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        got = Signature.of(self.model, x)
        if got != self.signature:
            raise RuntimeError(f"{self.name or 'a saved compile'}: called with another input than it was "
                               f"compiled for: {self.signature.differs(got)}")
        return self.fn(self.model, x)


def compile_forward(model: torch.nn.Module, x: torch.Tensor, options: dict | None = None,
                    name: str = "") -> SavedForward:
    """``model``'s forward compiled whole (fullgraph, static shapes) for ``x`` under the current
    grad mode and autocast, its backward too. Call it like the model."""
    sig = Signature.of(model, x)
    # the parameters' .grad (the arena's gradient views) are left out of the compile: the saved
    # guards would hold them, and a gradient the guards cannot pickle fails the load (PyTorch
    # 2.14). The step takes its gradients from autograd.grad, never from .grad.
    held = [(p, p.grad) for p in model.parameters() if p.grad is not None]
    try:
        for p, _ in held:
            p.grad = None
        with _aot_enabled():
            compiled = torch.compile(model.forward, fullgraph=True, dynamic=False, options=options or None)
            fn = compiled.aot_compile(((x,), {}))
    finally:
        for p, g in held:
            p.grad = g
    return SavedForward(fn, model, sig, name)


def save(f: SavedForward, path: str) -> int:
    """Write ``f`` to ``path`` (whole or not at all); returns the bytes written."""
    from torch._dynamo.aot_compile import AOTCompiledFunction
    data = AOTCompiledFunction.serialize(f.fn).serialized_data
    blob = pickle.dumps({"format": FORMAT, "torch": torch.__version__, "signature": f.signature, "fn": data})
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "wb") as fh:
            fh.write(blob)
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(OSError):
            os.remove(tmp)
    return len(blob)


def load(path: str, model: torch.nn.Module, name: str = "") -> SavedForward:
    """The function ``save`` wrote, bound to ``model`` (the same module structure, on the same
    device). Raises ``ValueError`` for a file of another format or PyTorch."""
    with open(path, "rb") as fh:
        blob = pickle.load(fh)
    if not isinstance(blob, dict) or blob.get("format") != FORMAT:
        raise ValueError(f"{path}: not a saved compile of this tr_hydra")
    if blob["torch"] != torch.__version__:
        raise ValueError(f"{path}: saved by PyTorch {blob['torch']}, not {torch.__version__}")
    from tr_hydra import internals
    with internals.patched():  # its kernels' cache checks, as in a step's own compile
        fn = torch.compiler.load_compiled_function(io.BytesIO(blob["fn"]))
    fn.disable_guard_check()  # see the module's note; Signature stands in for them
    return SavedForward(fn, model, blob["signature"], name)


class Recorder:
    """Compiles the forward of each variant named in ``paths`` whole on its first call; the
    variant's steps then run through it. In a parallel-compile child each is saved to its path
    and loaded back; in the training process (a path of None: its own variants, for
    the saved store) it is used as compiled and kept in ``compiled``, to be saved into
    the store once its graphs are captured (``Store.save``)."""

    def __init__(self, paths: dict[str, str | None], options: dict | None = None, on_compiled=None):
        """``on_compiled()``: called once a compile is done, before its code first runs (as
        Dynamo's compile-end callbacks are, which a whole compile does not call)."""
        self.paths = dict(paths)
        self.options = options
        self.on_compiled = on_compiled
        self.seconds: dict[str, float] = {}  # per variant: compile (and save)
        self.bytes: dict[str, int] = {}
        self.errors: dict[str, str] = {}
        self.compiled: dict[str, SavedForward] = {}  # the variants compiled with no path

    def forward(self, variant: str, model: torch.nn.Module, x: torch.Tensor) -> SavedForward | None:
        """The variant's forward compiled whole (saved, and loaded back from the file, where it
        has a path); None where any of that failed (the error is kept: the step then compiles
        as usual, filling the caches, and the training process traces the variant and finds
        its code there)."""
        t = time.perf_counter()
        path = self.paths.pop(variant)
        try:
            f = compile_forward(model, x, self.options, variant)
            if path is None:
                self.compiled[variant] = f
                return f
            self.bytes[variant] = save(f, path)
            # loaded back, as the training process will: what cannot be loaded is not left for
            # it (it would compile the variant again, its caches holding no ordinary compile);
            # the step here runs the loaded function
            f = load(path, model, variant)
        except Exception as e:  # noqa: BLE001 - any failure: the ordinary compile still works
            self.errors[variant] = f"{type(e).__name__}: {e}"[:300]
            if path is not None:
                with contextlib.suppress(OSError):
                    os.remove(path)
            return None
        finally:
            self.seconds[variant] = round(time.perf_counter() - t, 2)
            if self.on_compiled is not None:
                self.on_compiled()
        return f

    def report(self) -> dict:
        """For the child's summary line: seconds and bytes per variant saved, and any errors."""
        return {"saved_s": self.seconds, "saved_bytes": self.bytes,
                **({"saved_errors": self.errors} if self.errors else {})}
