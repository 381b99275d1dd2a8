"""The built-in digits set: scikit-learn's 8x8 digits (1,797 real images, shipped with the
package, no download) written once as 32x32 RGB JPEGs in an image folder."""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import numpy as np

TRAIN, VAL = 1437, 360
SIZE = 32


def default_cache_dir() -> Path:
    from tr_hydra.bytecode import cache_root
    return cache_root()


def ensure_digits(cache_dir: str | Path | None = None) -> Path:
    """The digits image folder (root with train/ and val/); written on first use, atomically."""
    root = Path(cache_dir or default_cache_dir()) / "digits"
    if (root / ".complete").is_file():
        return root
    from PIL import Image
    from sklearn.datasets import load_digits
    d = load_digits()
    images = (d.images * (255.0 / 16.0)).round().clip(0, 255).astype(np.uint8)
    labels = d.target.astype(int)
    order = np.random.default_rng(0).permutation(len(labels))  # fixed split
    root.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="digits.", dir=root.parent))
    for split, idx in (("train", order[:TRAIN]), ("val", order[TRAIN:TRAIN + VAL])):
        for i in idx:
            cdir = tmp / split / str(labels[i])
            cdir.mkdir(parents=True, exist_ok=True)
            img = Image.fromarray(images[i]).resize((SIZE, SIZE), Image.BILINEAR).convert("RGB")
            img.save(cdir / f"{i:04d}.jpg", quality=95)
    (tmp / ".complete").write_text("ok\n")
    if root.exists():  # a partial earlier attempt
        shutil.rmtree(root)
    os.replace(tmp, root)
    return root
