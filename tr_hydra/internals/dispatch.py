"""The dispatch mode tr_hydra sees every operator through: the model's analysis on the meta
device, and the convolutions cuDNN's search runs ahead. PyTorch keeps its base class private
(``torch.utils._python_dispatch``); there is no stock path without it."""
from __future__ import annotations

from torch.utils._python_dispatch import TorchDispatchMode as DispatchMode

__all__ = ["DispatchMode"]
