"""The saved store: whole compiles (``internals.saved_compile``) kept for later runs of the same
plan, one file per key in Inductor's cache directory (``tr_hydra_saved/``).

A file that loaded and stepped in a run is kept under a key of everything its compiled code
depends on (``store_key``). A later run of the same model, shapes, precision and runtime options
(another learning rate, seed or number of epochs; a sweep's next job) loads it and starts no
parallel compile for that variant. The training process compiles its own variant whole as
well, so a later run loads every variant and compiles nothing (its time to the first steps:
``docs/startup.md``). After each run the store is trimmed to ``runtime.saved_store_gb``, least recently used
first; 0 turns it off.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import os
import shutil
import sys
import threading
import time

import torch

from tr_hydra.internals.compile import inductor_map
from tr_hydra.internals.saved_compile import FORMAT, SavedForward, load, save

STORE_DIR = "tr_hydra_saved"  # under Inductor's cache directory
STALE_TMP_S = 3600  # a temporary file this old in the store is a killed write's: trim removes it
# RuntimeSpec fields that do not change what the model's forward compiles to: when, where and
# how many parallel compiles run, cuDNN's search, the warm-up's length (everything else in the
# runtime section is in the key)
_RUNTIME_NOT_KEYED = ("device", "warmup_steps", "precompile", "saved_store_gb")


def store_dir() -> str:
    """``tr_hydra_saved`` in Inductor's cache directory (``TORCHINDUCTOR_CACHE_DIR``, else
    PyTorch's default): the saved compiles live and go with the caches they were made from."""
    from tr_hydra.internals.inductor import cache_dir
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
    the variant's batch, resolution and split, whether coordinate descent tunes it, every runtime option that changes the compile,
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
        "bn_folded": pc.bn_folded, "share_grad16": pc.share_grad16,
        "world_size": pc.world_size, "dist": pc.dist.mode,
        "runtime": {k: val for k, val in dataclasses.asdict(pc.runtime).items() if k not in _RUNTIME_NOT_KEYED},
        "variant": dataclasses.asdict(v), "tuned": pc.tunes(variant), "options": sorted((str(k), repr(o)) for k, o in (options or {}).items()),
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


class KeptCompiles:
    """One run's use of the store: the variants an earlier run kept (``found``: loaded, not
    compiled; loaded on a thread during cuDNN's search by ``preloading``), and, after the
    capture, this run's compiles kept for the next (``keep``) and the store trimmed (``trim``).
    Built only where the store is on (``runtime.saved_store_gb`` > 0) and the model builds on
    the meta device (its digest is in the key)."""

    def __init__(self, store: Store, pc, device: torch.device, digest: str, log=print):
        self.store, self.pc, self.device, self.digest, self.log = store, pc, device, digest, log
        self.keys: dict[str, str] = {}
        self.found: dict[str, str] = {}  # per variant: the file an earlier run kept
        self._preloaded: dict[str, tuple[object, float]] = {}  # per variant: (SavedForward or error, seconds)
        self.from_store: list[str] = []  # the variants loaded from it
        self.preloaded: list[str] = []  # of them, those loaded on the thread
        self.kept: list[str] = []  # the variants this run kept for the next
        self.write_s = 0.0  # seconds writing the compiles made here into it

    @classmethod
    def open(cls, rt, log=print) -> "KeptCompiles | None":
        """The store of ``rt``'s run, or None: off (``saved_store_gb=0``), no cache directory to
        be had, or a model the meta device cannot build (one line says why)."""
        if rt.pc.runtime.saved_store_gb <= 0:
            return None
        from tr_hydra.compiler.compile import instantiate_model
        try:
            store = Store()
            digest = model_digest(instantiate_model(rt.pc, "meta"), rt.pc.model.name)
        except OSError as e:
            log(f"runtime.saved_store_gb: no store ({e.strerror or e})")
            return None
        except Exception as e:  # noqa: BLE001 - the model's own code: compiled, just not kept
            log(f"runtime.saved_store_gb: no store (the model does not build on the meta device: "
                f"{type(e).__name__})")
            return None
        return cls(store, rt.pc, rt.device, digest, log)

    def key(self, v: str) -> str:
        if v not in self.keys:
            self.keys[v] = store_key(self.pc, v, self.device, inductor_map(self.pc.runtime), self.digest)
        return self.keys[v]

    def look_up(self, names: list[str]) -> dict[str, str]:
        """The variants among ``names`` whose compile an earlier run kept; one line names them."""
        self.found = {v: p for v in names if (p := self.store.find(self.key(v)))}
        if self.found:
            self.log(f"saved store: {len(self.found)} of {len(names)} variants' compiles kept by an earlier run "
                     f"({', '.join(self.found)}): loaded, not compiled")
        return self.found

    @contextlib.contextmanager
    def preloading(self, model):
        """While the body runs (cuDNN's search before the warm-up), the kept compiles load on a
        thread; joined at the end."""
        todo = list(self.found.items())
        if not todo:
            yield
            return

        def load_all():
            for v, path in todo:
                t = time.perf_counter()
                try:
                    f = load(path, model, v)
                except Exception as e:  # noqa: BLE001 - reported where the variant warms up
                    f = e
                self._preloaded[v] = (f, time.perf_counter() - t)
        th = threading.Thread(target=load_all, name="tr_hydra-load-saved", daemon=True)
        th.start()
        try:
            yield
        finally:
            th.join()

    def load(self, forwards, v: str) -> float | None:
        """Put the kept compile of ``v`` in place for its steps (``forwards``: the runtime's
        ``Forwards``); the seconds it took here, or None if it did not load (the file is dropped
        and the variant compiled here)."""
        t = time.perf_counter()
        got = self._preloaded.pop(v, None)
        try:
            if got is None:
                forwards.use(v, load(self.found[v], forwards.model, v))
            elif isinstance(got[0], BaseException):
                raise got[0]
            else:
                forwards.use(v, got[0])
                t -= got[1]  # its load, on the thread
                self.preloaded.append(v)
        except Exception as e:  # noqa: BLE001 - the ordinary compile still works
            self.store.drop(self.keys[v])
            self.log(f"  {v}: the compile kept by an earlier run did not load ({type(e).__name__}: "
                     f"{str(e)[:160]}); compiling it here (and dropping that file)")
            return None
        self.store.touch(self.found[v])  # used now: the last one trim drops
        self.from_store.append(v)
        return time.perf_counter() - t

    def forget(self, v: str) -> None:
        """A kept compile that turned out to be made for another input: dropped."""
        if v in self.from_store:
            self.from_store.remove(v)
            self.store.drop(self.keys[v])

    def keep(self, compiled: dict, child_files: dict) -> None:
        """After a capture: keep ``compiled`` (per variant, a SavedForward made whole in this
        process) and ``child_files`` (per variant, the file a child saved, which loaded here),
        skipping what came from the store. A full disk or a compile that does not serialize
        harms no run: the next one compiles it."""
        t = time.perf_counter()
        for v, f in compiled.items():
            try:
                self.store.save(f, self.key(v))
            except Exception as e:  # noqa: BLE001
                why = getattr(e, "strerror", None) or f"{type(e).__name__}: {str(e)[:160]}"
                self.log(f"saved store: {v}'s compile was not kept ({why})")
                continue
            self.kept.append(v)
        self.write_s = time.perf_counter() - t
        for v, path in child_files.items():
            if v in self.found:
                continue
            try:
                self.store.put(path, self.key(v))
            except OSError as e:
                self.log(f"saved store: {v}'s compile was not kept ({e.strerror or e})")
                continue
            self.kept.append(v)

    def trim(self) -> None:
        """The store trimmed to ``runtime.saved_store_gb``, the least recently used compiles
        dropped first, never this run's; one line if any were."""
        gb = self.pc.runtime.saved_store_gb
        n, freed = self.store.trim(int(gb * 1e9), keep=[self.store.path(k) for k in self.keys.values()])
        if n:
            self.log(f"saved store: dropped the {n} least recently used kept compile{'s' if n > 1 else ''} "
                     f"({freed / 1e6:,.0f} MB) to hold it under runtime.saved_store_gb={gb:g}")
