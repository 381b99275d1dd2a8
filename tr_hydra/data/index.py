"""Sample indexes of the real sources: which samples, which labels, in which order. Everything
is checked here, before a pipeline runs: a bad path, key, dtype or label is one clear error."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from tr_hydra.data.sizes import IMAGE_SUFFIXES, open_npz, read_array
from tr_hydra.errors import ConfigError


@dataclass
class SplitIndex:
    """One split: encoded files (paths), encoded bytes in prepared shards (``blob(i)``, with
    ``paths`` naming each sample), or decoded arrays; and int32 labels."""
    labels: np.ndarray                 # int32 [n]
    paths: Sequence[str] | None = None  # imagefolder / digits: files; shards: names for messages
    images: np.ndarray | None = None   # arrays: uint8 [n, H, W, C]
    blob: Callable[[int], np.ndarray] | None = None  # shards: sample i's JPEG bytes

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def subset(self, n: int) -> "SplitIndex":
        """n samples: an image folder or shards take a fixed spread over the whole set (sorted
        by class, the first n would drop classes); arrays take the first n in order."""
        if n >= len(self):
            return self
        if self.paths is not None:
            keep = np.sort(np.random.default_rng(0).permutation(len(self))[:n])
            if self.blob is not None:  # shards: their names and bytes, renumbered
                blob = self.blob
                return SplitIndex(self.labels[keep], paths=self.paths.subset(keep),
                                  blob=lambda i: blob(int(keep[i])))
            return SplitIndex(self.labels[keep], paths=[self.paths[i] for i in keep])
        return SplitIndex(self.labels[:n], images=self.images[:n])

    @property
    def encoded(self) -> bool:
        return self.paths is not None


def scan_imagefolder(root: str | Path, split: str, classes: list[str] | None = None) -> tuple[SplitIndex, list[str]]:
    """root/<split>/<class>/<image>; classes sorted by name (torchvision's ImageFolder rule)."""
    d = Path(root) / split
    if not Path(root).is_dir():
        raise ConfigError(f"data.root: {root} does not exist")
    if not d.is_dir():
        raise ConfigError(f"data.root: {d} does not exist (expected {split}/<class>/<images>)")
    found = sorted(p.name for p in d.iterdir() if p.is_dir())
    classes = classes or found
    if not classes:
        raise ConfigError(f"data.root: {d} holds no class folders")
    paths, labels = [], []
    for label, cls in enumerate(classes):
        cdir = d / cls
        files = sorted(str(p) for p in cdir.rglob("*") if p.suffix in IMAGE_SUFFIXES) if cdir.is_dir() else []
        if not files:
            raise ConfigError(f"data.root: class folder {cdir} holds no images")
        paths += files
        labels += [label] * len(files)
    extra = set(found) - set(classes)
    if extra:
        raise ConfigError(f"data.root: {d} has class folders not in train/: {sorted(extra)[:5]}")
    return SplitIndex(np.asarray(labels, np.int32), paths=paths), classes


def load_arrays(path: str | Path, num_classes: int) -> dict[str, SplitIndex]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"data.path: {path} is not a file")
    out = {}
    with open_npz(p) as z:
        for split in ("train", "val"):
            xk, yk = f"x_{split}", f"y_{split}"
            for k in (xk, yk):
                if k not in z.files:
                    raise ConfigError(f"data.path: {path} has no array {k!r} (has {sorted(z.files)})")
            x, y = read_array(z, xk, path), read_array(z, yk, path)
            if x.dtype != np.uint8 or x.ndim != 4 or x.shape[3] != 3:
                raise ConfigError(f"data.path: {xk} must be uint8 of shape (N, H, W, 3), "
                                  f"got {x.dtype} {tuple(x.shape)}")
            if y.ndim != 1 or y.shape[0] != x.shape[0] or not np.issubdtype(y.dtype, np.integer):
                raise ConfigError(f"data.path: {yk} must be integer of shape ({x.shape[0]},), "
                                  f"got {y.dtype} {tuple(y.shape)}")
            if y.size and (y.min() < 0 or y.max() >= num_classes):
                raise ConfigError(f"data.path: {yk} has labels outside [0, {num_classes}) "
                                  f"(min {int(y.min())}, max {int(y.max())})")
            out[split] = SplitIndex(y.astype(np.int32), images=np.ascontiguousarray(x))
    return out


def check_labels(index: SplitIndex, num_classes: int, what: str) -> None:
    if len(index) and int(index.labels.max()) >= num_classes:
        raise ConfigError(f"data.num_classes: {what} has {int(index.labels.max()) + 1} classes, "
                          f"more than data.num_classes={num_classes}")


def epoch_order(n: int, seed: int, epoch: int, shuffle: bool, shard_id: int = 0,
                num_shards: int = 1) -> np.ndarray:
    """Sample order of one epoch: a permutation fixed by (seed, epoch), then this shard's share."""
    order = np.arange(n)
    if shuffle:
        order = np.random.default_rng([seed, epoch]).permutation(n)
    return order[shard_id::num_shards]
