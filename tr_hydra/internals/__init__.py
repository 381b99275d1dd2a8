"""PyTorch's internals, behind one gate.

Everything tr_hydra takes from PyTorch's private modules (``torch._inductor``, ``torch._dynamo``,
``torch._functorch``, ``torch.utils._python_dispatch``) lives in this folder; the rest of the
package calls its small interface: compile a model's forward (``compile.compile_forward``), run a
step that may compile and tune (``variant_step``), save and load a compile (``saved_compile``),
count and time compiles (``dynamo``), ask Inductor's config (``inductor``), what a compiled step
saves for the backward (``saved_set``), and a dispatch mode to analyse a model on the meta device
(``dispatch``).

The gate knows the PyTorch releases it was tested with (``TESTED``). On any other release, with
``TR_HYDRA_STOCK=1`` in the environment, or where a patch's target is missing, it is closed:
the step is compiled by plain ``torch.compile``, nothing of PyTorch is patched, no compile is
saved or loaded, and one line says so. Training works the same and gives the same numbers up
to rounding; only start-up and speed differ.

The patches (``PATCHES``) are applied only inside ``patched()``: around the calls that compile
and tune (a step run before its capture, a saved compile's load), and undone when the last of
those returns, so PyTorch's own ``torch.compile`` outside them (tr-bench's baselines) is stock.

Nothing here imports PyTorch at import time: start-up's launcher imports this package first.
"""
from __future__ import annotations

import contextlib
import os
import threading
from dataclasses import dataclass

# the releases (major.minor) whose internals this folder was written against and tested with
TESTED = ("2.11", "2.14")
STOCK_VAR = "TR_HYDRA_STOCK"  # set to 1: the gate is closed whatever the release

# what each patch replaces, while ``patched()`` is in force, and why
PATCHES = {
    "CachingAutotuner.recheck_autotune_cache":
        "the fixed cache check of later releases, where the installed one skips tuned configs (inductor_compat)",
    "CachingAutotuner.coordinate_descent_tuning":
        "tunes only kernels large enough to pay, with candidates compiled ahead (tuned_kernels, compile_ahead)",
    "CachingAutotuner.autotune_to_one_config":
        "reads an earlier process's tuned config before Inductor saves its own pick over it (tuned_kernels)",
}

# what start-up's launcher imports before it forks: the parts of Dynamo, AOTAutograd and Inductor
# that a first compile would otherwise import lazily
PRELOAD = ("torch._dynamo", "torch._functorch.aot_autograd", "torch._inductor.compile_fx")


@dataclass(frozen=True)
class Gate:
    open: bool
    torch: str
    why: str = ""  # where closed: the reason, in words

    def line(self) -> str:
        """The one line a closed gate is announced with."""
        return (f"PyTorch internals: {self.why}; the step compiles with stock torch.compile: no patches, "
                f"no saved compiles, no kernels compiled ahead")


_STATE: list[Gate] = []
_ANNOUNCED: list = []
_LOCK = threading.Lock()
_DEPTH = [0]


def state() -> Gate:
    """The gate, decided once a process (``reset`` decides again)."""
    if not _STATE:
        _STATE.append(_decide())
    return _STATE[0]


def is_open() -> bool:
    return state().open


def reset() -> None:
    """Decide the gate again at its next use (after ``TR_HYDRA_STOCK`` changed)."""
    _STATE.clear()
    _ANNOUNCED.clear()


def announce(log) -> None:
    """A closed gate's line, said once a process (once after each ``reset``)."""
    gate = state()
    if not gate.open and not _ANNOUNCED:
        _ANNOUNCED.append(True)
        log(gate.line())


def _decide() -> Gate:
    import torch
    version = torch.__version__.split("+")[0]
    if os.environ.get(STOCK_VAR, "") not in ("", "0"):
        return Gate(False, version, f"{STOCK_VAR}={os.environ[STOCK_VAR]}")
    if ".".join(version.split(".")[:2]) not in TESTED:
        return Gate(False, version, f"torch {version} is not a release tr_hydra was tested with "
                                    f"({', '.join(TESTED)})")
    missing = _missing_targets()
    if missing:
        return Gate(False, version, f"this torch {version} has no {missing}")
    return Gate(True, version)


def _missing_targets() -> str:
    """The first private name tr_hydra needs that this PyTorch lacks, or ''."""
    try:
        from torch._dynamo.eval_frame import reset_code  # noqa: F401
        from torch._inductor.custom_graph_pass import CustomGraphPass  # noqa: F401
    except ImportError as e:
        return str(e).split("'")[1] if "'" in str(e) else "Dynamo/Inductor entry point"
    try:
        from torch._inductor.runtime.triton_heuristics import CachingAutotuner
    except ImportError:  # no Triton: nothing is tuned, so nothing is patched
        return ""
    for name in PATCHES:
        attr = name.split(".", 1)[1]
        if not hasattr(CachingAutotuner, attr):
            return name
    return ""


@contextlib.contextmanager
def patched():
    """``PATCHES`` in force inside (nested and across threads: applied at the first entry,
    undone at the last exit); nothing where the gate is closed."""
    if not is_open():
        yield
        return
    from tr_hydra.internals import inductor_compat, tuned_kernels
    with _LOCK:
        if _DEPTH[0] == 0:
            inductor_compat.apply()
            tuned_kernels.apply()
        _DEPTH[0] += 1
    try:
        yield
    finally:
        with _LOCK:
            _DEPTH[0] -= 1
            if _DEPTH[0] == 0:
                tuned_kernels.remove()
                inductor_compat.remove()


@contextlib.contextmanager
def variant_step(tuned: bool, steps: int | None):
    """A step of a variant whose first run may compile and tune its kernels: ``patched()``, with
    the variant's kernels tuned (``tuned``) where that pays over its ``steps``."""
    if not is_open():
        yield
        return
    from tr_hydra.internals import tuned_kernels
    with patched(), tuned_kernels.for_variant(tuned, steps):
        yield
