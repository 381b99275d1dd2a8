"""A run's epochs as steps: the variants (compiled shapes) its schedule needs, and which variant,
batch and size each step of an epoch and of a validation pass takes. The one place that decides
it: the trainer runs it, the tuning counts it (``compiler/tuning.py``), the data sources decode
ahead along it (``data/dali_source.py``)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from tr_hydra.errors import ConfigError


@dataclass(frozen=True)
class VariantSpec:
    name: str       # train_base, train_last, train_lowres, train_lowres_last, val_base, val_last
    train: bool
    batch: int
    res: int


class Epochs(Protocol):
    """What a schedule is read from: a ``PlanConfig``, or a data source's ``SourceSpec``."""
    variants: tuple[VariantSpec, ...]
    train_size: int     # per rank
    val_size: int
    batch_size: int
    lowres_epochs: int


def make_variants(*, train_size: int, val_size: int, batch_size: int, val_batch_size: int,
                  base_res: int, lowres_res: int, lowres_epochs: int, val_res: int,
                  drop_last: bool) -> tuple[VariantSpec, ...]:
    """The variants an epoch schedule needs; the last-batch ones only when a remainder exists."""
    if batch_size > train_size:
        raise ConfigError(f"variants.batch_size={batch_size} exceeds the training set size "
                          f"({train_size}); use a batch of at most {train_size}")
    rem = 0 if drop_last else train_size % batch_size
    out = [VariantSpec("train_base", True, batch_size, base_res)]
    if rem:
        out.append(VariantSpec("train_last", True, rem, base_res))
    if lowres_epochs > 0:
        out.append(VariantSpec("train_lowres", True, batch_size, lowres_res))
        if rem:
            out.append(VariantSpec("train_lowres_last", True, rem, lowres_res))
    vb = min(val_batch_size, val_size)
    if vb > 0:
        out.append(VariantSpec("val_base", False, vb, val_res))
        if val_size % vb:
            out.append(VariantSpec("val_last", False, val_size % vb, val_res))
    return tuple(out)


def _variant(p: Epochs, name: str) -> VariantSpec | None:
    return next((v for v in p.variants if v.name == name), None)


def train_variants(p: Epochs, epoch: int) -> tuple[str, str | None]:
    """The variants ``epoch`` trains: its full batches' and its partial last batch's (None where
    the epoch has none); the low-resolution ones in the first ``lowres_epochs``."""
    low = epoch < p.lowres_epochs
    base, last = ("train_lowres", "train_lowres_last") if low else ("train_base", "train_last")
    return base, (last if _variant(p, last) is not None else None)


def epoch_schedule(p: Epochs, epoch: int) -> list[tuple[str, int, int]]:
    """(variant, batch index, batch size) of every step of an epoch, in order."""
    base, last = train_variants(p, epoch)
    full = p.train_size // p.batch_size
    steps = [(base, i, p.batch_size) for i in range(full)]
    if last is not None:
        steps.append((last, full, _variant(p, last).batch))
    return steps


def val_schedule(p: Epochs) -> list[tuple[str, int, int]]:
    """(variant, batch index, batch size) of every validation step; the partial last batch is
    val_last's."""
    base, last = _variant(p, "val_base"), _variant(p, "val_last")
    if base is None:
        return []
    steps = [("val_base", i, base.batch) for i in range(p.val_size // base.batch)]
    if last is not None:
        steps.append(("val_last", len(steps), last.batch))
    return steps


def steps_before(p: Epochs, epoch: int) -> int:
    """The run's steps in the epochs before ``epoch``."""
    return sum(len(epoch_schedule(p, e)) for e in range(epoch))
