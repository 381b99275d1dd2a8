"""tr-prepare's work: a source (image folder, digits, arrays) written once as webdataset shards
(``data/shards.py`` says how they are read), every image at most ``max_side`` pixels on its
longer side and JPEG-encoded at ``quality``.

Shard k of a split holds the source's samples k*S .. (k+1)*S-1 in the source's fixed order
(ImageFolder's: classes by name, files by name), S = ``shard_samples``; processes write whole
shards in parallel. A shard is written under a temporary name, fsynced and renamed, then its
sidecar (``.json``: where each sample lies, SHA-256) is written the same way: a shard with a
sidecar whose checksum holds is finished, and a run started again keeps it. ``prepare.json``
(the settings and the source, written first) makes a run refuse a dir prepared otherwise;
``index.json`` (written last) makes the dir readable by ``data=shards``: it holds the checksums
of the shards and of ``<split>.npz`` (the labels), and the ``data`` settings the source was
composed with (``shards.recorded_data``). One run at a time writes a dir (a lock on it).

A source image over ``MAX_PIXELS`` (PIL's own default limit, 89.5 megapixels: 268 MB decoded)
is undecodable, as a damaged file is: its header is read, never its pixels."""
from __future__ import annotations

import hashlib
import io
import json
import math
import multiprocessing as mp
import os
import signal
import sys
import tarfile
import time
import warnings
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from tr_hydra.data.index import SplitIndex, load_arrays, scan_imagefolder
from tr_hydra.data.shards import FORMAT, INDEX, RECORDED, SPLITS, sample_key, sha256_file, shard_name
from tr_hydra.errors import ConfigError, TrHydraError
from tr_hydra.files import hold_dir, write_atomic

MANIFEST = "prepare.json"
MAX_PIXELS = 89_478_485  # PIL's Image.MAX_IMAGE_PIXELS default, fixed here: a larger source is refused


class CorruptSource(TrHydraError):
    """A source image that cannot be decoded (without prepare.skip_corrupt)."""


class Undecodable(TrHydraError):
    """Why ``encode`` cannot take a source file, in words (no file name: the caller names it)."""


@dataclass(frozen=True)
class Settings:
    max_side: int = 320       # the longer side, at most; smaller images keep their size
    quality: int = 90         # JPEG quality of re-encoded images
    shard_samples: int = 5000


@dataclass
class Source:
    """What is prepared: each split's samples, the class names, and a description of the
    source that a later run compares (``prepare.json``)."""
    splits: dict[str, SplitIndex]
    classes: list[str]
    names: dict[str, list[str]]  # per split: each sample's name for messages
    describe: dict
    data: dict = field(default_factory=dict)  # the data settings it was composed with (index.json's "data")


def _plain(v):
    """A config value as JSON holds it: enums by value, sequences as lists."""
    v = getattr(v, "value", v)
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    return [_plain(x) for x in v]


def _size(path: str) -> int:
    """A source file's size for the digest; -1 where it cannot be read (a symbolic link to
    nothing, or to itself): the file is then reported as undecodable, as any other."""
    try:
        return os.path.getsize(path)
    except OSError:
        return -1


def open_source(data) -> Source:
    """The source of ``data`` (a composed ``data`` config: imagefolder, digits or arrays)."""
    name = str(getattr(data.name, "value", data.name))
    if name in ("imagefolder", "digits"):
        root = data.root
        if name == "digits":
            from tr_hydra.data.digits import ensure_digits
            root = ensure_digits(data.cache_dir)
        if not root:
            raise ConfigError("data.root: required for data=imagefolder")
        root = Path(root).resolve()
        train, classes = scan_imagefolder(root, "train")
        val, _ = scan_imagefolder(root, "val", classes)
        splits = {"train": train, "val": val}
        names = {s: [os.path.relpath(p, root) for p in idx.paths] for s, idx in splits.items()}
        digest = {s: hashlib.sha256("".join(f"{n}\t{_size(p)}\n" for n, p in zip(names[s], idx.paths)).encode())
                  .hexdigest() for s, idx in splits.items()}
        where = {"root": str(root)}
    elif name == "arrays":
        if not data.path:
            raise ConfigError("data.path: required for data=arrays")
        splits = load_arrays(data.path, 2**31 - 1)
        classes = [str(c) for c in range(int(max(int(s.labels.max()) for s in splits.values() if len(s)) + 1))]
        names = {s: [f"{s} sample {i}" for i in range(len(idx))] for s, idx in splits.items()}
        digest = {s: hashlib.sha256(idx.images.tobytes() + idx.labels.tobytes()).hexdigest() for s, idx in splits.items()}
        where = {"path": str(Path(data.path).resolve())}
    else:
        raise ConfigError(f"data={name}: tr-prepare reads data=imagefolder, digits or arrays")
    describe = {"data": name, **where,
                "splits": {s: {"count": len(idx), "digest": digest[s]} for s, idx in splits.items()}}
    record = {"name": name} | {k: _plain(getattr(data, k, None)) for k in RECORDED}
    return Source(splits, classes, names, describe, {k: v for k, v in record.items() if v is not None})


def encode(source, max_side: int, quality: int) -> bytes:
    """One image as the shards hold it: RGB JPEG, longer side at most ``max_side`` (EXIF
    orientation applied, as DALI's decoder applies it). A JPEG that needs no change is kept
    byte for byte (after a full decode proves it sound): no second loss of quality. A file that
    cannot be read, that PIL does not recognise, or over ``MAX_PIXELS``: ``Undecodable``."""
    from PIL import Image, ImageOps, UnidentifiedImageError
    raw = None
    if isinstance(source, np.ndarray):
        im = Image.fromarray(source)
    else:
        try:
            with open(source, "rb") as f:
                raw = f.read()
        except OSError as e:
            link = " (a symbolic link)" if os.path.islink(source) else ""
            raise Undecodable(f"cannot be read{link}: {e.strerror or type(e).__name__}") from None
        with warnings.catch_warnings():  # the size is checked below, in words
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            try:
                im = Image.open(io.BytesIO(raw))
            except UnidentifiedImageError:  # PIL's message names the BytesIO, not the file
                raise Undecodable("not an image: PIL recognises no image format in it") from None
            except Image.DecompressionBombError:  # over 2 x PIL's limit: PIL gives no size
                raise Undecodable(f"more than {2 * MAX_PIXELS / 1e6:.0f} megapixels, over prepare's cap of "
                                  f"{MAX_PIXELS / 1e6:.1f}") from None
    w, h = im.size
    if w * h > MAX_PIXELS:
        raise Undecodable(f"{w} x {h} pixels, {w * h / 1e6:.0f} megapixels, more than prepare's cap of "
                          f"{MAX_PIXELS / 1e6:.1f}")
    scale = max_side / max(w, h)
    if scale < 1 and im.format == "JPEG":  # decode at a reduced scale where the DCT allows it
        im.draft("RGB", (math.ceil(w * scale), math.ceil(h * scale)))
    upright = im.getexif().get(0x0112, 1) == 1
    if raw is not None and im.format == "JPEG" and scale >= 1 and upright and im.mode in ("RGB", "L"):
        im.load()
        return raw
    im = ImageOps.exif_transpose(im).convert("RGB")
    if max(im.size) > max_side:
        im.thumbnail((max_side, max_side), Image.Resampling.LANCZOS)
    out = io.BytesIO()
    im.save(out, "JPEG", quality=quality)
    return out.getvalue()


class _Hashing:
    """A file tarfile writes through, hashed on the way."""

    def __init__(self, f):
        self.f, self.h, self.n = f, hashlib.sha256(), 0

    def write(self, b) -> int:
        self.h.update(b)
        self.n += len(b)
        return self.f.write(b)

    def tell(self) -> int:
        return self.n


def _member(tar: tarfile.TarFile, name: str, data: bytes) -> int:
    """Add ``name`` (fixed owner, mode and time: the same input makes the same bytes); returns
    the offset of its data in the archive."""
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = len(data), 0o644, 0
    tar.addfile(info, io.BytesIO(data))
    return tar.offset - 512 * math.ceil(len(data) / 512)


def _reason(e: BaseException) -> str:
    """Why a source image failed, in one line without object reprs."""
    if isinstance(e, Undecodable):
        return str(e)
    if isinstance(e, OSError) and e.strerror:
        return f"{type(e).__name__}: {e.strerror}"
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}".rstrip(": ")


# the source, set in the parent before the workers start (inherited by fork, or sent once)
_WORK: dict = {}


def _init(work: dict) -> None:
    """A worker's start. Forked, it holds a copy of the parent's lock on ``out``: closed, so that
    a worker left behind by a killed tr-prepare cannot keep the dir locked; and on Linux it is
    killed with its parent (PR_SET_PDEATHSIG) instead of waiting for work that never comes."""
    if work.get("lock") is not None:
        os.close(work["lock"])
    if sys.platform.startswith("linux"):
        import ctypes
        try:
            ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
    if os.getppid() != work["parent"]:  # the parent died before that
        os._exit(1)
    _WORK.update(work)


def _make_shard(job: tuple[str, int, int, int]) -> dict:
    """Write shard ``number`` of ``split`` (source samples start..stop-1); its sidecar dict, or
    ``{"corrupt": [...]}`` without ``skip_corrupt`` (nothing written)."""
    split, number, start, stop = job
    w = _WORK
    idx, names, s = w["source"].splits[split], w["source"].names[split], w["settings"]
    d = w["out"] / split
    path = d / shard_name(number)
    tmp = d / f".{path.name}.tmp"
    samples, sources, skipped = [], [], []
    try:
        with open(tmp, "wb") as f:
            hf = _Hashing(f)
            with tarfile.open(fileobj=hf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
                for i in range(start, stop):
                    src = idx.images[i] if idx.images is not None else idx.paths[i]
                    try:
                        data = encode(src, s.max_side, s.quality)
                    except Exception as e:  # noqa: BLE001 - any decoder failure is a corrupt source
                        skipped.append([names[i], _reason(e)])
                        if not w["skip_corrupt"]:
                            break
                        continue
                    key, label = sample_key(i), int(idx.labels[i])
                    offset = _member(tar, f"{key}.jpg", data)
                    _member(tar, f"{key}.cls", f"{label}".encode())
                    samples.append([i, label, offset, len(data)])
                    sources.append(names[i])
            if skipped and not w["skip_corrupt"]:
                raise CorruptSource()
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except CorruptSource:
        tmp.unlink(missing_ok=True)
        return {"corrupt": skipped}
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    side = {"name": path.name, "bytes": hf.n, "sha256": hf.h.hexdigest(), "samples": samples,
            "sources": sources, "skipped": skipped}
    write_atomic(d / f"{path.name}.json", json.dumps(side).encode(), what="prepare")
    return side


def _finished(out: Path, split: str, number: int) -> dict | None:
    """A shard's sidecar where the shard is there and matches it (size and SHA-256)."""
    path = out / split / shard_name(number)
    try:
        side = json.loads((path.parent / f"{path.name}.json").read_text())
        if path.stat().st_size == side["bytes"] and sha256_file(path) == side["sha256"]:
            return side
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return None


def _drop_partial(out: Path) -> None:
    """The temporary files of shards and sidecars a stopped run was writing (never read)."""
    for split in SPLITS:
        for tmp in (out / split).glob("*.tmp"):
            tmp.unlink(missing_ok=True)


def check_out(out: Path, manifest: dict) -> None:
    """``out`` may be used: new or empty, or holding this same preparation (to go on with)."""
    if not out.exists():
        return
    if not out.is_dir():
        raise ConfigError(f"prepare.out={out} is not a directory")
    mpath = out / MANIFEST
    if not mpath.is_file():
        finished = (out / INDEX).is_file()
        if finished or any(any((out / split).glob("shard-*.tar*")) for split in SPLITS):
            what = f"a finished preparation ({INDEX} and shards)" if finished else "tr-prepare shards"
            raise ConfigError(f"prepare.out={out} holds {what} but no {MANIFEST} (the settings and source they were "
                              f"made from, written first: deleted?), so this run cannot tell whether they are its own: "
                              + (f"data=shards data.root={out} reads it as it is; " if finished else "")
                              + "to prepare again, delete that dir or pick another prepare.out")
        if any(out.iterdir()):
            raise ConfigError(f"prepare.out={out} is not empty and holds no tr-prepare output: pick a new or empty dir")
        return
    try:
        there = json.loads(mpath.read_text())
    except (OSError, ValueError):
        there = {}
    diffs = [f"{k} {there.get('settings', {}).get(k)!r} there, {v!r} here" for k, v in manifest["settings"].items()
             if there.get("settings", {}).get(k) != v]
    src, src_there = manifest["source"], there.get("source", {})
    diffs += [f"source {k} {src_there.get(k)!r} there, {v!r} here" for k, v in src.items()
              if k != "splits" and src_there.get(k) != v]
    for split, v in src["splits"].items():
        t = src_there.get("splits", {}).get(split, {})
        if t != v:
            diffs.append(f"{split} split {t.get('count')} samples there, {v['count']} here"
                         + (" (the same count, other files)" if t.get("count") == v["count"] else ""))
    if diffs:
        raise ConfigError(f"prepare.out={out} holds another preparation ({'; '.join(diffs)}): "
                          f"pick another prepare.out, or delete that one")


def _hold(out: Path) -> int:
    """An exclusive lock on ``out`` (made if need be, its parents too) before anything is
    written: a second tr-prepare into the same dir stops at once, naming the holder's pid
    (``DirInUse``), where two runs would delete each other's temporary files. Where the lock
    cannot be taken, the dirs made here are removed; where another run holds it, the dir is
    that run's (it opened it after this one made it) and is left to it."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"prepare.out={out} is not a directory")
    made = [p for p in (out, *out.parents) if not p.exists()]
    try:
        out.mkdir(parents=True, exist_ok=True)
        return hold_dir(out, "prepare.out")  # DirInUse: another run holds it (not an OSError)
    except OSError:
        for p in made:
            try:
                p.rmdir()
            except OSError:
                break
        raise


def prepare(data, out: str | Path, settings: Settings, workers: int, skip_corrupt: bool,
            log=print, progress=None) -> dict:
    """Write (or finish) the preparation of ``data`` (a data config, or the ``Source`` that
    ``open_source`` already made of it) in ``out``; returns what was done. ``progress(n)``:
    called as images are done. ``out`` is locked while this runs (``_hold``)."""
    out = Path(out).resolve()
    source = data if isinstance(data, Source) else open_source(data)
    lock = _hold(out)
    try:
        return _prepare(source, out, settings, workers, skip_corrupt, log, progress, lock)
    finally:
        os.close(lock)


def _prepare(source: Source, out: Path, settings: Settings, workers: int, skip_corrupt: bool, log, progress,
             lock: int) -> dict:
    manifest = {"format": FORMAT, "settings": asdict(settings), "source": source.describe,
                "classes": source.classes}
    check_out(out, manifest)
    if not (out / MANIFEST).is_file():  # first, so that a dir with anything else in it is known as ours
        write_atomic(out / MANIFEST, json.dumps(manifest, indent=1).encode(), what="prepare")
    for split in SPLITS:
        (out / split).mkdir(exist_ok=True)
    s = settings.shard_samples
    jobs = [(split, k, k * s, min((k + 1) * s, len(source.splits[split])))
            for split in SPLITS for k in range(math.ceil(len(source.splits[split]) / s))]
    sides, todo = {}, []
    for job in jobs:
        side = _finished(out, job[0], job[1])
        if side is not None:
            sides[job[:2]] = side
            if progress:
                progress(job[3] - job[2])
        else:
            todo.append(job)
    if sides:
        log(f"prepare: {len(sides)} of {len(jobs)} shards already written and checked; kept")
    t0, done_images = time.perf_counter(), sum(j[3] - j[2] for j in todo)
    work = {"source": source, "settings": settings, "out": out, "skip_corrupt": skip_corrupt, "lock": lock,
            "parent": os.getpid()}
    _drop_partial(out)  # what a killed run was writing
    try:
        if todo:
            _run(todo, work, workers, sides, log, progress)
    finally:
        _drop_partial(out)  # the shards stopped mid-write (an error, Ctrl-C): never read, not kept
    seconds = time.perf_counter() - t0
    skipped = sum(len(sides[j[:2]]["skipped"]) for j in todo)
    return _write_index(out, source, manifest, jobs, sides) | {
        "images_read": done_images, "images_written": done_images - skipped, "seconds": seconds, "workers": workers,
        "img_per_sec": done_images / seconds if seconds > 0 and done_images else None}


def _run(todo: list, work: dict, workers: int, sides: dict, log, progress) -> None:
    """The jobs on ``workers`` processes, their sidecars taken in order into ``sides``. A worker
    that dies (the OOM killer's SIGKILL) breaks the pool: one line, not a wait for a result that
    never comes. On any error the other workers are stopped, not waited for."""
    ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
    if ctx.get_start_method() != "fork":
        work = work | {"lock": None}  # a spawned worker inherits no descriptor
    pool = ProcessPoolExecutor(max(1, min(workers, len(todo))), mp_context=ctx, initializer=_init, initargs=(work,))
    procs, done, broken = [], False, False
    try:
        results = pool.map(_make_shard, todo)
        procs = list((getattr(pool, "_processes", None) or {}).values())  # to say how one died
        for job, side in zip(todo, results):
            if "corrupt" in side:
                name, why = side["corrupt"][0]
                raise ConfigError(f"prepare: cannot decode {name} ({why}); set prepare.skip_corrupt=true "
                                  f"to skip such files (finished shards are kept: run again to go on)")
            for name, why in side["skipped"]:
                log(f"prepare: skipped {name}: {why}")
            sides[job[:2]] = side
            if progress:
                progress(job[3] - job[2])
        done = True
    except BrokenProcessPool:
        broken = True
    finally:
        if not done and not broken:
            for p in procs:
                p.terminate()
        pool.shutdown(wait=True, cancel_futures=True)
    if broken:
        for p in procs:
            p.join(5)
        raise ConfigError(f"prepare: a worker process died ({_died(procs)}); the finished shards are kept: "
                          f"run the same command again to go on")


def _died(procs) -> str:
    """How a worker of a broken pool ended: the first exit that is not the pool's own SIGTERM."""
    codes = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
    code = next((c for c in codes if c != -signal.SIGTERM), codes[0] if codes else None)
    if code is None:
        return "it ended abruptly"
    if code < 0:
        sig = signal.Signals(-code)
        return f"killed by signal {-code}, {sig.name}" + (": out of memory?" if sig == signal.SIGKILL else "")
    return f"exit code {code}"


def _write_index(out: Path, source: Source, manifest: dict, jobs: list, sides: dict) -> dict:
    """``<split>.npz`` (where every sample lies), then ``index.json``: the dir is finished."""
    splits, skipped = {}, {}
    for split in SPLITS:
        mine = [sides[j[:2]] for j in jobs if j[0] == split]
        table = {"shard": [], "number": [], "label": [], "offset": [], "size": [], "source": []}
        for k, side in enumerate(mine):
            for (number, label, offset, size), name in zip(side["samples"], side["sources"]):
                for col, v in zip(("shard", "number", "label", "offset", "size", "source"),
                                  (k, number, label, offset, size, name)):
                    table[col].append(v)
        types = {"shard": np.int32, "number": np.int64, "label": np.int32, "offset": np.int64, "size": np.int64}
        arrays = {c: np.asarray(v, dtype=types.get(c, str)) for c, v in table.items()}
        buf = io.BytesIO()
        np.savez(buf, **arrays)
        blob = buf.getvalue()
        write_atomic(out / f"{split}.npz", blob, what="prepare")
        skipped[split] = [x for side in mine for x in side["skipped"]]
        splits[split] = {"count": len(arrays["label"]), "skipped": len(skipped[split]),
                         "table": {"name": f"{split}.npz", "bytes": len(blob),
                                   "sha256": hashlib.sha256(blob).hexdigest()},
                         "shards": [{"name": sd["name"], "samples": len(sd["samples"]), "bytes": sd["bytes"],
                                     "sha256": sd["sha256"]} for sd in mine]}
    index = {"format": FORMAT, "classes": source.classes, "splits": splits, "settings": manifest["settings"],
             "source": manifest["source"], "skipped_sources": skipped, "data": source.data}
    write_atomic(out / INDEX, json.dumps(index, indent=1).encode(), what="prepare")
    return {"splits": {s: {k: v for k, v in m.items() if k not in ("shards", "table")} | {"shards": len(m["shards"])}
                       for s, m in splits.items()}}
