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


def open_npz(path):
    """``np.load`` of a ``.npz`` archive (no pickles), or one ConfigError naming the file and
    what is wrong with it: not a zip archive at all (a text file named .npz: numpy would
    take it for a pickle), or a truncated or damaged one."""
    import zipfile

    import numpy as np
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError as e:
        raise ConfigError(f"data.path: cannot read {path}: {e.strerror}") from None
    if head[:2] != b"PK":
        raise ConfigError(f"data.path: {path} is not a .npz archive (no zip header: "
                          f"write it with numpy.savez)")
    try:
        z = np.load(path, allow_pickle=False)
    except (zipfile.BadZipFile, EOFError, OSError, ValueError) as e:
        raise ConfigError(f"data.path: {path} is a truncated or damaged .npz archive ({_why(e)})") from None
    if not hasattr(z, "files"):  # a plain .npy
        raise ConfigError(f"data.path: {path} is a single array, not a .npz archive")
    return z


def read_array(z, key: str, path):
    """Array ``key`` of an open .npz, or one ConfigError (a damaged member: bad CRC, cut short)."""
    import zipfile
    try:
        return z[key]
    except (zipfile.BadZipFile, EOFError, OSError, ValueError) as e:
        if isinstance(e, ValueError) and str(e).startswith("Object arrays cannot be loaded"):  # numpy's words
            raise ConfigError(f"data.path: {path} holds an object array (key {key!r}): write plain numeric "
                              f"arrays (uint8 images, integer labels) with numpy.savez") from None
        raise ConfigError(f"data.path: array {key!r} of {path} cannot be read: the archive is "
                          f"truncated or damaged ({_why(e)})") from None


def _why(e: BaseException) -> str:
    text = str(e).splitlines()[0] if str(e) else ""
    if "pickled" in text:
        text = "it holds pickled objects, not plain arrays"
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def dataset_sizes(data, train_override: int | None, val_override: int | None) -> tuple[int, int]:
    for key, given in (("variants.train_size", train_override), ("variants.val_size", val_override),
                       ("data.train_size", data.train_size), ("data.val_size", data.val_size)):
        if given is not None and given < 0:
            raise ConfigError(f"{key}: must be >= 1 (or null: counted from the source), got {given}")
    train, val = train_override or data.train_size, val_override or data.val_size
    if train is None or val is None:
        if data.name == "imagefolder":
            if not data.root:
                raise ConfigError("data.root: required for data=imagefolder")
            train = train or count_images(Path(data.root) / "train")
            val = val or count_images(Path(data.root) / "val")
        elif data.name == "shards":
            if not data.root:
                raise ConfigError("data.root: required for data=shards (a tr-prepare output)")
            from tr_hydra.data.shards import split_counts
            n_train, n_val = split_counts(data.root)
            train, val = train or n_train, val or n_val
        elif data.name == "arrays":
            if not data.path:
                raise ConfigError("data.path: required for data=arrays (an .npz with x_train, y_train, x_val, y_val)")
            if not Path(data.path).is_file():
                raise ConfigError(f"data.path: {data.path!r} is not a file")
            with open_npz(data.path) as z:
                for key in ("x_train", "y_train", "x_val", "y_val"):
                    if key not in z.files:
                        raise ConfigError(f"data.path: {data.path} has no array {key!r}")
                train = train or int(read_array(z, "y_train", data.path).shape[0])
                val = val or int(read_array(z, "y_val", data.path).shape[0])
        else:
            raise ConfigError(f"data.train_size/data.val_size: required for data={data.name}")
    if train < 1 or val < 1:
        raise ConfigError(f"data: {train} training and {val} validation images; each split needs at least one")
    return int(train), int(val)
