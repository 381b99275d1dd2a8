"""What tr_hydra asks of Inductor's configuration: its option names and defaults, a mode's
options, whether its FX graph cache is on, and where its caches live."""
from __future__ import annotations

import os


def known_options() -> dict | None:
    """Every Inductor option of this PyTorch, dotted name to default; None where this PyTorch
    cannot list them (the options are then passed on unchecked)."""
    try:
        import torch._inductor.config as ic
    except Exception:  # noqa: BLE001 - no Inductor
        return None
    return ic.get_config_copy() if hasattr(ic, "get_config_copy") else None


def mode_options(mode: str) -> dict:
    """The Inductor options ``torch.compile(mode=mode)`` stands for."""
    from torch._inductor import list_mode_options
    return dict(list_mode_options(mode))


def fx_graph_cache_on() -> bool:
    """Inductor's FX graph cache is on: a parallel compile's Triton code and autotuning reach the
    training process through it."""
    try:
        import torch._inductor.config as ic
    except Exception:  # noqa: BLE001 - no Inductor: nothing to compile ahead
        return False
    return bool(getattr(ic, "fx_graph_cache", False))


def cache_dir() -> str:
    """Inductor's cache directory (``TORCHINDUCTOR_CACHE_DIR``, else PyTorch's default)."""
    try:
        from torch._inductor.runtime.cache_dir_utils import cache_dir as where
    except ImportError:  # PyTorch 2.11's layout
        from torch._inductor.runtime.runtime_utils import cache_dir as where
    return os.fspath(where())
