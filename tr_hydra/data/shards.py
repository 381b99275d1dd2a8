"""Prepared shards (``tr-prepare``, ``data=shards``): each split as webdataset tar shards
(``<key>.jpg`` + ``<key>.cls``), with an index that says where each sample's JPEG bytes lie.

Reading: every shard is mapped into memory and the host feeds DALI each sample's bytes through
``external_source``, in the order the host decides, exactly as for an image folder: the same
(seed, epoch) order, the same share per rank, the same partial last batch, the same resumable
positions (a checkpoint's sample position means the same sample). DALI's own webdataset reader
would read shards in sequence through a shuffle buffer: another order, and positions it cannot
resume at. The bytes of a sample are contiguous in its tar, so feeding them costs one copy.

Layout of a prepared dir: ``index.json`` (written last: a dir without it is unfinished),
``<split>.npz`` (per sample: shard, byte offset, size, label, source name) and
``<split>/shard-000000.tar`` ... Every shard's SHA-256 is in index.json; a shard is checked once
and then again whenever its size or modification time changes. The ``<split>.npz`` tables (the
labels a run trains on) are checked against their SHA-256 in index.json each time they are read.
index.json's ``data`` holds the data settings the source was composed with (``recorded_data``)."""
from __future__ import annotations

import hashlib
import io
import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from tr_hydra.errors import ConfigError

FORMAT = "tr_hydra-shards/1"
INDEX = "index.json"
SPLITS = ("train", "val")
# what the data is, recorded from the source's composed ``data`` (not where or how it is read)
RECORDED = ("num_classes", "channels", "mean", "std", "augment", "crop_scale", "crop_ratio", "flip", "val_crop")


def shard_name(number: int) -> str:
    return f"shard-{number:06d}.tar"


def sample_key(number: int) -> str:
    """A sample's key in its shard: its number in the split's fixed order."""
    return f"{number:09d}"


def sha256_file(path: Path, chunk: int = 8 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            b = f.read(chunk)
            if not b:
                return h.hexdigest()
            h.update(b)


def read_index(root: str | Path) -> dict:
    """index.json of a finished preparation; one line where there is none or it is damaged."""
    path = Path(root) / INDEX
    if not Path(root).is_dir():
        raise ConfigError(f"data.root: {root} does not exist")
    if not path.is_file():
        raise ConfigError(f"data.root: {root} holds no finished preparation (no {INDEX}; tr-prepare "
                          f"writes it last): run tr-prepare with prepare.out={root} to finish it")
    try:
        index = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"data.root: {path} cannot be read ({type(e).__name__}: {e})") from None
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise ConfigError(f"data.root: {path} is not a tr-prepare index (format "
                          f"{index.get('format') if isinstance(index, dict) else None!r}, expected {FORMAT!r})")
    return index


def recorded_data(root: str | Path) -> dict:
    """The ``data.*`` settings (``RECORDED``: the number of classes, channels, normalisation
    and augmentation) that the source prepared in ``root`` was composed with, for
    a ``data=shards`` run to take as its defaults; {} where there is none (no finished
    preparation there, one written before this record was kept, a damaged index.json). Never
    raises: the run's own checks report a bad dir."""
    try:
        index = json.loads((Path(root) / INDEX).read_text())
        rec = index.get("data") if index.get("format") == FORMAT else None
        return {k: rec[k] for k in RECORDED if k in rec} if isinstance(rec, dict) else {}
    except Exception:  # noqa: BLE001 - anything unreadable is "no record"
        return {}


def split_counts(root: str | Path) -> tuple[int, int]:
    index = read_index(root)
    return int(index["splits"]["train"]["count"]), int(index["splits"]["val"]["count"])


class _Samples:
    """A split's samples as the pipelines take them: the JPEG bytes of sample ``i`` (a view of
    its mapped shard), and a name for messages (``train/shard-000003.tar:000012345.jpg, from
    <source file>``). Shards are mapped on first use, so a process maps only what it reads."""

    def __init__(self, root: Path, split: str, shards: list[str], table):
        self.root, self.split, self.shards = root, split, shards
        self.shard, self.offset, self.size = table["shard"], table["offset"], table["size"]
        self.number, self.source = table["number"], table["source"]
        self._maps: dict[int, np.memmap] = {}

    def blob(self, i: int) -> np.ndarray:
        s = int(self.shard[i])
        m = self._maps.get(s)
        if m is None:
            m = self._maps[s] = np.memmap(self.root / self.split / self.shards[s], dtype=np.uint8, mode="r")
        o = int(self.offset[i])
        return m[o:o + int(self.size[i])]

    def name(self, i: int) -> str:
        return (f"{self.split}/{self.shards[int(self.shard[i])]}:{sample_key(int(self.number[i]))}.jpg "
                f"(from {self.source[i]})")


class Names:
    """``SplitIndex.paths`` for shards: names made when asked, not a million strings up front."""

    def __init__(self, samples: _Samples, ids: np.ndarray | None = None):
        self.samples, self.ids = samples, ids

    def __len__(self) -> int:
        return len(self.ids) if self.ids is not None else len(self.samples.shard)

    def __getitem__(self, i):
        return self.samples.name(int(self.ids[i]) if self.ids is not None else int(i))

    def subset(self, keep: np.ndarray) -> "Names":
        return Names(self.samples, keep if self.ids is None else self.ids[keep])


def verify(root: Path, index: dict, log=print, stamps: Path | None = None) -> None:
    """Every shard's SHA-256 against index.json; one line naming the first that fails. A shard
    whose (size, modification time) was checked before is not read again (``stamps``: where
    that is kept, outside the data dir, which may be read-only)."""
    from tr_hydra.bytecode import cache_root
    stamps = stamps or cache_root() / "shards_checked.json"
    try:
        known = json.loads(stamps.read_text())
    except (OSError, ValueError):
        known = {}
    todo = []
    for split in SPLITS:
        for sh in index["splits"][split]["shards"]:
            p = (root / split / sh["name"]).resolve()
            try:
                st = p.stat()
            except OSError as e:
                raise ConfigError(f"data: shard {p} cannot be read: {e.strerror}") from None
            if st.st_size != sh["bytes"]:
                raise ConfigError(f"data: shard {p} has {st.st_size:,} bytes, its index says {sh['bytes']:,}: "
                                  f"it changed after tr-prepare wrote it; run tr-prepare again (it redoes it)")
            if known.get(str(p)) != [st.st_size, st.st_mtime_ns, sh["sha256"]]:
                todo.append((p, st, sh["sha256"]))
    if not todo:
        return
    gb = sum(st.st_size for _, st, _ in todo) / 1e9
    log(f"data: checking the SHA-256 of {len(todo)} shard{'s' if len(todo) != 1 else ''} ({gb:,.2f} GB), once")
    with ThreadPoolExecutor(max(1, min(len(todo), os.cpu_count() or 1))) as pool:
        got = list(pool.map(lambda t: sha256_file(t[0]), todo))
    for (p, st, want), have in zip(todo, got):
        if have != want:
            raise ConfigError(f"data: shard {p} fails its SHA-256 check (index {want[:12]}..., file {have[:12]}...): "
                              f"it changed after tr-prepare wrote it; run tr-prepare again (it redoes it)")
        known[str(p)] = [st.st_size, st.st_mtime_ns, want]
    try:
        stamps.parent.mkdir(parents=True, exist_ok=True)
        tmp = stamps.with_name(f".{stamps.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(known))
        os.replace(tmp, stamps)
    except OSError:  # checked again next time: slower, never wrong
        pass


def _checked_table(path: Path, want) -> bytes:
    """The bytes of ``<split>.npz`` (the labels, where each sample lies), checked against its size
    and SHA-256 in index.json: a table changed, cut short or from an index that has no checksum
    of it is one line, never labels trained on unchecked. tr-prepare run again rewrites it."""
    again = f"run tr-prepare again with prepare.out={path.parent} and the same settings (it keeps the shards " \
            f"and rewrites {path.name})"
    if not (isinstance(want, dict) and isinstance(want.get("sha256"), str) and isinstance(want.get("bytes"), int)):
        raise ConfigError(f"data.root: {path.parent / INDEX} holds no checksum of {path.name} (written by an "
                          f"older tr-prepare): {again}")
    try:
        data = path.read_bytes()
    except OSError as e:
        raise ConfigError(f"data.root: {path} cannot be read ({e.strerror or type(e).__name__}): {again}") from None
    if len(data) != want["bytes"]:
        raise ConfigError(f"data.root: {path} has {len(data):,} bytes, its index says {want['bytes']:,}: it "
                          f"changed after tr-prepare wrote it (cut short?); {again}")
    have = hashlib.sha256(data).hexdigest()
    if have != want["sha256"]:
        raise ConfigError(f"data.root: {path} fails its SHA-256 check (index {want['sha256'][:12]}..., file "
                          f"{have[:12]}...): it changed after tr-prepare wrote it; {again}")
    return data


def load_shards(root: str | Path, log=print):
    """({split: (labels, names, blob)}, class names) of a prepared dir, every shard checked:
    ``SplitIndex``'s labels, ``paths`` (names for messages) and ``blob`` (a sample's bytes)."""
    root = Path(root)
    index = read_index(root)
    verify(root, index, log)
    out = {}
    for split in SPLITS:
        meta = index["splits"][split]
        path = root / f"{split}.npz"
        try:
            with np.load(io.BytesIO(_checked_table(path, meta.get("table"))), allow_pickle=False) as z:
                table = {k: z[k] for k in ("shard", "offset", "size", "label", "number", "source")}
        except (OSError, ValueError, KeyError) as e:
            raise ConfigError(f"data.root: {path} cannot be read ({type(e).__name__}: {e}); "
                              f"run tr-prepare again") from None
        if len(table["label"]) != meta["count"]:
            raise ConfigError(f"data.root: {path} lists {len(table['label'])} samples, index.json {meta['count']}")
        samples = _Samples(root, split, [s["name"] for s in meta["shards"]], table)
        out[split] = (table["label"].astype(np.int32), Names(samples), samples.blob)
    return out, list(index["classes"])
