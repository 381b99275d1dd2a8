"""The resolve step: what a PlanConfig needs from outside the composed config, found once per
composed config and handed to the builder (``config.plan_config.plan_config_from``, which only
freezes and checks) as plain values: the datasets' sizes (counted from the source where the
config leaves them out), the world size (torchrun's environment, with ``dist=ddp``) and
``runtime.inductor_options`` checked against this PyTorch's Inductor. The CLIs and the Hydra
task call it."""
from __future__ import annotations

from tr_hydra.config.plan_config import PlanConfig, check_values, config_object, flat_options, inductor_options, \
    plan_config_from
from tr_hydra.config.specs import DataSpec, frozen, plain
from tr_hydra.data.sizes import dataset_sizes
from tr_hydra.errors import ConfigError
from tr_hydra.internals.inductor import known_options
from tr_hydra.runtime.world import TORCHRUN_HINT, env_world


class Counts:
    """The datasets' sizes one invocation has counted, by what decides them (the data section and
    ``variants.train_size`` / ``val_size``): a command that resolves a config more than once (its
    checks before Hydra runs, then the Hydra task) counts each dataset once."""

    def __init__(self):
        self._sizes: dict[tuple, tuple[int, int]] = {}

    def sizes(self, data: DataSpec, train: int | None, val: int | None) -> tuple[int, int]:
        key = (data, train, val)
        if key not in self._sizes:
            self._sizes[key] = dataset_sizes(data, train, val)
        return self._sizes[key]


def world_size(dist_mode: str) -> int:
    """The ranks of the run: torchrun's (or SLURM's) ``WORLD_SIZE`` with ``dist=ddp``, else 1."""
    if dist_mode != "ddp":
        return 1
    w = env_world()
    if w is None:
        raise ConfigError(f"dist=ddp: RANK/WORLD_SIZE are not set; {TORCHRUN_HINT}")
    return w[1]


def resolve(cfg, counts: Counts | None = None) -> PlanConfig:
    """The PlanConfig of a composed config (DictConfig or the schema dataclass). ``counts``: the
    sizes this invocation counted already (a fresh count where None)."""
    cfg = config_object(cfg)
    flat = flat_options(cfg.runtime.inductor_options)
    options = inductor_options(flat, known_options() if flat else None)  # Inductor imported only when asked
    world = world_size(plain(cfg.dist.mode))
    check_values(cfg)  # a wrong value is named before any data is read
    train, val = (counts or Counts()).sizes(frozen(DataSpec, cfg.data), cfg.variants.train_size,
                                            cfg.variants.val_size)
    return plan_config_from(cfg, train_size=train, val_size=val, world_size=world, inductor_options=options)
