"""Exceptions a user can act on. The CLIs print them as one line and exit 2."""
from __future__ import annotations


class TrHydraError(Exception):
    """Base class: a mistake in configuration, data or plan that the user can fix."""


class ConfigError(TrHydraError):
    """A config key has a wrong value."""


class PlanError(TrHydraError):
    """The memory plan cannot be built or broke one of its invariants."""


class PlanLockedError(PlanError):
    """Allocation after finalize()."""


class RegionOrderError(PlanError):
    pass


class ContiguityError(PlanError):
    pass


class LayerCorrespondenceError(PlanError):
    pass


class AlignmentError(PlanError):
    pass


class ModelMappingError(PlanError):
    """A model parameter or buffer fits no region."""
