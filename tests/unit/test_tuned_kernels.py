"""Which Triton kernels coordinate descent tunes (``tr_hydra.internals.tuned_kernels``): the size
rule against hand-counted elements, and the wrapped method against a stand-in for Inductor's
own tuning."""
import pytest

th = pytest.importorskip("torch._inductor.runtime.triton_heuristics")
triton = pytest.importorskip("triton")

from tests.helpers import CompiledConfig  # noqa: E402
from tr_hydra.internals import tuned_kernels as tk  # noqa: E402


@pytest.mark.parametrize("hints, n", [
    ({"x": 2048}, 2048),                                  # a per-channel pointwise kernel
    ({"x": 2048, "r0_": 128}, 262_144),                   # a split reduction's second pass
    ({"x": 33_554_432}, 33_554_432),                      # 256x7x7x2048 rounded up to 2^25
    ({"y": 256, "x": 65_536}, 16_777_216),                # a 2D tiled pointwise kernel
    ({"x": 64, "r0_": 1_048_576}, 67_108_864),            # BatchNorm's statistics: C x (N H W)
    ([1024, 4096], 4_194_304),                            # older releases: a list
    (None, 0),
])
def test_elements_are_the_product_of_the_size_hints(hints, n):
    assert tk.elements(hints) == n


def test_only_kernels_over_the_threshold_are_worth_tuning():
    assert tk.MIN_ELEMENTS == 2 ** 20
    assert not tk.worth_tuning({"x": 2048, "r0_": 128})
    assert not tk.worth_tuning({"x": 2 ** 20 - 1})
    assert tk.worth_tuning({"x": 2 ** 20})
    assert tk.worth_tuning({"x": 512, "r0_": 8192})
    assert tk.worth_tuning({"x": 4}, least=4) and not tk.worth_tuning({"x": 3}, least=4)


class Launcher:
    def __init__(self, xblock):
        self.config = triton.Config({"XBLOCK": xblock}, num_warps=4, num_stages=1)


class Kernel:
    """What the wrapped method reads of a CachingAutotuner at a kernel's first launch."""
    def __init__(self, size_hints):
        self.size_hints = size_hints


@pytest.fixture
def wrapped(monkeypatch):
    """``CachingAutotuner.coordinate_descent_tuning`` replaced by a stand-in that records its
    calls and 'tunes' to XBLOCK 1024, then wrapped by :func:`tk.apply`."""
    calls = []

    def tune(self, launcher, *args, **kwargs):
        calls.append((self, args, kwargs))
        best = Launcher(1024)
        best.config.found_by_coordesc = True
        return best

    def pick(self, *args, **kwargs):  # Inductor's benchmark of the kernel's configs: its pick saved
        self.save_cache_hook(self.picked, 0, **self.pick_saves)

    monkeypatch.setattr(th.CachingAutotuner, "coordinate_descent_tuning", tune)
    monkeypatch.setattr(th.CachingAutotuner, "autotune_to_one_config", pick)
    monkeypatch.setattr(tk, "_APPLIED", [])
    monkeypatch.setattr(tk, "COUNTS", {"tuned": 0, "kept": 0, "unpaid": 0, "loaded": 0})
    monkeypatch.setattr(tk, "_LAUNCHES", {})
    assert tk.apply() is True and tk.applied()
    assert tk.apply() is True and tk._APPLIED == [("coordinate_descent_tuning", tune), ("autotune_to_one_config", pick)]  # once
    return th.CachingAutotuner.coordinate_descent_tuning, calls


def test_a_large_kernel_is_tuned_by_inductor(wrapped):
    method, calls = wrapped
    k, launcher = Kernel({"x": 64, "r0_": 802_816}), Launcher(64)
    best = method(k, launcher, "arg", grid=(1,))
    assert calls == [(k, ("arg",), {"grid": (1,)})]
    assert best.config.kwargs == {"XBLOCK": 1024} and best.config.found_by_coordesc
    assert tk.COUNTS == {"tuned": 1, "kept": 0, "unpaid": 0, "loaded": 0}


def test_a_small_kernel_keeps_its_config_and_is_not_weighed_again(wrapped):
    method, calls = wrapped
    k, launcher = Kernel({"x": 2048}), Launcher(64)
    assert not getattr(launcher.config, "found_by_coordesc", False)
    kept = method(k, launcher, "arg")
    assert calls == [] and kept is launcher
    assert kept.config.kwargs == {"XBLOCK": 64}
    # Inductor's run() tunes a kernel whose config is not marked found_by_coordesc: now it is
    assert kept.config.found_by_coordesc is True
    assert tk.COUNTS == {"tuned": 0, "kept": 1, "unpaid": 0, "loaded": 0}


# how each release saves its pick among a kernel's configs over the kernel's cache entry, before
# coordinate descent: 2.11 unmarked, 2.14 marked found_by_coordesc when coordinate descent is on
PICK_SAVES = pytest.mark.parametrize("saves", [{}, {"found_by_coordesc": True}], ids=["2.11", "2.14"])


def _cached_kernel(tmp_path, saves):
    """A large kernel of several configs whose cache entry this process's hook writes, and the
    configs it compiles when asked."""
    from torch._inductor.runtime.autotune_cache import AutotuneCache
    k = Kernel({"x": 64, "r0_": 802_816})
    k.filename, k.inductor_meta = str(tmp_path / "cpicked.py"), {"coordinate_descent_tuning": True}
    k.save_cache_hook = AutotuneCache.create(k.inductor_meta, k.filename, "this process's list").save
    k.picked, k.pick_saves, k.compiled = triton.Config({"XBLOCK": 64}, num_warps=4, num_stages=1), saves, []
    k._precompile_config = lambda c: (k.compiled.append(c), CompiledConfig(c))[1]
    k._ensure_kernel_loaded = lambda: None
    return k


def test_a_kernel_an_earlier_process_tuned_takes_its_config_without_a_benchmark(wrapped, tmp_path):
    """Inductor's autotune cache holds the config a parallel compile found for the kernel's source,
    tuned from another list of configs than the one this process compiled: no tuning here."""
    from torch._inductor.runtime.autotune_cache import AutotuneCache
    method, calls = wrapped
    k = _cached_kernel(tmp_path, {})
    tuned = triton.Config({"XBLOCK": 512}, num_warps=8, num_stages=1)
    AutotuneCache.create(k.inductor_meta, k.filename, "the parallel compile's list").save(tuned, 0, found_by_coordesc=True)
    got = method(k, Launcher(64), "arg")
    assert calls == [] and len(k.compiled) == 1
    assert got.config.kwargs == {"XBLOCK": 512} and got.config.num_warps == 8 and got.config.found_by_coordesc
    assert tk.COUNTS == {"tuned": 0, "kept": 0, "unpaid": 0, "loaded": 1}
    # nothing cached for another kernel: tuned
    other = Kernel({"x": 2 ** 22})
    other.filename, other.inductor_meta = str(tmp_path / "cother.py"), {"coordinate_descent_tuning": True}
    assert method(other, Launcher(64)).config.kwargs == {"XBLOCK": 1024} and len(calls) == 1
    # a cached config this process cannot compile (out of resources on this device): tuned instead
    broken = Kernel({"x": 64, "r0_": 802_816})
    broken.filename, broken.inductor_meta = k.filename, k.inductor_meta
    broken._ensure_kernel_loaded = lambda: None

    def fails(config):
        raise RuntimeError("out of resources")
    broken._precompile_config = fails
    assert method(broken, Launcher(64)).config.kwargs == {"XBLOCK": 1024} and len(calls) == 2
    assert tk.COUNTS == {"tuned": 2, "kept": 0, "unpaid": 0, "loaded": 1}


@PICK_SAVES
def test_inductors_pick_saved_over_a_tuned_entry_does_not_replace_it(wrapped, tmp_path, saves):
    """A loaded kernel whose configs hash otherwise than its tuned list gets all its configs back;
    Inductor benchmarks them and saves its pick over the entry coordinate descent left. The tuned
    config is read before that, launched, and written back for the next process."""
    from torch._inductor.runtime.autotune_cache import AutotuneCache
    from tr_hydra.internals import inductor_compat as compat
    method, calls = wrapped
    k = _cached_kernel(tmp_path, saves)
    AutotuneCache.create(k.inductor_meta, k.filename, "the parallel compile's list").save(
        triton.Config({"XBLOCK": 512}, num_warps=8, num_stages=1), 0, found_by_coordesc=True)
    th.CachingAutotuner.autotune_to_one_config(k, "arg")
    after = compat.cached_coordesc_config(k)  # the pick now holds the entry: the tuned config is gone from it
    assert after is None or after.kwargs == {"XBLOCK": 64}
    got = method(k, Launcher(64), "arg")
    assert calls == [] and got.config.kwargs == {"XBLOCK": 512} and got.config.num_warps == 8
    assert tk.COUNTS == {"tuned": 0, "kept": 0, "unpaid": 0, "loaded": 1}
    back = compat.cached_coordesc_config(k)
    assert back.kwargs == {"XBLOCK": 512} and back.num_warps == 8 and back.found_by_coordesc


@PICK_SAVES
def test_a_kernel_never_tuned_is_tuned_after_inductors_pick(wrapped, tmp_path, saves):
    """The first process: nothing tuned yet. 2.14 marks its pick found_by_coordesc; the pick must
    not pass for a tuned config."""
    method, calls = wrapped
    k = _cached_kernel(tmp_path, saves)
    th.CachingAutotuner.autotune_to_one_config(k, "arg")
    got = method(k, Launcher(64), "arg")
    assert len(calls) == 1 and got.config.kwargs == {"XBLOCK": 1024} and k.compiled == []
    assert tk.COUNTS == {"tuned": 1, "kept": 0, "unpaid": 0, "loaded": 0}


def test_a_kernel_inductor_never_tunes_is_left_to_inductor(wrapped, tmp_path):
    """A template (or fixed-config) kernel: Inductor's method returns it untouched; the rule
    neither counts nor marks it, nor reads the cache for it."""
    from torch._inductor.runtime.hints import HeuristicType
    method, calls = wrapped
    k = _cached_kernel(tmp_path, {"found_by_coordesc": True})
    k.heuristic_type = HeuristicType.TEMPLATE
    th.CachingAutotuner.autotune_to_one_config(k, "arg")
    assert "_tr_tuned_before" not in vars(k)
    method(k, Launcher(64), "arg")
    assert [c[0] for c in calls] == [k] and tk.COUNTS == {"tuned": 0, "kept": 0, "unpaid": 0, "loaded": 0}


def test_a_variant_left_untuned_keeps_even_its_large_kernels(wrapped):
    method, calls = wrapped
    with tk.for_variant(False):
        kept = Launcher(64)
        assert method(Kernel({"x": 64, "r0_": 802_816}), kept) is kept and kept.config.found_by_coordesc
        with tk.for_variant(True):
            best = method(Kernel({"x": 64, "r0_": 802_816}), Launcher(64))
            assert len(calls) == 1 and best.config.kwargs == {"XBLOCK": 1024}
        assert method(Kernel({"x": 2 ** 22}), Launcher(64)).config.kwargs == {"XBLOCK": 64}  # still off
    # outside a step: by size alone
    assert method(Kernel({"x": 2 ** 22}), Launcher(64)).config.kwargs == {"XBLOCK": 1024}
    assert tk.COUNTS == {"tuned": 2, "kept": 2, "unpaid": 0, "loaded": 0}


def test_a_kernel_pays_where_its_share_of_the_runs_launch_time_exceeds_its_cost():
    """By hand, with the measured figures: 1 s a kernel, 10% of its launches' time saved."""
    assert (tk.KERNEL_SECONDS, tk.KERNEL_GAIN) == (1.0, 0.10)
    steps = 185_148  # the MLPerf plan's full batches
    assert tk.pays(0.1, 1, steps)            # 0.1 ms x 185,148 x 10% = 1.85 s
    assert not tk.pays(0.05, 1, steps)       # 0.93 s
    assert tk.pays(0.05, 2, steps)           # launched twice a step: 1.85 s
    assert not tk.pays(0.1, 1, 50_000)       # a shorter run: 0.5 s
    assert not tk.pays(float("inf"), 1, 0)   # no steps, nothing to save


_OUTPUT_CODE = """
triton_red_fused_7 = make('triton_red_fused_7', '''
def call(args):
    triton_red_fused_7.run(*args)  # the kernel's own benchmark harness, not a launch of the step
''')
triton_poi_fused_2 = make('triton_poi_fused_2', '''
@triton.jit
def triton_poi_fused_2(in_ptr0, XBLOCK: tl.constexpr): pass
''')


def call(args):
    triton_red_fused_7.run(args[0])
    triton_poi_fused_2.run(args[1])
    triton_red_fused_7.run(args[2])
    triton_red_fused_7.run(args[3])
"""


def test_launches_are_counted_in_the_module_that_launches_the_kernel(tmp_path, monkeypatch):
    """As Inductor loads its output code (a module executed from a file of the cache), with
    kernels that count their launches at their first run."""
    import types
    monkeypatch.setattr(tk, "_LAUNCHES", {})
    path = tmp_path / "cabc.py"
    path.write_text(_OUTPUT_CODE)
    seen = {}

    class Launched:
        def __init__(self, name, src):
            self.inductor_meta, self.runs = {"kernel_name": name}, 0

        def run(self, *args):
            if not self.runs:
                seen[self.inductor_meta["kernel_name"]] = tk.launches(self)
            self.runs += 1
    mod = types.ModuleType("cabc")
    mod.__file__, mod.make = str(path), Launched
    exec(compile(path.read_text(), str(path), "exec"), mod.__dict__)
    mod.call([1, 2, 3, 4])
    assert seen == {"triton_red_fused_7": 3, "triton_poi_fused_2": 1}
    assert mod.triton_red_fused_7.runs == 3
    # launched from code that does not hold it, or a kernel without a name: once
    stray = Launched("triton_red_fused_7", "")
    stray.run()
    assert seen["triton_red_fused_7"] == 1
    nameless = Launched("x", "")
    nameless.inductor_meta = {}
    assert tk.launches(nameless) == 1


def _timed_kernel(ms, n):
    """A large kernel whose launch takes ``ms``, launched ``n`` times a step, with Inductor's own
    coordinate descent tuner (where the time a kernel starts from is kept)."""
    from torch._inductor.runtime.coordinate_descent_tuner import CoordescTuner
    k = Kernel({"x": 2 ** 22})
    k.n, k.timed = n, []
    k.coordesc_tuner = CoordescTuner(name="k", size_hints={"x": 2 ** 22})
    k.bench = lambda launcher, *a, **kw: (k.timed.append((launcher.config, a, kw)), ms)[1]
    return k


def test_each_kernel_is_tuned_only_where_it_pays_over_the_run(wrapped, monkeypatch):
    method, calls = wrapped
    monkeypatch.setattr(tk, "launches", lambda kernel: kernel.n)
    with tk.for_variant(True, 185_148):
        short, kept, saved = _timed_kernel(0.05, 1), Launcher(64), []
        short.save_cache_hook = lambda config, ns, **kw: saved.append((config, kw))
        assert method(short, kept, "arg", grid=(1,)) is kept and kept.config.found_by_coordesc
        assert calls == [] and short.timed == [(kept.config, ("arg",), {"grid": (1,)})]
        # kept in Inductor's cache as tuned, for a process that loads the kernel not to time it
        assert saved == [(kept.config, {"found_by_coordesc": True})]
        long = _timed_kernel(0.1, 1)
        assert method(long, Launcher(64), "arg").config.kwargs == {"XBLOCK": 1024} and len(calls) == 1
        # Inductor's tuning starts from the time taken here: its tuner has it and does not time it again
        assert long.coordesc_tuner.call_func(lambda c: pytest.fail("timed again"), long.timed[0][0]) == 0.1
        method(_timed_kernel(0.05, 2), Launcher(64))  # a short kernel launched twice a step pays
        assert len(calls) == 2
        # a kernel of several configs: Inductor timed each before choosing; no time taken again
        picked, start = _timed_kernel(1.0, 1), Launcher(64)
        picked.coordesc_tuner.cache_benchmark_result(start.config, 0.01)
        assert method(picked, start) is start and picked.timed == [] and len(calls) == 2
    assert tk.COUNTS == {"tuned": 2, "kept": 0, "unpaid": 2, "loaded": 0}
    with tk.for_variant(True):  # runtime.tuning=full: every large kernel, none timed first
        k = _timed_kernel(0.001, 1)
        method(k, Launcher(64))
        assert k.timed == [] and len(calls) == 3


def test_the_executor_says_which_variant_it_runs(monkeypatch):
    """Each step tells the rule whether its variant is tuned (``PlanConfig.tunes``), before any
    of its kernels launches."""
    import dataclasses
    from tests.helpers import small_config
    from tr_hydra.runtime.build import Runtime
    rt = Runtime(small_config(lowres_epochs=1), log=lambda *_: None, source=False)
    pc = rt.ex.pc
    rt.ex.pc = dataclasses.replace(pc, runtime=dataclasses.replace(pc.runtime, tuning="full"),
                                   tuned_variants=("train_lowres",))
    said = []
    original = tk.for_variant

    def recording(tuned, steps=None):
        said.append((tuned, steps))
        return original(tuned, steps)
    monkeypatch.setattr(tk, "for_variant", recording)
    rt.ex.train_step("train_base")
    rt.ex.train_step("train_lowres")
    rt.ex.val_step("val_base")
    assert said == [(False, None), (True, None), (False, None)] and tk._VARIANT == [True, None]
    # runtime.tuning=auto: the run's steps of the tuned variant, for each kernel to pay over
    rt.ex.pc = dataclasses.replace(rt.ex.pc, tuned_steps=(1234,))
    rt.ex.train_step("train_lowres")
    rt.ex.train_step("train_base")
    assert said[3:] == [(True, 1234), (False, None)] and tk._VARIANT == [True, None]


@pytest.mark.parametrize("tune", [True, False])
def test_a_trainer_that_tunes_says_so_and_patches_only_inside_its_steps(monkeypatch, tune):
    import dataclasses
    from tests.helpers import small_config
    from tr_hydra import internals
    from tr_hydra.runtime.build import Runtime
    original = th.CachingAutotuner.coordinate_descent_tuning
    monkeypatch.setattr(th.CachingAutotuner, "coordinate_descent_tuning", original)  # restored after
    monkeypatch.setattr(th.CachingAutotuner, "autotune_to_one_config", th.CachingAutotuner.autotune_to_one_config)
    monkeypatch.setattr(tk, "_APPLIED", [])
    pc = small_config(compile="inductor")
    opts = (("coordinate_descent_tuning", True),) if tune else ()
    pc = dataclasses.replace(pc, runtime=dataclasses.replace(pc.runtime, inductor_options=opts, precompile=0))
    logs = []
    Runtime(pc, log=logs.append, source=False)
    said = [str(ln) for ln in logs if "coordinate descent tunes kernels of 1,048,576 elements" in str(ln)]
    assert len(said) == (1 if tune else 0), logs
    # PyTorch's own methods outside a step (tr-bench's baselines compile there), the rule inside
    assert not tk.applied() and th.CachingAutotuner.coordinate_descent_tuning is original
    with internals.patched():
        with internals.patched():  # nested: undone at the outer exit only
            pass
        assert tk.applied() and th.CachingAutotuner.coordinate_descent_tuning is not original
    assert not tk.applied() and th.CachingAutotuner.coordinate_descent_tuning is original


def test_a_closed_gate_patches_nothing(monkeypatch):
    from tr_hydra import internals
    original = th.CachingAutotuner.coordinate_descent_tuning
    monkeypatch.setattr(tk, "_APPLIED", [])
    monkeypatch.setenv(internals.STOCK_VAR, "1")
    internals.reset()
    try:
        assert not internals.is_open() and "TR_HYDRA_STOCK=1" in internals.state().line()
        with internals.patched(), internals.variant_step(True, None):
            assert not tk.applied() and th.CachingAutotuner.coordinate_descent_tuning is original
    finally:
        internals.reset()
