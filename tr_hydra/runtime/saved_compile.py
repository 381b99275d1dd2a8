"""A variant's compiled forward and backward saved whole by its parallel compile, and loaded by
the training process without Dynamo.

With the caches alone (``precompile``), the training process still traces each variant the
children compiled: Dynamo runs the model's Python once more, builds guards, then finds the
compiled code in the caches. For ResNet-50 on the H200's host a variant's warm-up took 1.9-3.4 s
that way, one variant after another, after the children are done: about 13 s of the cold
six-variant mix's 62 s to the first steps.

PyTorch can save a whole compile instead: ``torch.compile(fn, fullgraph=True).aot_compile``
traces and compiles once (the backward too) and keeps Dynamo's output, the bytecode that calls
the compiled code, with the code itself (``torch.compiler.load_compiled_function`` loads it).
Loading that took 0.3-1.3 s there, and traces nothing (the five loaded variants' warm-ups took
4.5 s in all, and the first steps came after 50.8 s against 62.4 s; session ad).

Here a child compiles its variant's forward that way, saves it, loads it back and runs its step
through what it loaded (Triton's autotuning and cuDNN's share happen there as before). The training process loads the
file when it reaches the variant and calls it in place of the model. The loss keeps its
ordinary compile (a small graph, loaded from the caches).

The saved function's own guards are not checked: in PyTorch 2.11 a loaded function fails its
tensor guard under autocast (the dispatch keys it recorded leave autocast's out). What they
stand for is checked here instead (``Signature``): the input's shape, strides, dtype and device,
the model's train/eval mode, grad mode and autocast. Everything else the compiled code reads
(the parameters, BatchNorm's statistics) it reads from the model at each call, through the same
bytecode as the ordinary compile, so it sees the arena's views.

A file that loaded and stepped is kept for later runs (``runtime.saved_store``, see ``Store``):
under a key of everything its compiled code depends on, in Inductor's cache directory. A later
run of the same model, shapes, precision and runtime options (another learning rate, seed or
number of epochs; a sweep's next job) loads it and starts no parallel compile for that variant.
With the store, the training process compiles its own variants (its first one) whole as well
(``Recorder`` with no path) and keeps them once their graphs are captured, so a later run loads
every variant and compiles nothing (H200, ResNet-50's six variants warm: 17.8-18.9 s to the
first steps against 21.2-24.0 s with the first one compiled from the caches; session af).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import io
import json
import os
import pickle
import shutil
import sys
import time
from dataclasses import dataclass

import torch

FORMAT = 1  # of the file written by ``save``


def supported() -> str:
    """'' where this PyTorch can save a whole compiled function and load it, else why not."""
    try:
        from torch._dynamo.aot_compile import AOTCompiledFunction
    except Exception:  # noqa: BLE001 - older releases: no such module
        return "this PyTorch has no torch._dynamo.aot_compile"
    if not hasattr(torch.compiler, "load_compiled_function"):
        return "this PyTorch has no torch.compiler.load_compiled_function"
    if not hasattr(AOTCompiledFunction, "disable_guard_check"):
        return "this PyTorch's saved functions always check their guards"
    return ""


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
        from tr_hydra.runtime import compile_gc
        with _aot_enabled(), compile_gc.compiling():  # runtime.compile_gc: not a Dynamo-heard compile
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
    fn = torch.compiler.load_compiled_function(io.BytesIO(blob["fn"]))
    fn.disable_guard_check()  # see the module's note; Signature stands in for them
    return SavedForward(fn, model, blob["signature"], name)


class Recorder:
    """Compiles the forward of each variant named in ``paths`` whole on its first call; the
    variant's steps then run through it. In a parallel-compile child each is saved to its path
    and loaded back; in the training process (a path of None: its own variants, for
    ``runtime.saved_store``) it is used as compiled and kept in ``compiled``, to be saved into
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


# ---------------------------------------------------------------- the store (runtime.saved_store)
STORE_DIR = "tr_hydra_saved"  # under Inductor's cache directory
STALE_TMP_S = 3600  # a temporary file this old in the store is a killed write's: trim removes it
# RuntimeSpec fields that do not change what the model's forward compiles to: when, where and
# how many parallel compiles run, cuDNN's search, the warm-up's length (everything else in the
# runtime section is in the key)
_RUNTIME_NOT_KEYED = ("device", "warmup_steps", "precompile", "precompile_first", "precompile_own", "precompile_start",
                      "precompile_saved", "saved_store", "saved_store_gb", "prime_cudnn", "autotune_flush",
                      "cudnn_benchmark_limit", "compile_gc")


def store_dir() -> str:
    """``tr_hydra_saved`` in Inductor's cache directory (``TORCHINDUCTOR_CACHE_DIR``, else
    PyTorch's default): the saved compiles live and go with the caches they were made from."""
    try:
        from torch._inductor.runtime.cache_dir_utils import cache_dir
    except ImportError:  # older layouts
        from torch._inductor.runtime.runtime_utils import cache_dir
    return os.path.join(cache_dir(), STORE_DIR)


@functools.lru_cache(maxsize=None)
def source_digest() -> str:
    """A hash of tr_hydra's own Python source: a saved compile is code traced from it (the
    models, the stem, the max-pool), so any change to it makes a new key."""
    import tr_hydra
    root = os.path.dirname(os.path.abspath(tr_hydra.__file__))
    h = hashlib.sha256()
    for dirpath, dirnames, files in os.walk(root):
        dirnames.sort()
        for f in sorted(files):
            if f.endswith(".py"):
                p = os.path.join(dirpath, f)
                h.update(os.path.relpath(p, root).encode() + b"\0")
                with open(p, "rb") as fh:
                    h.update(fh.read() + b"\0")
    return h.hexdigest()[:20]


# packages whose code the key covers already: by their versions, and tr_hydra by its source
_KEYED_PACKAGES = ("torch", "torchvision", "tr_hydra")


def model_digest(model: torch.nn.Module, name: str) -> str:
    """A hash of the model as its builder made it (before tr_hydra's own changes, which the
    runtime options in the key decide): its structure (``repr``), and the source files of its
    module classes and of the builder registered as ``name`` that lie outside PyTorch,
    torchvision and tr_hydra (a model registered from the user's own code)."""
    from tr_hydra.models.registry import model_builder
    h = hashlib.sha256(repr(model).encode())
    files = set()
    for obj in [type(m) for m in model.modules()] + [model_builder(name)]:
        mod = sys.modules.get(getattr(obj, "__module__", None) or "")
        path = getattr(mod, "__file__", None)
        if path and mod.__name__.split(".")[0] not in _KEYED_PACKAGES:
            files.add(os.path.abspath(path))
    for path in sorted(files):
        h.update(path.encode() + b"\0")
        with contextlib.suppress(OSError), open(path, "rb") as fh:
            h.update(fh.read())
    return h.hexdigest()[:20]


def _version(module: str) -> str:
    try:
        return str(__import__(module).__version__)
    except Exception:  # noqa: BLE001 - not installed
        return ""


def store_key(pc, variant: str, device: torch.device, options: dict | None = None, model: str = "") -> str:
    """The key of ``variant``'s saved compile: a hash of what its compiled code depends on. The
    model (its spec, input channels and ``model``: its ``model_digest``), precision, the folded BatchNorm, the optimizer's name,
    the variant's batch, resolution and split, every runtime option that changes the compile,
    Inductor's options, the device, the versions of Python, PyTorch, torchvision and Triton,
    and tr_hydra's own source (``source_digest``). Not in it: learning rates and the rest of
    the optimizer's numbers, the schedule, epochs, seeds, the data's location and
    augmentation, logging (none of them reaches the forward's compiled code)."""
    v = pc.variant(variant)
    key = {
        "format": FORMAT, "source": source_digest(),
        "versions": {"python": "%d.%d.%d" % sys.version_info[:3], "torch": torch.__version__,
                     "cuda": str(torch.version.cuda), "torchvision": _version("torchvision"),
                     "triton": _version("triton")},
        "device": str(device),
        "device_kind": (torch.cuda.get_device_name(device), list(torch.cuda.get_device_capability(device)))
        if device.type == "cuda" else device.type,
        "model": dataclasses.asdict(pc.model) | {"init_from": None}, "model_digest": model,
        "channels": pc.data.channels,
        "optimizer": pc.optimizer.name, "amp": pc.amp, "amp_dtype": pc.amp_dtype, "ema": pc.ema,
        "bn_folded": pc.bn_folded, "share_grad16": pc.share_grad16, "pad_last_val": pc.pad_last_val,
        "world_size": pc.world_size, "dist": pc.dist.mode,
        "runtime": {k: val for k, val in dataclasses.asdict(pc.runtime).items() if k not in _RUNTIME_NOT_KEYED},
        "variant": dataclasses.asdict(v), "options": sorted((str(k), repr(o)) for k, o in (options or {}).items()),
    }
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=repr).encode()).hexdigest()[:32]


class Store:
    """Saved compiles kept for later runs, one file per key (``store_key``) in ``root``."""

    def __init__(self, root: str | None = None):
        self.root = root or store_dir()

    def path(self, key: str) -> str:
        return os.path.join(self.root, f"{key}.forward")

    def find(self, key: str) -> str | None:
        """The file kept under ``key``, or None."""
        p = self.path(key)
        return p if os.path.isfile(p) else None

    def put(self, src: str, key: str) -> str:
        """Keep a copy of the file ``src`` under ``key`` (whole or not at all: a run that reads
        it at the same time sees the old file or the new one)."""
        os.makedirs(self.root, exist_ok=True)
        dst = self.path(key)
        tmp = f"{dst}.{os.getpid()}.tmp"
        try:
            shutil.copyfile(src, tmp)
            os.replace(tmp, dst)
        finally:
            with contextlib.suppress(OSError):
                os.remove(tmp)
        return dst

    def save(self, f: SavedForward, key: str) -> int:
        """Keep ``f`` (a whole compile made in this process) under ``key``; returns the bytes
        written (whole or not at all, as ``put``)."""
        os.makedirs(self.root, exist_ok=True)
        return save(f, self.path(key))

    def touch(self, path: str) -> None:
        """Mark the kept file ``path`` as used now (a run loaded it): ``trim`` drops it last."""
        with contextlib.suppress(OSError):
            os.utime(path)

    def trim(self, max_bytes: int, keep=()) -> tuple[int, int]:
        """Drop the least recently used files (written, or loaded: ``touch``) until the store
        holds at most ``max_bytes``, never those in ``keep`` (this run's); returns how many
        files and bytes were dropped. A run that found a dropped file before it went and cannot
        load it compiles that variant instead."""
        keep = {os.path.abspath(p) for p in keep}
        files = []
        stale = time.time() - STALE_TMP_S
        with contextlib.suppress(OSError), os.scandir(self.root) as it:
            for e in it:
                with contextlib.suppress(OSError):
                    if e.name.endswith(".forward") and e.is_file():
                        st = e.stat()
                        files.append((st.st_mtime, st.st_size, e.path))
                    elif e.name.endswith(".tmp") and e.is_file() and e.stat().st_mtime < stale:
                        os.remove(e.path)  # a write that a killed process left half done
        total = sum(size for _, size, _ in files)
        dropped = freed = 0
        for _, size, path in sorted(files):
            if total <= max_bytes:
                break
            if os.path.abspath(path) in keep:
                continue
            try:
                os.remove(path)
            except OSError:
                continue
            total -= size
            dropped += 1
            freed += size
        return dropped, freed

    def drop(self, key: str) -> None:
        """Forget ``key``'s file (one that did not load: the next run compiles it again)."""
        with contextlib.suppress(OSError):
            os.remove(self.path(key))
