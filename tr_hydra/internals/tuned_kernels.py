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
Where ``runtime.tuning=auto`` chose the variant, the executor also gives the run's steps of it,
and each kernel is weighed on its own (:func:`pays`): its config is timed once (the time
coordinate descent starts from, so it is not timed again), its launches in a step are counted in
the Inductor module that launches it (:func:`launches`), and it is tuned only where
``KERNEL_GAIN`` of their time over the run exceeds ``KERNEL_SECONDS``.

The rule is applied where the kernel is first launched, in the process that tunes (the parallel
compiles' children and the training process alike), by wrapping
``CachingAutotuner.coordinate_descent_tuning``. A kernel that an earlier process tuned (a parallel
compile, an earlier run) takes the config that process found, from Inductor's autotune cache,
where Inductor's own check misses it (``inductor_compat.cached_coordesc_config``). That entry is
read before Inductor benchmarks the kernel's configs (``autotune_to_one_config``), whose pick is
saved over it, and written back once the kernel runs with it. A kept kernel's config is marked as
settled, so it is not weighed again at its next launch. A small one has nothing written to
Inductor's cache (a later process that loads it makes the same choice); one too short to pay is
saved there as a tuning's result would be, so a later process loads it without timing it.
Kernels Inductor never tunes (templates, fixed configs, a deterministic run's reductions) are
left to Inductor. A kernel that is tuned has its candidates compiled ahead (``compile_ahead``).
"""
from __future__ import annotations

import contextlib
import math
import re
import sys

# 2^20 elements: above every per-channel or per-split kernel of the models here (at most a few
# thousand channels times a few hundred splits), below every activation-sized one (ResNet-50's
# smallest at batch 32 is 32x7x7x2048 = 3.2M; CIFAR ResNet-18's at batch 128, 128x4x4x512 = 1M).
# (what this keeps and costs in ResNet-50's step: docs/performance.md, "Compile effort")
MIN_ELEMENTS = 1 << 20
# What tuning one kernel costs and saves, the MLPerf plan's full batch of ResNet-50 cold with
# ReLU's masks: its 63 kernels that paid took 58.9-60.5 s in coordinate descent
# with their candidates compiled ahead (compile_ahead), 1.0 s each, against 136.8 s without on the
# same machine; Inductor's log of each kernel's time before and after (every one of the 79 tuned)
# gives 10.4% of their launches' time saved (3.4 ms of 33.1 ms a step, each kernel's launches
# counted in the step's code)
KERNEL_SECONDS = 1.0
KERNEL_GAIN = 0.10

_APPLIED: list = []  # (name, original method) of each method wrapped
# kernels this process tuned, kept at Inductor's config (small ones, and those timed too short to
# pay: "unpaid"), and loaded as an earlier process tuned them
COUNTS = {"tuned": 0, "kept": 0, "unpaid": 0, "loaded": 0}
# whether the variant the executor runs now is tuned, and the run's steps of it over which each
# kernel's tuning must pay (None: every kernel large enough is tuned)
_VARIANT = [True, None]
_LAUNCHES: dict = {}  # per Inductor module file: {kernel name: launches in it}


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


def pays(ms: float, launches: int, steps: int) -> bool:
    """Whether tuning a kernel whose launch takes ``ms`` milliseconds, launched ``launches`` times
    a step, is expected to save more over ``steps`` steps than it costs."""
    return ms * 1e-3 * launches * steps * KERNEL_GAIN > KERNEL_SECONDS


def launches(kernel) -> int:
    """How many times a step launches ``kernel``: the ``.run(`` calls of its name in the Inductor
    module whose code is launching it (found among the calling frames; kernels of the same source
    are one kernel, launched once per use), outside the kernels' own source strings. 1 where no
    such module is found or read."""
    name = (getattr(kernel, "inductor_meta", None) or {}).get("kernel_name")
    frame = sys._getframe(1)
    while name and frame is not None:
        if frame.f_globals.get(name) is kernel:
            path = frame.f_globals.get("__file__")
            if path not in _LAUNCHES:
                try:
                    with open(path) as f:
                        code = re.sub(r"'''.*?'''", "", f.read(), flags=re.S)
                except (OSError, TypeError):
                    return 1
                counts: dict = {}
                for m in re.finditer(r"\b(\w+)\.run\(", code):
                    counts[m.group(1)] = counts.get(m.group(1), 0) + 1
                _LAUNCHES[path] = counts
            return max(1, _LAUNCHES[path].get(name, 0))
        frame = frame.f_back
    return 1


def _first_time(kernel, launcher, args, kwargs) -> float:
    """``launcher``'s time in milliseconds, as coordinate descent times it; kept in its tuner's
    results, where Inductor takes it as the time to improve on instead of timing it again."""
    tuner = getattr(kernel, "coordesc_tuner", None)
    known = tuner.lookup_in_cache(launcher.config) if tuner is not None else None
    if known is not None:  # Inductor timed the kernel's configs before (autotune_to_one_config)
        return known
    ms = kernel.bench(launcher, *args, **kwargs)
    if tuner is not None:
        tuner.cache_benchmark_result(launcher.config, ms)
    return ms


@contextlib.contextmanager
def for_variant(tuned: bool, steps: int | None = None):
    """The kernels first launched inside belong to a variant that is (``tuned``) or is not tuned;
    with ``steps`` (``runtime.tuning=auto``), each of its kernels is tuned only where that pays
    over the run's ``steps`` of it. Outside, every kernel is weighed by its size alone
    (``tr-bench``'s PyTorch modes)."""
    was, _VARIANT[:] = list(_VARIANT), [tuned, steps]
    try:
        yield
    finally:
        _VARIANT[:] = was


_UNREAD = object()


def _tuned_before(kernel, launcher):
    """``kernel``'s launcher with the config an earlier process's coordinate descent found for it
    (``inductor_compat``), or None: none was found, or it could not be made here (the kernel is
    then tuned as Inductor would). Where Inductor's pick among the kernel's configs was saved over
    that entry, the entry read before it (:func:`apply`) is used and written back."""
    from tr_hydra.internals import inductor_compat as compat
    before = kernel.__dict__.pop("_tr_tuned_before", _UNREAD)
    best = compat.cached_coordesc_config(kernel) if before is _UNREAD else before
    if best is None:
        return None
    try:
        made = compat.launcher_for(kernel, launcher, best)
    except Exception:  # noqa: BLE001 - a config this device cannot compile: tune instead
        return None
    if made is not None and before is not _UNREAD:
        _save_as_tuned(kernel, made.config)  # the entry again holds it, for the next process
    return made


def _save_as_tuned(kernel, config) -> None:
    """``config`` written to ``kernel``'s entry in Inductor's autotune cache as coordinate
    descent's result, so a process that loads the kernel takes it without timing anything."""
    save = getattr(kernel, "save_cache_hook", None)
    if save:
        with contextlib.suppress(OSError):
            save(config, 0, found_by_coordesc=True)


def apply() -> bool:
    """Wrap ``CachingAutotuner.coordinate_descent_tuning`` so that it tunes only kernels that
    :func:`worth_tuning` accepts, and ``autotune_to_one_config`` so that the config an earlier
    process tuned is read before Inductor saves its own pick over it. Returns whether the rule is
    in place."""
    if _APPLIED:
        return True
    from tr_hydra.internals import compile_ahead, inductor_compat as compat
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
            steps = _VARIANT[1]
            if steps is None or pays(_first_time(self, launcher, args, kwargs), launches(self), steps):
                COUNTS["tuned"] += 1
                return compile_ahead.tuning(self, lambda: original(self, launcher, *args, **kwargs))
            COUNTS["unpaid"] += 1
            _save_as_tuned(self, launcher.config)
        else:
            COUNTS["kept"] += 1
        launcher.config.found_by_coordesc = True  # settled: Inductor's config stays
        return launcher

    def autotune_to_one_config(self, *args, **kwargs):
        if compat.coordesc_eligible(self) and weighed(self):
            self._tr_tuned_before = compat.cached_coordesc_config(self)
        return picked[1](self, *args, **kwargs)

    _APPLIED[:] = [("coordinate_descent_tuning", original)]
    CachingAutotuner.coordinate_descent_tuning = coordinate_descent_tuning
    if picked is not None:
        _APPLIED.append(("autotune_to_one_config", picked[1]))
        CachingAutotuner.autotune_to_one_config = autotune_to_one_config
    return True


def remove() -> None:
    """Put PyTorch's own methods back, where :func:`apply` wrapped them."""
    from tr_hydra.internals import inductor_compat as compat
    found = compat.autotuner_method("coordinate_descent_tuning")
    for name, original in _APPLIED if found is not None else ():
        setattr(found[0], name, original)
    _APPLIED.clear()


def applied() -> bool:
    return bool(_APPLIED)
