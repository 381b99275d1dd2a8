"""The frozen, hashable twins of the schema's sections (``config.schema``, where each option is
declared): what a PlanConfig holds, and what a part of the package that needs one section (the
data sources: ``DataSpec``) takes without the rest of the plan."""
from __future__ import annotations

import dataclasses
import enum
from dataclasses import field, fields
from typing import Any

from tr_hydra.config import schema


def plain(v: Any) -> Any:
    """A config value as a spec holds it: enums as their values, lists as tuples."""
    if isinstance(v, enum.Enum):
        return v.value
    if isinstance(v, (list, tuple)):
        return tuple(plain(x) for x in v)
    return v


def _spec_of(schema_cls, name: str, **defaults) -> type:
    """The frozen twin of a schema dataclass: the same fields and defaults, enums as their
    values, lists as tuples; ``defaults`` replace a field's default. A class of this module, so
    a PlanConfig pickles (the parallel compiles receive one)."""
    fs = []
    for f in fields(schema_cls):
        d = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        fs.append((f.name, Any, field(default=plain(defaults.get(f.name, d)))))
    cls = dataclasses.make_dataclass(name, fs, frozen=True)
    cls.__module__, cls.__qualname__ = __name__, name
    return cls


ModelSpec = _spec_of(schema.ModelConfig, "ModelSpec")
OptimizerSpec = _spec_of(schema.OptimizerConfig, "OptimizerSpec")
DataSpec = _spec_of(schema.DataConfig, "DataSpec")
TrainerSpec = _spec_of(schema.TrainerConfig, "TrainerSpec")
# Inductor's options as sorted (name, value) pairs, so the spec stays hashable; dict(...) gives them back
RuntimeSpec = _spec_of(schema.RuntimeConfig, "RuntimeSpec", inductor_options=())
DistSpec = _spec_of(schema.DistConfig, "DistSpec")


def frozen(spec_cls, section) -> Any:
    """``section`` (a schema dataclass, or anything with its fields) as a ``spec_cls``."""
    return spec_cls(**{f.name: plain(getattr(section, f.name)) for f in fields(spec_cls)})
