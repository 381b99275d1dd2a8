"""The fix of Inductor's autotune-cache check on load (PyTorch issue 172819), checked against
PyTorch's own fixed method where the installed release has it (2.14), and its installation
against the faulty form of 2.11."""
import inspect

import pytest

th = pytest.importorskip("torch._inductor.runtime.triton_heuristics")
triton = pytest.importorskip("triton")

from tests.helpers import CompiledConfig  # noqa: E402
from tr_hydra.internals import inductor_compat as ic  # noqa: E402

INSTALLED = th.CachingAutotuner.recheck_autotune_cache


# PyTorch 2.11's method (torch 2.11.0+cu130, printed on the GPU machine), the faulty form
def recheck_2_11(self, reload_kernel_from_src):
    assert self.is_statically_launchable()
    configs = [result.config for result in self.compile_results]
    (cached_configs, _, autotune_cache_info) = th.check_autotune_cache(
        configs, self.filename, self.inductor_meta
    )
    self.autotune_cache_info = autotune_cache_info
    if len(cached_configs) == 1 and len(configs) > 1:
        best_config = cached_configs[0]
        best_config_hash = th.triton_config_to_hashable(best_config)
        for compile_result in self.compile_results:
            if th.triton_config_to_hashable(compile_result.config) == best_config_hash:
                self.compile_results = [compile_result]
                return
        if best_config.found_by_coordesc:
            if self.fn.fn is None:
                self.fn = reload_kernel_from_src().fn
            self.compile_results = [self._precompile_config(best_config)]


def installed_is_fixed() -> bool:
    return not ic.recheck_is_faulty(inspect.getsource(INSTALLED))


def cfg(xblock, warps=4, coordesc=None):
    c = triton.Config({"XBLOCK": xblock}, num_warps=warps, num_stages=1)
    if coordesc is not None:
        c.found_by_coordesc = coordesc
    return c


class Result:
    def __init__(self, config):
        self.config = config


class Kernel:
    """What the method reads and writes of a CachingAutotuner loaded from the cache."""
    def __init__(self, configs):
        self.compile_results = [Result(c) for c in configs]
        self.filename = "/cache/kernel.py"
        self.inductor_meta = {"coordinate_descent_tuning": True}
        self._could_rblock_scale = False
        self.fn = type("Fn", (), {"fn": object()})()
        self.compiled = []

    def is_statically_launchable(self):
        return True

    def _precompile_config(self, config):
        self.compiled.append(config)
        return Result(config)


def outcome(method, case, monkeypatch):
    """Run ``method`` on the kernel of ``case``: its configs, and what its cache holds (None: a miss)."""
    configs, cached = CASES[case]()  # made afresh: triton's Config drops found_by_coordesc when copied
    k = Kernel(configs)

    def check(cfgs, filename, meta, **kw):
        return ([cached] if cached is not None else cfgs), None, \
            {"autotune_cache_state": "hit" if cached is not None else "miss"}
    monkeypatch.setattr(th, "check_autotune_cache", check)
    method(k, lambda: pytest.fail("the kernel's function is already there"))
    return ([(th.triton_config_to_hashable(r.config), getattr(r.config, "found_by_coordesc", False))
             for r in k.compile_results], [th.triton_config_to_hashable(c) for c in k.compiled],
            k.autotune_cache_info)


CASES = {
    "one config, tuned to itself": lambda: ([cfg(64)], cfg(64, coordesc=True)),
    "one config, tuned to another": lambda: ([cfg(64)], cfg(128, warps=8, coordesc=True)),
    "three configs, the cached one among them": lambda: ([cfg(32), cfg(64), cfg(128)], cfg(64, coordesc=True)),
    "three configs, picked by the benchmark": lambda: ([cfg(32), cfg(64), cfg(128)], cfg(128, coordesc=False)),
    "one config, a miss": lambda: ([cfg(64)], None),
    "three configs, a miss": lambda: ([cfg(32), cfg(64), cfg(128)], None),
}


@pytest.mark.skipif(not installed_is_fixed(), reason="the installed PyTorch has the faulty form")
@pytest.mark.parametrize("case", list(CASES))
def test_the_fixed_form_does_what_pytorchs_own_fixed_method_does(case, monkeypatch):
    assert outcome(ic.fixed_recheck_autotune_cache, case, monkeypatch) == outcome(INSTALLED, case, monkeypatch)


def test_a_tuned_config_loaded_from_the_cache_is_marked_where_211s_form_left_it_unmarked(monkeypatch):
    # the kernel's single config, cached as found by coordinate descent: 2.11 leaves it unmarked,
    # so its first run tunes it again; the fixed form marks it
    case = "one config, tuned to itself"
    old, _, _ = outcome(recheck_2_11, case, monkeypatch)
    new, compiled, _ = outcome(ic.fixed_recheck_autotune_cache, case, monkeypatch)
    assert old == [(th.triton_config_to_hashable(cfg(64)), False)]
    assert new == [(th.triton_config_to_hashable(cfg(64)), True)] and compiled == []
    # several configs, the cached one among them: 2.11 narrows to it but leaves it unmarked
    case = "three configs, the cached one among them"
    old, _, _ = outcome(recheck_2_11, case, monkeypatch)
    new, _, _ = outcome(ic.fixed_recheck_autotune_cache, case, monkeypatch)
    assert old == [(th.triton_config_to_hashable(cfg(64)), False)]
    assert new == [(th.triton_config_to_hashable(cfg(64)), True)]
    # tuned to a config that was not compiled ahead: compiled now, marked
    case = "one config, tuned to another"
    new, compiled, _ = outcome(ic.fixed_recheck_autotune_cache, case, monkeypatch)
    assert compiled == [th.triton_config_to_hashable(cfg(128, warps=8))]
    assert new == [(th.triton_config_to_hashable(cfg(128, warps=8)), True)]


def test_a_miss_leaves_the_kernel_as_it_was(monkeypatch):
    for case in ("one config, a miss", "three configs, a miss"):
        configs, _ = CASES[case]()
        got, compiled, info = outcome(ic.fixed_recheck_autotune_cache, case, monkeypatch)
        assert got == [(th.triton_config_to_hashable(c), False) for c in configs]
        assert compiled == [] and info == {"autotune_cache_state": "miss"}


def test_the_faulty_guard_is_recognised():
    assert ic.recheck_is_faulty(inspect.getsource(recheck_2_11))
    assert not ic.recheck_is_faulty(inspect.getsource(ic.fixed_recheck_autotune_cache))


def test_applied_only_where_the_installed_form_is_faulty(monkeypatch):
    monkeypatch.setattr(ic, "_APPLIED", [])
    monkeypatch.setattr(th.CachingAutotuner, "recheck_autotune_cache", INSTALLED)
    if installed_is_fixed():  # e.g. 2.14: PyTorch's own stays
        assert ic.apply() is False and not ic.applied()
        assert th.CachingAutotuner.recheck_autotune_cache is INSTALLED
    # a release with 2.11's form gets the fixed one, once
    monkeypatch.setattr(th.CachingAutotuner, "recheck_autotune_cache", recheck_2_11)
    assert ic.apply() is True and ic.applied()
    assert th.CachingAutotuner.recheck_autotune_cache is ic.fixed_recheck_autotune_cache
    assert ic.apply() is True and ic._APPLIED == [recheck_2_11]


@pytest.mark.parametrize("tune", [True, False])
def test_a_trainer_compiling_with_inductor_says_so_and_fixes_inside_its_steps(tmp_path, monkeypatch, tune):
    import dataclasses
    from tests.helpers import small_config
    from tr_hydra import internals
    from tr_hydra.runtime.build import Runtime
    monkeypatch.setattr(ic, "_APPLIED", [])
    monkeypatch.setattr(th.CachingAutotuner, "recheck_autotune_cache", recheck_2_11)  # as on 2.11
    pc = small_config(compile="inductor")
    opts = (("coordinate_descent_tuning", True),) if tune else ()
    pc = dataclasses.replace(pc, runtime=dataclasses.replace(pc.runtime, inductor_options=opts, precompile=0))
    logs = []
    Runtime(pc, log=logs.append, source=False)
    assert th.CachingAutotuner.recheck_autotune_cache is recheck_2_11  # PyTorch's own outside a step
    with internals.patched():
        assert th.CachingAutotuner.recheck_autotune_cache is ic.fixed_recheck_autotune_cache
    assert th.CachingAutotuner.recheck_autotune_cache is recheck_2_11
    said = [str(ln) for ln in logs if "172819" in str(ln)]
    assert len(said) == (1 if tune else 0), logs


class Tuned:
    """A kernel as ``cached_coordesc_config`` reads it: its Inductor metadata and its file."""
    def __init__(self, filename, tuning=True):
        self.filename = str(filename)
        self.inductor_meta = {"coordinate_descent_tuning": tuning}


def _save(filename, config, configs, coordesc=True):
    """What coordinate descent leaves in Inductor's autotune cache for a kernel tuned from ``configs``."""
    from torch._inductor.runtime.autotune_cache import AutotuneCache
    cache = AutotuneCache.create({"coordinate_descent_tuning": True}, str(filename), th.hash_configs(configs))
    cache.save(config, 0, found_by_coordesc=coordesc)


@pytest.mark.parametrize("here", [[cfg(32), cfg(64)], [cfg(32), cfg(64), cfg(128), cfg(16)]],
                         ids=["one-dropped", "one-added"])
def test_a_config_tuned_from_another_list_of_configs_is_found(tmp_path, here):
    """The kernel was tuned from three configs; this process compiled another list (one that
    failed to compile dropped, or one added with half the reduction block): Inductor's own check
    misses the tuned config, tr_hydra's finds it."""
    f = tmp_path / "cabc123.py"
    _save(f, cfg(128, warps=8), [cfg(32), cfg(64), cfg(128)])
    meta = {"coordinate_descent_tuning": True}
    got, _, info = th.check_autotune_cache(here, str(f), meta)
    assert info["autotune_cache_state"] == "miss" and len(got) == len(here)  # Inductor tunes it again
    best = ic.cached_coordesc_config(Tuned(f))
    assert th.triton_config_to_hashable(best) == th.triton_config_to_hashable(cfg(128, warps=8))
    assert best.found_by_coordesc
    # the same list: Inductor's own check finds the same config
    (own,), _, _ = th.check_autotune_cache([cfg(32), cfg(64), cfg(128)], str(f), meta)
    assert th.triton_config_to_hashable(own) == th.triton_config_to_hashable(best)


def _built(fn, size_hints, configs, kind, filename, meta):
    """``fn`` as Inductor's own decorator makes it, as a compiled module calls it, on the CPU."""
    import torch
    from torch._inductor.runtime.hints import DeviceProperties, HeuristicType
    return th.cached_autotune(size_hints, configs,
                              triton_meta={"signature": {}, "device": DeviceProperties.create(torch.device("cpu"))},
                              heuristic_type=getattr(HeuristicType, kind), filename=str(filename),
                              inductor_meta=meta)(fn)


def test_a_kernel_without_an_x_dimension_takes_its_tuned_config(tmp_path):
    """Inductor's own decorator, as a compiled module calls it: it hashes the configs, then drops
    XBLOCK from those of a kernel without an x dimension, so the configs a loading process checks
    never hash as the list coordinate descent saved its result under."""
    import triton.language as tl

    @triton.jit
    def kernel(in_ptr0, out_ptr0, xnumel, r0_numel, R0_BLOCK: tl.constexpr):
        pass

    f = tmp_path / "cpersistent.py"
    f.write_text("# the kernel's source\n")
    declared = [triton.Config({"XBLOCK": 1}, num_warps=4, num_stages=1)]
    tuner = _built(kernel, {"x": 64, "r0_": 2048}, declared, "PERSISTENT_REDUCTION", f,
                   {"coordinate_descent_tuning": True})
    assert [c.kwargs for c in tuner.configs] == [{}]
    # coordinate descent's result, saved by the tuner's own hook (the process that tuned it)
    tuner.save_cache_hook(triton.Config({}, num_warps=16, num_stages=1), 0, found_by_coordesc=True)
    # what a process that loads the compiled kernel checks: the configs it was compiled with
    got, _, info = th.check_autotune_cache(list(tuner.configs), str(f), {"coordinate_descent_tuning": True})
    assert info["autotune_cache_state"] == "miss"
    best = ic.cached_coordesc_config(tuner)
    assert best.num_warps == 16 and best.kwargs == {} and best.found_by_coordesc


def test_no_config_where_none_was_tuned(tmp_path):
    assert ic.cached_coordesc_config(Tuned(tmp_path / "cnone.py")) is None  # nothing cached
    f = tmp_path / "cbench.py"
    _save(f, cfg(64), [cfg(32), cfg(64)], coordesc=False)  # picked by the benchmark of the list
    assert ic.cached_coordesc_config(Tuned(f)) is None
    g = tmp_path / "ctuned.py"
    _save(g, cfg(64), [cfg(64)])
    assert ic.cached_coordesc_config(Tuned(g, tuning=False)) is None  # a run without coordinate descent
    assert ic.cached_coordesc_config(Tuned(g)) is not None


def test_the_launcher_of_the_tuned_config():
    k = Kernel([cfg(64)])
    k._precompile_config = lambda c: (k.compiled.append(c), CompiledConfig(c))[1]
    same = CompiledConfig(cfg(64))
    assert ic.launcher_for(k, same, cfg(64, coordesc=True)) is same and same.config.found_by_coordesc
    other = ic.launcher_for(k, CompiledConfig(cfg(64)), cfg(256, warps=8, coordesc=True))
    assert th.triton_config_to_hashable(other.config) == th.triton_config_to_hashable(cfg(256, warps=8))
    assert other.config.found_by_coordesc and len(k.compiled) == 1
    k.fn.fn = None  # a kernel whose source is not in this process, on a release without _ensure_kernel_loaded
    assert ic.launcher_for(k, CompiledConfig(cfg(64)), cfg(256, coordesc=True)) is None
    loaded = type("Fn", (), {"fn": object()})()
    k._reload_kernel = lambda: type("Reloaded", (), {"fn": loaded})()  # what such a release stashes
    assert ic.launcher_for(k, CompiledConfig(cfg(64)), cfg(256, coordesc=True)) is not None and k.fn is loaded


@pytest.mark.parametrize("kind, deterministic, tuned", [
    ("POINTWISE", False, True), ("REDUCTION", False, True), ("REDUCTION", True, False),
    ("POINTWISE", True, True), ("TEMPLATE", False, False), ("USER_AUTOTUNE", False, False)])
def test_which_kernels_inductor_would_tune(tmp_path, kind, deterministic, tuned):
    """Inductor's own decorator builds the kernel; its own rule (2.14's ``_should_coordesc_tune``,
    2.11's checks inside the method) is what ``coordesc_eligible`` answers."""
    import triton.language as tl

    @triton.jit
    def kernel(in_ptr0, out_ptr0, xnumel, XBLOCK: tl.constexpr):
        pass

    tuner = _built(kernel, {"x": 2 ** 22}, [triton.Config({"XBLOCK": 1024}, num_warps=4, num_stages=1)], kind,
                   tmp_path / "ck.py", {"coordinate_descent_tuning": True, "deterministic": deterministic})
    assert ic.coordesc_eligible(tuner) is tuned
    if hasattr(th.CachingAutotuner, "_should_coordesc_tune"):
        assert tuner._should_coordesc_tune is tuned  # the release's own answer
