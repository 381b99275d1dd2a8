"""Which Triton kernels coordinate descent tunes (``runtime.tuning``: ``full``, or ``auto`` for a
long run).

Coordinate descent compiles and times every neighbour of a kernel's block sizes at the kernel's
first launch, round after round. What that costs is about the same for every kernel (each
candidate compiled, then timed for tens of milliseconds); what it saves is a share of the
kernel's own time. A training step also launches many kernels over a few thousand elements: the
per-channel finish of BatchNorm's statistics and of its parameter gradients, the second pass of a
split reduction, the loss. Each runs for a few microseconds whatever its block sizes, so those
keep the config Inductor chose, and only kernels of ``MIN_ELEMENTS`` or more are tuned.

Nor are the kernels of a variant that ``runtime.tuning`` left untuned (``compiler/tuning.py``:
``PlanConfig.tunes``): Inductor's options are the same for every variant (one ``torch.compile``),
so the step executor says which variant it runs (:func:`for_variant`) and the rule follows.

The rule is applied where the kernel is first launched, in the process that tunes (the parallel
compiles' children and the training process alike), by wrapping
``CachingAutotuner.coordinate_descent_tuning``. A kernel that an earlier process tuned (a parallel
compile, an earlier run) takes the config that process found, from Inductor's autotune cache,
where Inductor's own check misses it (``inductor_compat.cached_coordesc_config``). That entry is
read before Inductor benchmarks the kernel's configs (``autotune_to_one_config``), whose pick is
saved over it, and written back once the kernel runs with it. A kept kernel's config is marked as
settled, so it is not weighed again at its next launch; nothing is written to Inductor's cache for
it, and a later process that loads it makes the same choice. Kernels Inductor never tunes
(templates, fixed configs, a deterministic run's reductions) are left to Inductor.
"""
from __future__ import annotations

import contextlib
import math

# 2^20 elements: above every per-channel or per-split kernel of the models here (at most a few
# thousand channels times a few hundred splits), below every activation-sized one (ResNet-50's
# smallest at batch 32 is 32x7x7x2048 = 3.2M; CIFAR ResNet-18's at batch 128, 128x4x4x512 = 1M).
# ResNet-50's training step at batch 256 on the H200 (2026-12-03): 80 kernels of 2^23 elements or
# more tuned in 134 s, 48 of 2^19 or fewer kept; tuning every one of them took 210 s
MIN_ELEMENTS = 1 << 20

_APPLIED: list = []  # the original coordinate_descent_tuning, once wrapped
# kernels this process tuned, kept at Inductor's config, and loaded as an earlier process tuned them
COUNTS = {"tuned": 0, "kept": 0, "loaded": 0}
_VARIANT = [True]  # whether the variant the executor runs now is tuned


def elements(size_hints) -> int:
    """The elements a kernel's launch covers, from Inductor's ``size_hints`` (a dict of
    ``x``/``y``/``r0_`` extents in current releases, a list in older ones): their product."""
    if size_hints is None:
        return 0
    sizes = size_hints.values() if isinstance(size_hints, dict) else size_hints
    return math.prod(int(s) for s in sizes)


def worth_tuning(size_hints, least: int = MIN_ELEMENTS) -> bool:
    """Whether a kernel over ``size_hints`` is large enough for coordinate descent to pay."""
    return elements(size_hints) >= least


@contextlib.contextmanager
def for_variant(tuned: bool):
    """The kernels first launched inside belong to a variant that is (``tuned``) or is not tuned;
    outside, every kernel is weighed by its size alone (``tr-bench``'s PyTorch modes)."""
    was, _VARIANT[0] = _VARIANT[0], tuned
    try:
        yield
    finally:
        _VARIANT[0] = was


_UNREAD = object()


def _tuned_before(kernel, launcher):
    """``kernel``'s launcher with the config an earlier process's coordinate descent found for it
    (``inductor_compat``), or None: none was found, or it could not be made here (the kernel is
    then tuned as Inductor would). Where Inductor's pick among the kernel's configs was saved over
    that entry, the entry read before it (:func:`apply`) is used and written back."""
    from tr_hydra.runtime import inductor_compat as compat
    before = kernel.__dict__.pop("_tr_tuned_before", _UNREAD)
    best = compat.cached_coordesc_config(kernel) if before is _UNREAD else before
    if best is None:
        return None
    try:
        made = compat.launcher_for(kernel, launcher, best)
    except Exception:  # noqa: BLE001 - a config this device cannot compile: tune instead
        return None
    save = getattr(kernel, "save_cache_hook", None)
    if made is not None and before is not _UNREAD and save:
        try:  # the entry again holds the tuned config, for the next process that loads the kernel
            save(made.config, 0, found_by_coordesc=True)
        except OSError:
            pass
    return made


def apply() -> bool:
    """Wrap ``CachingAutotuner.coordinate_descent_tuning`` so that it tunes only kernels that
    :func:`worth_tuning` accepts, and ``autotune_to_one_config`` so that the config an earlier
    process tuned is read before Inductor saves its own pick over it. Returns whether the rule is
    in place."""
    if _APPLIED:
        return True
    from tr_hydra.runtime import inductor_compat as compat
    found = compat.autotuner_method("coordinate_descent_tuning")
    if found is None:
        return False
    CachingAutotuner, original = found
    picked = compat.autotuner_method("autotune_to_one_config")

    def weighed(kernel) -> bool:
        return _VARIANT[0] and worth_tuning(getattr(kernel, "size_hints", None))

    def coordinate_descent_tuning(self, launcher, *args, **kwargs):
        if not compat.coordesc_eligible(self):  # Inductor returns it untouched
            return original(self, launcher, *args, **kwargs)
        if weighed(self):
            loaded = _tuned_before(self, launcher)
            if loaded is not None:
                COUNTS["loaded"] += 1
                return loaded
            COUNTS["tuned"] += 1
            return original(self, launcher, *args, **kwargs)
        COUNTS["kept"] += 1
        launcher.config.found_by_coordesc = True  # settled: Inductor's config stays
        return launcher

    def autotune_to_one_config(self, *args, **kwargs):
        if compat.coordesc_eligible(self) and weighed(self):
            self._tr_tuned_before = compat.cached_coordesc_config(self)
        return picked[1](self, *args, **kwargs)

    _APPLIED.append(original)
    CachingAutotuner.coordinate_descent_tuning = coordinate_descent_tuning
    if picked is not None:
        CachingAutotuner.autotune_to_one_config = autotune_to_one_config
    return True


def applied() -> bool:
    return bool(_APPLIED)
