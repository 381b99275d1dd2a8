"""A fix that later PyTorch releases carry, applied where the installed Inductor lacks it.

Coordinate descent (``runtime.tuning``: ``full``, or ``auto`` for a long run) tunes each
Triton kernel on its first run and writes the best config beside the kernel in Inductor's cache,
marked ``found_by_coordesc``. A process that later loads the compiled graph from the cache (the
training process loading what a parallel compile made, or any later run) checks that cache in
``CachingAutotuner.recheck_autotune_cache``. In PyTorch 2.11 that method has two faults
(PyTorch issue 172819, fixed by pull request 173391):

- it skips the cached config when the kernel has a single config, the usual case for
  pointwise kernels;
- where the cached config is one of the kernel's compiled configs, it does not carry
  ``found_by_coordesc`` over to it.

Either way the loaded kernel's config is not marked, so its first run tunes it again: a
benchmark of every neighbouring config, each compiled first: a load of seconds becomes one of most of a
minute per variant.

:func:`apply` replaces the method with the fixed form only when the installed one has the
faulty guard (releases with the fix, such as 2.14, keep their own), and :func:`remove` puts it
back; the gate (``tr_hydra.internals.patched``) calls both.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import re

# the faulty guard of PyTorch 2.11's CachingAutotuner.recheck_autotune_cache
_FAULTY_GUARD = re.compile(r"len\(cached_configs\)\s*==\s*1\s+and\s+len\(configs\)\s*>\s*1")

_APPLIED: list = []  # the original method, once replaced
_READ: dict = {}  # the method last checked by ``needed`` and whether it is faulty


def recheck_is_faulty(source: str) -> bool:
    """Whether ``source``, the text of a ``recheck_autotune_cache``, has 2.11's faulty guard."""
    return bool(_FAULTY_GUARD.search(source))


def fixed_recheck_autotune_cache(self, reload_kernel_from_src) -> None:
    """``CachingAutotuner.recheck_autotune_cache`` in its fixed form: a cache hit narrows the
    kernel to the cached config whatever the number of configs, and carries ``found_by_coordesc``
    to it, so its first run does not tune it again. A best config that is not among the compiled
    ones and was found by coordinate descent is compiled, as before."""
    from torch._inductor.runtime import triton_heuristics as th

    if not self.is_statically_launchable():
        raise AssertionError("Expected statically launchable kernel")
    configs = [result.config for result in self.compile_results]
    kwargs = {}
    if "dynamic_scale_rblock_eligible" in inspect.signature(th.check_autotune_cache).parameters:
        kwargs["dynamic_scale_rblock_eligible"] = getattr(self, "_could_rblock_scale", False)
    cached_configs, _, autotune_cache_info = th.check_autotune_cache(
        configs, self.filename, self.inductor_meta, **kwargs)
    self.autotune_cache_info = autotune_cache_info
    if len(cached_configs) != 1:
        return
    best_config = cached_configs[0]
    found_by_coordesc = getattr(best_config, "found_by_coordesc", False)
    best_hash = th.triton_config_to_hashable(best_config)
    for compile_result in self.compile_results:
        if th.triton_config_to_hashable(compile_result.config) == best_hash:
            compile_result.config.found_by_coordesc = found_by_coordesc
            self.compile_results = [compile_result]
            return
    if found_by_coordesc:  # tuned to a config that was not compiled ahead: compile it now
        with th.dynamo_timed("CachingAutotuner.slow_precompile_config"):
            if self.fn.fn is None:
                self.fn = reload_kernel_from_src().fn
            self.compile_results = [self._precompile_config(best_config)]


def autotuner_method(name: str):
    """``(CachingAutotuner, its method name)``, or None where Inductor has no Triton (no Triton
    kernels to tune) or this release has no such method."""
    try:
        from torch._inductor.runtime.triton_heuristics import CachingAutotuner
    except ImportError:
        return None
    original = getattr(CachingAutotuner, name, None)
    return None if original is None else (CachingAutotuner, original)


def coordesc_eligible(kernel) -> bool:
    """Whether Inductor's coordinate descent would tune ``kernel`` at all: not a template, a
    user's autotuned or a fixed-config kernel, nor a reduction in deterministic mode. 2.14 asks
    ``_should_coordesc_tune``; 2.11 makes the same checks inside the method, at every launch of
    such a kernel, so the answer is kept on the kernel."""
    known = kernel.__dict__.get("_tr_coordesc_eligible")
    if known is None:
        known = kernel.__dict__["_tr_coordesc_eligible"] = _eligible(kernel)
    return known


def _eligible(kernel) -> bool:
    if isinstance(getattr(type(kernel), "_should_coordesc_tune", None), (property, functools.cached_property)):
        return bool(kernel._should_coordesc_tune)
    from torch._inductor.runtime.hints import HeuristicType as H
    kind = getattr(kernel, "heuristic_type", None)
    named = lambda *names: {getattr(H, n) for n in names if hasattr(H, n)}  # noqa: E731
    if kind in named("TEMPLATE", "USER_AUTOTUNE", "FIXED"):
        return False
    return not (getattr(kernel, "deterministic_mode", False)
                and kind in named("REDUCTION", "PERSISTENT_REDUCTION", "SPLIT_SCAN"))


def cached_coordesc_config(kernel):
    """The config coordinate descent found for ``kernel``'s source in an earlier process, as
    Inductor's autotune cache keeps it beside the kernel, whatever list of configs the tuning
    started from; None where the cache holds none or cannot be read.

    Inductor takes a cached config only where a hash of the kernel's configs equals the hash
    saved with it, which is of the list the kernel's source declares. A kernel loaded from the FX
    graph cache (what a parallel compile compiled, or an earlier run) is checked against the
    configs it was compiled with, and in PyTorch 2.11 to 2.14 these can differ from that list:
    ``_dynamic_scale_rblock`` adds a config with half the reduction block to a kernel short of
    registers, a config that fails to compile is dropped, and for a kernel without an x dimension
    ``cached_autotune`` removes ``XBLOCK`` from the configs after hashing them. Inductor then
    misses the tuned config and tunes the kernel again."""
    meta = getattr(kernel, "inductor_meta", None) or {}
    if not meta.get("coordinate_descent_tuning") or not getattr(kernel, "filename", None):
        return None
    try:
        from torch._inductor.runtime.autotune_cache import AutotuneCache, _load_cached_autotuning
        cache = AutotuneCache.create(meta, kernel.filename, "")  # the hash is only compared on reading
        data = cache._read() if cache is not None else None
        if not isinstance(data, dict) or not data.get("found_by_coordesc") or "configs_hash" not in data:
            return None
        # Inductor's own reading of the entry, against the hash it was saved with
        best = _load_cached_autotuning(dict(data), data["configs_hash"], [], meta)
    except Exception:  # noqa: BLE001 - another release's cache: Inductor's own path stays
        return None
    return best if getattr(best, "found_by_coordesc", False) else None


def launcher_for(kernel, launcher, config):
    """A launcher of ``kernel`` with ``config``, marked as found by coordinate descent: ``launcher``
    where it has that config, else one compiled now; None where this process cannot compile the
    kernel (its source is not here)."""
    from torch._inductor.runtime.triton_heuristics import triton_config_to_hashable as key
    if key(launcher.config) == key(config):
        launcher.config.found_by_coordesc = True
        return launcher
    ensure = getattr(kernel, "_ensure_kernel_loaded", None)
    reload = getattr(kernel, "_reload_kernel", None)  # releases before _ensure_kernel_loaded
    if ensure is not None:
        ensure()
    elif getattr(getattr(kernel, "fn", None), "fn", None) is None:
        if not callable(reload):
            return None
        kernel.fn = reload().fn
    with getattr(kernel, "lock", None) or contextlib.nullcontext():
        made = kernel._precompile_config(config).make_launcher()
    made.config.found_by_coordesc = True
    return made


def needed() -> bool:
    """Whether the installed ``recheck_autotune_cache`` has the faulty guard (read once per
    method: the gate applies the fix at every step it wraps)."""
    found = autotuner_method("recheck_autotune_cache")
    if found is None:
        return False
    method = _APPLIED[0] if _APPLIED else found[1]
    if _READ.get("method") is not method:
        try:
            faulty = recheck_is_faulty(inspect.getsource(method))
        except (OSError, TypeError):  # no source to check: leave PyTorch's own
            faulty = False
        _READ.update(method=method, faulty=faulty)
    return _READ["faulty"]


def apply() -> bool:
    """Install :func:`fixed_recheck_autotune_cache` if the installed Inductor has the faulty
    guard. Returns whether the fix is in place (installed now or before)."""
    if _APPLIED:
        return True
    if not needed():
        return False
    CachingAutotuner, original = autotuner_method("recheck_autotune_cache")
    _APPLIED.append(original)
    CachingAutotuner.recheck_autotune_cache = fixed_recheck_autotune_cache
    return True


def remove() -> None:
    """Put PyTorch's own method back, where :func:`apply` replaced it."""
    if _APPLIED:
        found = autotuner_method("recheck_autotune_cache")
        if found is not None:
            found[0].recheck_autotune_cache = _APPLIED.pop()
        _APPLIED.clear()


def applied() -> bool:
    return bool(_APPLIED)
