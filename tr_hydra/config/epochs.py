"""A run's epochs as steps: the variants (compiled shapes) its schedule needs, and which variant,
batch and size each step of an epoch and of a validation pass takes."""
from __future__ import annotations

from dataclasses import dataclass

from tr_hydra.errors import ConfigError


@dataclass(frozen=True)
class VariantSpec:
    name: str       # train_base, train_last, train_lowres, train_lowres_last, val_base, val_last
    train: bool
    batch: int
    res: int


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


def epoch_schedule(p, epoch: int) -> list[tuple[str, int, int]]:
    """(variant, batch index, batch size) of every step of an epoch, in order (``p``: a
    ``PlanConfig``)."""
    low = epoch < p.lowres_epochs
    base, last = ("train_lowres", "train_lowres_last") if low else ("train_base", "train_last")
    full = p.train_size // p.batch_size
    steps = [(base, i, p.batch_size) for i in range(full)]
    if p.has_variant(last):
        steps.append((last, full, p.variant(last).batch))
    return steps


def val_schedule(p) -> list[tuple[str, int, int]]:
    """(variant, batch index, batch size) of every validation step; the partial last batch is
    val_last's."""
    if not p.has_variant("val_base"):
        return []
    vb = p.variant("val_base").batch
    steps = [("val_base", i, vb) for i in range(p.val_size // vb)]
    if p.has_variant("val_last"):
        steps.append(("val_last", len(steps), p.variant("val_last").batch))
    return steps
