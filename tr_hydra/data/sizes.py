"""Dataset sizes the plan needs (they decide the last-batch variants), without reading images."""
from __future__ import annotations

from pathlib import Path

from tr_hydra.errors import ConfigError

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".JPG", ".JPEG", ".PNG")


def count_images(split_dir: Path) -> int:
    if not split_dir.is_dir():
        raise ConfigError(f"data.root: {split_dir} does not exist")
    n = sum(1 for p in split_dir.rglob("*") if p.suffix in IMAGE_SUFFIXES)
    if n == 0:
        raise ConfigError(f"data.root: {split_dir} holds no images")
    return n


def dataset_sizes(data, train_override: int | None, val_override: int | None) -> tuple[int, int]:
    train, val = train_override or data.train_size, val_override or data.val_size
    if train is None or val is None:
        if data.name == "imagefolder":
            if not data.root:
                raise ConfigError("data.root: required for data=imagefolder")
            train = train or count_images(Path(data.root) / "train")
            val = val or count_images(Path(data.root) / "val")
        elif data.name == "arrays":
            import numpy as np
            if not data.path or not Path(data.path).is_file():
                raise ConfigError(f"data.path: {data.path!r} is not a file")
            with np.load(data.path, mmap_mode="r") as z:
                for key in ("x_train", "y_train", "x_val", "y_val"):
                    if key not in z:
                        raise ConfigError(f"data.path: {data.path} has no array {key!r}")
                train = train or int(z["y_train"].shape[0])
                val = val or int(z["y_val"].shape[0])
        else:
            raise ConfigError(f"data.train_size/data.val_size: required for data={data.name}")
    if train < 1 or val < 1:
        raise ConfigError(f"data.train_size/data.val_size: must be >= 1, got {train}/{val}")
    return int(train), int(val)
