"""What a data source reads of a plan: the data section, the model's classes, the seed and the
epochs' schedule (``config.epochs``), without the rest of the plan (the model, the optimizer,
the runtime). ``PlanConfig.source_spec`` makes one."""
from __future__ import annotations

from dataclasses import dataclass

from tr_hydra.config.epochs import VariantSpec
from tr_hydra.config.specs import DataSpec


@dataclass(frozen=True)
class SourceSpec:
    data: DataSpec
    num_classes: int          # the model's outputs: every label must be below it
    seed: int                 # the epochs' orders and the augmentation's draws
    epochs: int               # trainer.epochs: the last epoch a stream decodes ahead into
    lowres_epochs: int
    batch_size: int
    train_size: int           # per rank
    val_size: int
    variants: tuple[VariantSpec, ...] = ()

    def variant(self, name: str) -> VariantSpec:
        for v in self.variants:
            if v.name == name:
                return v
        raise KeyError(name)

    def has_variant(self, name: str) -> bool:
        return any(v.name == name for v in self.variants)
