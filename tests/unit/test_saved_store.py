"""runtime.saved_store_gb: the saved compiles kept for later runs of the same plan, under a key of
everything their compiled code depends on (CPU: Inductor's C++ code)."""
from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from tr_hydra import startup
from tr_hydra.config.specs import OptimizerSpec, RuntimeSpec, TrainerSpec
from tr_hydra.internals import saved_compile
from tr_hydra.startup import store as st
from tr_hydra.startup.report import StartupReport
from tr_hydra.startup.store import KeptCompiles
from tests.helpers import small_config

GiB = 2**30
CPU = torch.device("cpu")


def _quiet(*_):
    pass


def _rt(pc, **kw):
    return dataclasses.replace(pc, runtime=dataclasses.replace(pc.runtime, **kw))


def _runtime(pc, logs=None):
    from tr_hydra.runtime.build import Runtime
    return Runtime(pc, log=(logs.append if logs is not None else _quiet), source=False)


def _fill_inputs(rt, variant: str) -> None:
    img, lab = rt.ex.input_views(variant, "A")
    g = torch.Generator().manual_seed(1)
    img.copy_(torch.randn(img.shape, generator=g).to(img.dtype))
    lab.copy_(torch.randint(0, 10, lab.shape, generator=g))


def _on_cpu_as_on_cuda(monkeypatch):
    """What ``startup._Plan`` asks of the device and of Inductor, answered on the CPU as an H200
    with Inductor's caches on would."""
    monkeypatch.setattr(startup, "caches_enabled", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (100 * GiB, 141 * GiB))


def _plan(rt, monkeypatch, logs=None):
    _on_cpu_as_on_cuda(monkeypatch)
    return startup._Plan(rt, None, logs.append if logs is not None else _quiet)


# the runtime options, by whether the compiled code depends on them (a new option must be put in one)
_KEYED = {"deterministic": True, "kernels": "torch", "recompute": "pointwise", "tuning": "full",
          "inductor_options": (("max_autotune", True),)}
_NOT_KEYED = {"device": "cuda", "warmup_steps": 5, "precompile": 3, "saved_store_gb": 0.5}
# constant wherever the store is used (Inductor with captured graphs: compile auto or inductor,
# cuda_graph on), so the key may hold them or not
_CONSTANT_WHERE_USED = {"compile", "cuda_graph"}


def test_the_key_follows_what_the_compiled_code_depends_on_and_nothing_else(monkeypatch):
    assert {f.name for f in dataclasses.fields(RuntimeSpec)} == set(_KEYED) | set(_NOT_KEYED) | _CONSTANT_WHERE_USED
    pc = small_config(compile="inductor", lowres_epochs=1)
    key = st.store_key(pc, "train_base", CPU)
    assert len(key) == 32 and key == st.store_key(pc, "train_base", CPU)
    # the same compiled code: another learning rate, schedule, seed, epoch count, logging,
    # data location, number of parallel compiles, warm-up, store size; a sweep's next job finds it
    same = [dataclasses.replace(pc, optimizer=OptimizerSpec(name="momentum", lr=0.4, weight_decay=0.0,
                                                            schedule="cosine")),
            dataclasses.replace(pc, seed=7, trainer=TrainerSpec(epochs=9, log_every=3, label_smoothing=0.1)),
            dataclasses.replace(pc, data=dataclasses.replace(pc.data, root="/elsewhere", augment=False))]
    same += [_rt(pc, **{k: v}) for k, v in _NOT_KEYED.items()]
    for other in same:
        assert other != pc and st.store_key(other, "train_base", CPU) == key, other
    # other compiled code
    differ = {"variant": (pc, "train_lowres", CPU),
              "model": (dataclasses.replace(pc, model=dataclasses.replace(pc.model, width=32)), "train_base", CPU),
              "classes": (dataclasses.replace(pc, model=dataclasses.replace(pc.model, num_classes=100)),
                          "train_base", CPU),
              "amp": (dataclasses.replace(pc, amp=True), "train_base", CPU),
              "folded": (dataclasses.replace(pc, bn_folded=True), "train_base", CPU),
              "optimizer": (dataclasses.replace(pc, optimizer=OptimizerSpec(name="adamw")), "train_base", CPU),
              "device": (pc, "train_base", torch.device("meta")),
              # runtime.tuning=full, but this variant left untuned (compiler/tuning.py)
              "untuned": (dataclasses.replace(_rt(pc, tuning="full"), tuned_variants=("train_lowres",)),
                          "train_base", CPU)}
    differ |= {f"runtime.{k}": (_rt(pc, **{k: v}), "train_base", CPU) for k, v in _KEYED.items()}
    keys = {k: st.store_key(*a) for k, a in differ.items()}
    assert all(k != key for k in keys.values()), keys
    assert len(set(keys.values())) == len(keys)
    assert st.store_key(pc, "train_base", CPU, {"max_autotune": True}) != key
    assert st.store_key(pc, "train_base", CPU, model="another digest") != key
    monkeypatch.setattr(torch, "__version__", "2.99.0")
    assert st.store_key(pc, "train_base", CPU) != key
    monkeypatch.undo()
    monkeypatch.setattr(st, "source_digest", lambda: "another tr_hydra")
    assert st.store_key(pc, "train_base", CPU) != key


def test_the_models_digest_follows_its_structure_and_its_own_source(tmp_path, monkeypatch):
    """A model registered from the user's own code: its file is in the key (tr_hydra's and
    torchvision's models are covered by the source digest and the versions); built on the meta
    device or the CPU, the same digest."""
    import importlib
    import sys
    from tr_hydra.models import registry
    from tr_hydra.models.registry import build_model
    with torch.device("meta"):
        r18, r18c = build_model("resnet18", 10), build_model("resnet18_cifar", 10)
    assert st.model_digest(r18, "resnet18") != st.model_digest(r18c, "resnet18_cifar")
    assert st.model_digest(r18, "resnet18") == st.model_digest(build_model("resnet18", 10), "resnet18")
    mod = tmp_path / "user_net.py"
    body = ("import torch.nn as nn\n"
            "class Net(nn.Module):\n"
            "    def __init__(self, num_classes, **_):\n"
            "        super().__init__()\n"
            "        self.fc = nn.Linear(4, num_classes)\n"
            "    def forward(self, x):\n"
            "        return self.fc(x){}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(registry, "_MODELS", dict(registry._MODELS))
    digests = []
    for tail in ("", " * 2", ""):
        mod.write_text(body.format(tail))
        sys.modules.pop("user_net", None)
        net = importlib.import_module("user_net")
        registry.register_model("user_net")(net.Net)
        digests.append(st.model_digest(build_model("user_net", 10), "user_net"))
    sys.modules.pop("user_net", None)
    assert digests[0] != digests[1] and digests[0] == digests[2]
    pc = small_config()
    assert st.store_key(pc, "train_base", CPU, model=digests[0]) != st.store_key(pc, "train_base", CPU,
                                                                                 model=digests[1])


def test_the_source_digest_changes_with_any_file_of_the_package(tmp_path, monkeypatch):
    import tr_hydra
    pkg = tmp_path / "tr_hydra"
    (pkg / "models").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "models" / "net.py").write_text("WIDTH = 16\n")
    monkeypatch.setattr(tr_hydra, "__file__", str(pkg / "__init__.py"))
    digests = []
    for text in ("WIDTH = 16\n", "WIDTH = 32\n", "WIDTH = 16\n"):
        (pkg / "models" / "net.py").write_text(text)
        st.source_digest.cache_clear()
        digests.append(st.source_digest())
    monkeypatch.undo()
    st.source_digest.cache_clear()
    assert digests[0] != digests[1] and digests[0] == digests[2]
    assert st.source_digest() != digests[0]  # the real package


def test_the_store_keeps_a_whole_copy_and_forgets_it(tmp_path):
    src = tmp_path / "child.forward"
    src.write_bytes(b"compiled" * 1000)
    store = st.Store(str(tmp_path / "store"))
    assert store.find("k") is None
    kept = store.put(str(src), "k")
    assert store.find("k") == kept and open(kept, "rb").read() == src.read_bytes()
    assert os.listdir(store.root) == ["k.forward"]  # no temporary file left
    store.drop("k")
    store.drop("k")  # twice: nothing to forget
    assert store.find("k") is None


def test_the_store_lies_in_inductors_cache_directory(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "cache"))
    assert st.Store().root == str(tmp_path / "cache" / "tr_hydra_saved") == st.store_dir()


def test_a_compile_kept_by_one_run_is_loaded_by_the_next_and_steps_to_the_traced_bits(tmp_path, monkeypatch):
    """Run 1 loads its child's file, steps, and keeps it. Run 2 (another learning rate, seed and
    epoch count: the same key) finds it, loads it instead of compiling, and ends a training step
    with the same arena, bit for bit, as a runtime that compiles the variant through Dynamo."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "cache"))
    pc1 = _rt(small_config(compile="inductor", train_size=80, val_size=40), precompile=0)
    variants = ["train_base", "train_last", "val_base", "val_last"]
    # as a child would: compiled whole and saved on the variant's first step
    child = _runtime(pc1)
    child_file = str(tmp_path / "train_last.forward")
    rec = child.forwards.record({"train_last": child_file})
    _fill_inputs(child, "train_last")
    child.ex.train_step("train_last", "A")
    assert os.path.exists(child_file) and not rec.errors

    class Pre:  # the precompiler's hand-over: the file its done child wrote
        def saved_forward(self, name):
            return child_file if name == "train_last" else None

    logs = []
    run1 = _runtime(pc1, logs)
    plan = _plan(run1, monkeypatch, logs)
    assert plan.kc is not None and plan.kc.found == {} and plan.pre is None  # an empty store
    assert plan.whole == variants  # no parallel compiles: each compiled whole here, to be kept
    plan.pre = Pre()
    rep = StartupReport()
    plan.load(run1, "train_last", rep, logs.append)
    assert list(rep.loaded_s) == ["train_last"] and run1.forwards.saved("train_last") is not None
    _fill_inputs(run1, "train_last")
    run1.ex.train_step("train_last", "A")
    plan.keep(run1, rep, logs.append)
    assert rep.kept == ["train_last"] and rep.from_store == []
    kept = st.Store().find(plan.kc.key("train_last"))
    assert kept is not None and open(kept, "rb").read() == open(child_file, "rb").read()

    pc2 = dataclasses.replace(pc1, seed=3, optimizer=OptimizerSpec(name="momentum", lr=0.3, schedule="constant"),
                              trainer=TrainerSpec(epochs=4))
    arenas = {}
    for mode in ("kept", "traced"):
        logs = []
        rt = _runtime(pc2, logs)
        if mode == "kept":
            plan = _plan(rt, monkeypatch, logs)
            assert plan.kc.found == {"train_last": kept}
            assert "saved store: 1 of 4 variants' compiles kept by an earlier run (train_last): " \
                   "loaded, not compiled" in logs, logs
            assert "train_last" not in plan.whole  # loaded, not compiled
            rep = StartupReport()
            plan.load(rt, "train_last", rep, logs.append)  # no parallel compiles at all
            assert plan.kc.from_store == ["train_last"] and "train_last" in rep.loaded_s
        _fill_inputs(rt, "train_last")
        rt.ex.train_step("train_last", "A")
        if mode == "kept":
            got = rt.forwards.report()
            assert got.saved == {"train_last": "loaded"} and got.mismatched == {}
            assert got.served == {"train_last": "loaded"}
            plan.keep(rt, rep, logs.append)
            assert rep.kept == [] and rep.from_store == ["train_last"]  # nothing new to keep
        arenas[mode] = rt.arena.arena.clone()
    assert torch.equal(arenas["kept"], arenas["traced"])
    # another width: another key, nothing found
    kc = KeptCompiles.open(_runtime(dataclasses.replace(pc1, model=dataclasses.replace(pc1.model, width=8))))
    assert kc.look_up(["train_last"]) == {}


def test_a_variant_compiled_whole_here_is_kept_and_the_next_run_loads_it_on_a_thread(tmp_path, monkeypatch):
    """The training process compiles its own variant whole (no child involved), steps through
    that compile, and keeps it after the capture; the next run loads it on a thread (as during
    cuDNN's search) and steps. Both end with the same arena, bit for bit, as a runtime that
    traces the variant through Dynamo."""
    import threading
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "cache"))
    pc1 = _rt(small_config(compile="inductor", train_size=80, val_size=40), precompile=0)
    pc2 = dataclasses.replace(pc1, seed=5, optimizer=OptimizerSpec(name="momentum", lr=0.2, schedule="constant"))
    arenas = {}
    logs = []
    own = _runtime(pc1, logs)
    plan = _plan(own, monkeypatch, logs)
    assert plan.kc.found == {} and "train_last" in plan.whole
    told = []

    class Job:  # the search ahead, waiting for the end of the first compile
        def compiled(self):
            told.append(own.forwards.report().saved)

    # as get_ready sets it up
    rec = own.forwards.record({v: None for v in plan.whole}, on_compiled=Job().compiled)
    _fill_inputs(own, "train_last")
    own.ex.train_step("train_last", "A")
    # told once, after the compile and before its code ran (the step had not used it yet)
    assert told == [{}] and not rec.errors
    assert isinstance(own.forwards.saved("train_last"), saved_compile.SavedForward)
    assert own.forwards.report().served == {"train_last": "compiled whole"}
    rep = StartupReport()
    plan.keep(own, rep, logs.append)
    assert rep.kept == ["train_last"] and rep.store_write_s > 0  # only the variant that stepped
    assert list(rep.whole_compile_s) == ["train_last"] and rep.whole_compile_s["train_last"] > 0
    kept = st.Store().find(plan.kc.key("train_last"))
    assert kept is not None and os.path.getsize(kept) > 0
    assert not [f for f in os.listdir(os.path.dirname(kept)) if f.endswith(".tmp")]
    arenas["own"] = own.arena.arena.clone()

    threads = []
    real_load = st.load

    def load(path, model, name=""):
        threads.append(threading.get_ident())
        return real_load(path, model, name)
    monkeypatch.setattr(st, "load", load)
    logs = []
    nxt = _runtime(pc2, logs)
    plan = _plan(nxt, monkeypatch, logs)
    assert plan.kc.found == {"train_last": kept}
    with plan.kc.preloading(nxt.model):
        pass
    assert threads and threads[0] != threading.get_ident() and list(plan.kc._preloaded) == ["train_last"]
    rep = StartupReport()
    plan.load(nxt, "train_last", rep, logs.append)
    assert plan.kc.preloaded == ["train_last"] and plan.kc.from_store == ["train_last"]
    assert rep.loaded_s["train_last"] >= 0 and len(threads) == 1  # not loaded a second time
    _fill_inputs(nxt, "train_last")
    nxt.ex.train_step("train_last", "A")
    assert nxt.forwards.report().mismatched == {}
    plan.keep(nxt, rep, logs.append)
    assert rep.kept == [] and rep.preloaded == ["train_last"] and rep.from_store == ["train_last"]
    arenas["kept"] = nxt.arena.arena.clone()

    traced = _runtime(pc1)
    _fill_inputs(traced, "train_last")
    traced.ex.train_step("train_last", "A")
    # the optimizers' learning rates differ between pc1 and pc2: compare each with its own
    # runtime's traced twin (pc1's here); the forward and backward compile is one
    assert torch.equal(arenas["own"], traced.arena.arena)
    traced2 = _runtime(pc2)
    _fill_inputs(traced2, "train_last")
    traced2.ex.train_step("train_last", "A")
    assert torch.equal(arenas["kept"], traced2.arena.arena)


class _Fake:
    """The precompiler, as ``_Plan`` starts it: what it was given."""
    seen: dict = {}

    def __init__(self, pc, variants, workers, log=None, device_index=0, launcher=None, saved=True):
        _Fake.seen = dict(order=list(variants), n=workers, saved=saved)


def _planning(tmp_path, monkeypatch, logs, **runtime):
    """A runtime as on CUDA with runtime.compile=auto (Inductor), three variants (train_base,
    train_last, val_base), eight parallel compiles wanted and room for them."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(startup, "Precompiler", _Fake)
    pc = _rt(small_config(train_size=200, batch=32, val_size=64, val_batch=32), **{"precompile": 8, **runtime})
    rt = _runtime(pc, logs)
    assert [v.name for v in pc.variants] == ["train_base", "train_last", "val_base"]
    rt.inductor = True  # as on CUDA with runtime.compile=auto
    _Fake.seen = {}
    return rt


def _keep(rt, names, tmp_path):
    f = tmp_path / "f"
    f.write_bytes(b"x")
    kc = KeptCompiles.open(rt, _quiet)
    for v in names:
        kc.store.put(str(f), kc.key(v))


def test_the_training_process_compiles_whole_what_no_child_takes(tmp_path, monkeypatch):
    logs = []
    rt = _planning(tmp_path, monkeypatch, logs)
    plan = _plan(rt, monkeypatch, logs)
    # the validation variant here, the children take the training ones
    assert plan.whole == ["val_base"] and plan.own == "val_base" and isinstance(plan.pre, _Fake)
    _keep(rt, ["train_last", "val_base"], tmp_path)
    plan = _plan(rt, monkeypatch, logs)
    assert plan.pre is None and plan.whole == ["train_base"]
    _keep(rt, ["train_base"], tmp_path)
    plan = _plan(rt, monkeypatch, logs)
    assert plan.pre is None and plan.whole == [] and list(plan.kc.found) == ["train_base", "train_last", "val_base"]
    # no parallel compiles: every variant not kept is compiled here
    rt = _planning(tmp_path / "none", monkeypatch, logs, precompile=0)
    plan = _plan(rt, monkeypatch, logs)
    assert plan.pre is None and plan.whole == ["train_base", "train_last", "val_base"]
    # no room on the device for a child: the same
    rt = _planning(tmp_path / "full", monkeypatch, logs)
    _on_cpu_as_on_cuda(monkeypatch)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (GiB // 4, 141 * GiB))
    plan = startup._Plan(rt, None, logs.append)
    assert plan.pre is None and plan.whole == ["train_base", "train_last", "val_base"] and _Fake.seen == {}
    assert "runtime.precompile: no room on the device for a parallel compile; compiling in turn" in logs
    # no store: compiled as before (through Dynamo, lazily), the children as with one
    rt = _planning(tmp_path / "off", monkeypatch, logs, saved_store_gb=0)
    plan = _plan(rt, monkeypatch, logs)
    assert plan.kc is None and plan.whole == [] and plan.own == "val_base"
    assert _Fake.seen["order"] == [("train_base", True), ("train_last", True)]


def test_a_kept_compile_that_does_not_load_is_dropped_and_compiled_here(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "cache"))
    logs = []
    rt = _runtime(_rt(small_config(compile="inductor", val_size=64), precompile=0), logs)
    store = st.Store()
    bad = tmp_path / "bad"
    bad.write_bytes(b"not a pickle")
    key = KeptCompiles.open(rt, _quiet).key("val_base")
    store.put(str(bad), key)
    plan = _plan(rt, monkeypatch, logs)
    assert list(plan.kc.found) == ["val_base"] and "val_base" not in plan.whole
    rep = StartupReport()
    plan.load(rt, "val_base", rep, logs.append)
    assert rt.forwards.report().saved == {} and plan.kc.from_store == [] and rep.loaded_s == {}
    assert store.find(key) is None  # the next run compiles it again
    assert any(ln.startswith("  val_base: the compile kept by an earlier run did not load (")
               and ln.endswith("compiling it here (and dropping that file)") for ln in logs), logs
    # loaded on a thread during cuDNN's search: the same, when the variant warms up
    store.put(str(bad), key)
    logs.clear()
    plan = _plan(rt, monkeypatch, logs)
    with plan.kc.preloading(rt.model):
        pass
    assert isinstance(plan.kc._preloaded["val_base"][0], Exception)
    rep = StartupReport()
    plan.load(rt, "val_base", rep, logs.append)
    assert rt.forwards.report().saved == {} and plan.kc.preloaded == [] and plan.kc._preloaded == {}
    assert rep.loaded_s == {} and store.find(key) is None
    assert any(ln.startswith("  val_base: the compile kept by an earlier run did not load (")
               for ln in logs), logs


def test_a_kept_compile_made_for_another_input_is_not_called_and_is_dropped(tmp_path, monkeypatch):
    """Were a key to miss a difference, the input's signature still catches it: the executor
    steps with its ordinary forward, and the file is dropped."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "cache"))
    logs = []
    rt = _runtime(_rt(small_config(), precompile=0), logs)
    rt.inductor = True
    kc = KeptCompiles.open(rt, _quiet)
    key = kc.key("train_base")
    (tmp_path / "f").write_bytes(b"x")
    kc.store.put(str(tmp_path / "f"), key)
    calls = []
    sig = saved_compile.Signature((2, 3, 16, 16), (768, 1, 48, 3), "torch.float32", "cpu", True, True, (False, ""))
    wrong = saved_compile.SavedForward(lambda m, x: calls.append(x), rt.model, sig, "train_base")
    monkeypatch.setattr(st, "load", lambda path, model, name="": wrong)  # "loads" as one made for (2, 3, 16, 16)
    plan = _plan(rt, monkeypatch, logs)
    rep = StartupReport()
    plan.load(rt, "train_base", rep, logs.append)
    assert rt.forwards.saved("train_base") is wrong and "train_base" in rep.loaded_s
    assert plan.kc.from_store == ["train_base"]
    x = torch.randn(32, 3, 16, 16)
    assert rt.forwards.for_variant("train_base", x) is rt.forwards.traced and calls == []
    got = rt.forwards.report()
    assert got.mismatched == {"train_base": "shape (2, 3, 16, 16) (compiled) against (32, 3, 16, 16)"}
    assert got.saved == {} and got.served == {"train_base": "traced"}
    plan.keep(rt, rep, logs.append)
    assert rep.from_store == [] and rep.loaded_s == {} and kc.store.find(key) is None
    assert "  train_base: its saved compile was made for another input (shape (2, 3, 16, 16) (compiled) " \
           "against (32, 3, 16, 16)); compiled here instead" in logs, logs


def test_kept_variants_get_no_child_and_a_run_with_all_of_them_starts_none(tmp_path, monkeypatch):
    logs = []
    rt = _planning(tmp_path, monkeypatch, logs)
    _keep(rt, ["val_base"], tmp_path)
    plan = _plan(rt, monkeypatch, logs)
    assert isinstance(plan.pre, _Fake) and plan.own == "train_base"
    assert _Fake.seen == dict(order=[("train_last", True)], n=1, saved=True)
    assert "compiling 2 variants: train_base here, 1 in 1 parallel process" in logs, logs
    assert list(plan.kc.found) == ["val_base"]
    rt = _planning(tmp_path / "b", monkeypatch, logs)
    _keep(rt, ["train_last"], tmp_path)
    plan = _plan(rt, monkeypatch, logs)  # the validation variant here, the child takes train_base
    assert isinstance(plan.pre, _Fake) and plan.own == "val_base"
    assert _Fake.seen["order"] == [("train_base", True)] and _Fake.seen["n"] == 1
    assert "compiling 2 variants: val_base here, 1 in 1 parallel process" in logs, logs
    # all the variants after the first kept: no child, no precompiler
    _Fake.seen = {}
    _keep(rt, ["val_base"], tmp_path)
    plan = _plan(rt, monkeypatch, logs)
    assert plan.pre is None and _Fake.seen == {} and list(plan.kc.found) == ["train_last", "val_base"]
    # turned off: neither read (train_last, kept, gets a child) nor written
    rt = _planning(tmp_path / "b", monkeypatch, logs, saved_store_gb=0)
    before = sorted(os.listdir(st.store_dir()))
    assert len(before) == 2
    plan = _plan(rt, monkeypatch, logs)
    assert isinstance(plan.pre, _Fake) and plan.kc is None and plan.whole == []
    assert _Fake.seen["order"] == [("train_base", True), ("train_last", True)]
    rep = StartupReport()
    plan.keep(rt, rep, logs.append)
    assert rep.kept == [] and sorted(os.listdir(st.store_dir())) == before


def test_no_launcher_is_started_when_every_child_variant_is_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(startup, "launcher_wanted", lambda *a: True)
    started = []

    class Launcher:
        def __init__(self, log=None):
            started.append(1)

        def close(self):
            pass

    monkeypatch.setattr(startup, "Launcher", Launcher)
    pc = small_config(train_size=200, batch=32, val_size=64, val_batch=32)
    assert startup.start(pc, CPU, _quiet) is not None and started == [1]  # nothing kept yet
    rt = _runtime(pc)
    _keep(rt, ["train_base"], tmp_path)  # the first variant kept: the others still get children
    assert startup.start(pc, CPU, _quiet) is not None and started == [1, 1]
    _keep(rt, ["train_last", "val_base"], tmp_path)
    assert startup.start(pc, CPU, _quiet) is None and started == [1, 1]


def test_the_option_is_on_by_default_and_can_be_turned_off():
    from hydra.errors import ConfigCompositionException
    from tr_hydra.cli._common import compose
    from tr_hydra.resolve import resolve
    from tr_hydra.errors import ConfigError
    assert resolve(compose([])).runtime.saved_store_gb == 4.0
    assert resolve(compose(["runtime.saved_store_gb=0.5"])).runtime.saved_store_gb == 0.5
    assert resolve(compose(["runtime.saved_store_gb=0"])).runtime.saved_store_gb == 0
    with pytest.raises(ConfigError, match=r"runtime.saved_store_gb: must be a size in GB >= 0 \(0: no store\)"):
        resolve(compose(["runtime.saved_store_gb=-1"]))
    for gone in ("runtime.saved_store=false", "runtime.precompile_saved=false"):  # folded into saved_store_gb
        with pytest.raises(ConfigCompositionException):
            compose([gone])


def test_the_store_is_off_at_zero_gb(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "cache"))
    pc = small_config(compile="inductor")
    rt = _runtime(_rt(pc, saved_store_gb=0))
    assert KeptCompiles.open(rt, _quiet) is None
    assert isinstance(KeptCompiles.open(_runtime(pc), _quiet), KeptCompiles)


def test_the_store_is_trimmed_least_recently_used_first_never_this_runs(tmp_path):
    store = st.Store(str(tmp_path / "store"))
    src = tmp_path / "src"
    src.write_bytes(b"x" * 1000)
    for i, k in enumerate("abcde"):  # written in that order, a the oldest
        p = store.put(str(src), k)
        os.utime(p, (1000 + i, 1000 + i))
    (tmp_path / "store" / "other.txt").write_bytes(b"y" * 5000)  # not a kept compile: never counted or dropped
    store.touch(store.path("a"))  # a loaded by a later run: now the most recent
    assert store.trim(10_000) == (0, 0)  # 5,000 bytes: under the limit
    # to 3,000 bytes: b is dropped first, c is this run's (kept), then d; a and e stay
    assert store.trim(3_000, keep=[store.path("c")]) == (2, 2000)
    assert [k for k in "abcde" if store.find(k)] == ["a", "c", "e"]
    assert (tmp_path / "store" / "other.txt").exists()
    # a write that a killed process left half done: removed once an hour old, not before
    old_tmp, new_tmp = tmp_path / "store" / "x.forward.123.tmp", tmp_path / "store" / "y.forward.456.tmp"
    old_tmp.write_bytes(b"z")
    new_tmp.write_bytes(b"z")
    os.utime(old_tmp, (1000, 1000))
    store.trim(10_000)
    assert not old_tmp.exists() and new_tmp.exists()
    assert st.Store(str(tmp_path / "none")).trim(0) == (0, 0)  # no directory yet


def test_a_run_trims_the_store_to_its_limit_after_keeping_its_own(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "cache"))
    logs = []
    pc = _rt(small_config(compile="inductor"), saved_store_gb=2.5e-6, precompile=0)  # 2,500 bytes
    rt = _runtime(pc, logs)
    plan = _plan(rt, monkeypatch, logs)
    store = plan.kc.store
    src = tmp_path / "src"
    src.write_bytes(b"x" * 1000)
    for i, k in enumerate(["old1", "old2", "old3"]):  # other plans' compiles, earlier runs
        os.utime(store.put(str(src), k), (1000 + i, 1000 + i))
    os.utime(store.put(str(src), plan.kc.key("train_base")), (500, 500))  # this run's, older still
    plan.keep(rt, StartupReport(), logs.append)  # after the capture
    assert store.find(plan.kc.key("train_base")) and store.find("old3")
    assert not store.find("old1") and not store.find("old2")
    assert "saved store: dropped the 2 least recently used kept compiles (0 MB) to hold it " \
           "under runtime.saved_store_gb=2.5e-06" in logs, logs
    logs.clear()
    rt = _runtime(_rt(pc, saved_store_gb=4.0), logs)
    plan = _plan(rt, monkeypatch, logs)
    store.put(str(src), "old4")
    plan.keep(rt, StartupReport(), logs.append)  # under the limit: nothing dropped
    assert store.find("old3") and store.find("old4") and not any("dropped" in ln for ln in logs), logs


if __name__ == "__main__":
    pytest.main([__file__, "-q"])
