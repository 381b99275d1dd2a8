"""runtime.saved_store: the saved compiles kept for later runs of the same plan, under a key of
everything their compiled code depends on (CPU: Inductor's C++ code)."""
from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from tr_hydra.config.plan_config import OptimizerSpec, TrainerSpec
from tr_hydra.runtime import precompile as pcm
from tr_hydra.runtime import saved_compile
from tests.helpers import small_config

GiB = 2**30
CPU = torch.device("cpu")


def _rt(pc, **kw):
    return dataclasses.replace(pc, runtime=dataclasses.replace(pc.runtime, **kw))


def _trainer(pc, path, logs=None):
    from tr_hydra.runtime.runner import Trainer
    return Trainer(pc, path, log=(logs.append if logs is not None else (lambda *_: None)), telemetry=False,
                   source=False, launcher=False)


def test_the_key_follows_what_the_compiled_code_depends_on_and_nothing_else(monkeypatch):
    pc = small_config(compile="inductor", lowres_epochs=1)
    key = saved_compile.store_key(pc, "train_base", CPU)
    assert len(key) == 32 and key == saved_compile.store_key(pc, "train_base", CPU)
    # the same compiled code: another learning rate, schedule, seed, epoch count, logging,
    # number of parallel compiles, cuDNN search; a sweep's next job finds it
    same = [dataclasses.replace(pc, optimizer=OptimizerSpec(name="momentum", lr=0.4, weight_decay=0.0,
                                                            schedule="cosine")),
            dataclasses.replace(pc, seed=7, trainer=TrainerSpec(epochs=9, log_every=3, label_smoothing=0.1)),
            _rt(pc, precompile=3, precompile_first=True, prime_cudnn=False, warmup_steps=5, autotune_flush="off",
                saved_store_gb=0.5),
            dataclasses.replace(pc, data=dataclasses.replace(pc.data, root="/elsewhere", augment=False))]
    for other in same:
        assert saved_compile.store_key(other, "train_base", CPU) == key, other
    # other compiled code
    differ = {"variant": (pc, "train_lowres", CPU),
              "model": (dataclasses.replace(pc, model=dataclasses.replace(pc.model, width=32)), "train_base", CPU),
              "classes": (dataclasses.replace(pc, model=dataclasses.replace(pc.model, num_classes=100)),
                          "train_base", CPU),
              "amp": (dataclasses.replace(pc, amp=True), "train_base", CPU),
              "folded": (dataclasses.replace(pc, bn_folded=True), "train_base", CPU),
              "optimizer": (dataclasses.replace(pc, optimizer=OptimizerSpec(name="adamw")), "train_base", CPU),
              "layout": (_rt(pc, channels_last=False), "train_base", CPU),
              "inductor": (_rt(pc, inductor_options=(("max_autotune", True),)), "train_base", CPU),
              "stem": (_rt(pc, stem="conv"), "train_base", CPU),
              "device": (pc, "train_base", torch.device("meta"))}
    keys = {k: saved_compile.store_key(*a) for k, a in differ.items()}
    assert all(k != key for k in keys.values()), keys
    assert len(set(keys.values())) == len(keys)
    assert saved_compile.store_key(pc, "train_base", CPU, {"max_autotune": True}) != key
    monkeypatch.setattr(torch, "__version__", "2.99.0")
    assert saved_compile.store_key(pc, "train_base", CPU) != key
    monkeypatch.undo()
    monkeypatch.setattr(saved_compile, "source_digest", lambda: "another tr_hydra")
    assert saved_compile.store_key(pc, "train_base", CPU) != key


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
    assert saved_compile.model_digest(r18, "resnet18") != saved_compile.model_digest(r18c, "resnet18_cifar")
    assert saved_compile.model_digest(r18, "resnet18") == saved_compile.model_digest(build_model("resnet18", 10),
                                                                                     "resnet18")
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
        digests.append(saved_compile.model_digest(build_model("user_net", 10), "user_net"))
    sys.modules.pop("user_net", None)
    assert digests[0] != digests[1] and digests[0] == digests[2]
    pc = small_config()
    assert saved_compile.store_key(pc, "train_base", CPU, model=digests[0]) != \
        saved_compile.store_key(pc, "train_base", CPU, model=digests[1])


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
        saved_compile.source_digest.cache_clear()
        digests.append(saved_compile.source_digest())
    monkeypatch.undo()
    saved_compile.source_digest.cache_clear()
    assert digests[0] != digests[1] and digests[0] == digests[2]
    assert saved_compile.source_digest() != digests[0]  # the real package


def test_the_store_keeps_a_whole_copy_and_forgets_it(tmp_path):
    src = tmp_path / "child.forward"
    src.write_bytes(b"compiled" * 1000)
    store = saved_compile.Store(str(tmp_path / "store"))
    assert store.find("k") is None
    kept = store.put(str(src), "k")
    assert store.find("k") == kept and open(kept, "rb").read() == src.read_bytes()
    assert os.listdir(store.root) == ["k.forward"]  # no temporary file left
    store.drop("k")
    store.drop("k")  # twice: nothing to forget
    assert store.find("k") is None


def test_the_store_lies_in_inductors_cache_directory(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "cache"))
    assert saved_compile.Store().root == str(tmp_path / "cache" / "tr_hydra_saved")


def test_a_compile_kept_by_one_run_is_loaded_by_the_next_and_steps_to_the_traced_bits(tmp_path, monkeypatch):
    """Run 1 loads its child's file, steps, and keeps it. Run 2 (another learning rate, seed and
    epoch count: the same key) finds it, loads it instead of compiling, and ends a training step
    with the same arena, bit for bit, as a trainer that compiles the variant through Dynamo."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "cache"))
    from tests.unit.test_saved_compile import _fill_inputs
    pc1 = small_config(compile="inductor", train_size=80, val_size=40)
    # as a child would: compiled whole and saved on the variant's first step
    child = _trainer(pc1, tmp_path / "child")
    child_file = str(tmp_path / "train_last.forward")
    child.ex.recorder = saved_compile.Recorder({"train_last": child_file})
    _fill_inputs(child, "train_last")
    child.ex.train_step("train_last", "A")
    assert os.path.exists(child_file) and not child.ex.recorder.errors

    class Pre:  # the precompiler's hand-over: the file its done child wrote
        def saved_forward(self, name):
            return child_file if name == "train_last" else None

    logs = []
    run1 = _trainer(pc1, tmp_path / "run1", logs)
    run1._find_stored(["train_base", "train_last", "val_base", "val_last"])
    assert run1._stored == {} and run1._store is not None  # an empty store
    run1._load_saved(Pre(), "train_last")
    _fill_inputs(run1, "train_last")
    run1.ex.train_step("train_last", "A")
    run1._keep_saved(Pre())
    assert run1.saved_stored == ["train_last"] and run1.saved_from_store == []
    kept = saved_compile.Store().find(run1._store_key("train_last"))
    assert kept is not None and open(kept, "rb").read() == open(child_file, "rb").read()

    pc2 = dataclasses.replace(pc1, seed=3, optimizer=OptimizerSpec(name="momentum", lr=0.3, schedule="constant"),
                              trainer=TrainerSpec(epochs=4))
    arenas = {}
    for mode in ("kept", "traced"):
        logs = []
        tr = _trainer(pc2, tmp_path / mode, logs)
        if mode == "kept":
            tr._find_stored(["train_base", "train_last", "val_base", "val_last"])
            assert tr._stored == {"train_last": kept}
            assert "runtime.saved_store: 1 of 4 variants' compiles kept by an earlier run (train_last): " \
                   "loaded, not compiled" in logs, logs
            tr._load_saved(None, "train_last")  # no parallel compiles at all
            assert tr.saved_from_store == ["train_last"] and "train_last" in tr.saved_load_s
        _fill_inputs(tr, "train_last")
        tr.ex.train_step("train_last", "A")
        if mode == "kept":
            assert "train_last" in tr.ex.saved_forwards and tr.ex.saved_mismatch == {}
            tr._keep_saved(None)
            assert tr.saved_stored == []  # loaded from the store: nothing new to keep
        arenas[mode] = tr.arena.arena.clone()
    assert torch.equal(arenas["kept"], arenas["traced"])
    # another width: another key, nothing found
    tr = _trainer(dataclasses.replace(pc1, model=dataclasses.replace(pc1.model, width=8)), tmp_path / "w8")
    tr._find_stored(["train_last"])
    assert tr._stored == {}


def test_a_variant_compiled_whole_here_is_kept_and_the_next_run_loads_it_on_a_thread(tmp_path, monkeypatch):
    """The training process compiles its own variant whole (no child involved), steps through
    that compile, and keeps it after the capture; the next run loads it on a thread (as during
    cuDNN's search) and steps. Both end with the same arena, bit for bit, as a trainer that
    traces the variant through Dynamo."""
    import threading
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "cache"))
    from tests.unit.test_saved_compile import _fill_inputs
    pc1 = small_config(compile="inductor", train_size=80, val_size=40)
    pc2 = dataclasses.replace(pc1, seed=5, optimizer=OptimizerSpec(name="momentum", lr=0.2, schedule="constant"))
    arenas = {}
    logs = []
    own = _trainer(pc1, tmp_path / "own", logs)
    own._find_stored(["train_base", "train_last"])
    assert own._stored == {}
    own._own_whole = ["train_last"]
    told = []

    class Job:  # the search ahead, waiting for the end of the first compile
        def compiled(self):
            told.append(dict(own.ex.saved_forwards))

    own._ahead_job = Job()
    own.ex.recorder = saved_compile.Recorder({"train_last": None}, own.ex.compile_options,
                                             on_compiled=own._whole_compiled)
    _fill_inputs(own, "train_last")
    own.ex.train_step("train_last", "A")
    # told once, after the compile and before its code ran (the step had not used it yet)
    assert told == [{}] and not own.ex.recorder.errors
    assert isinstance(own.ex.saved_forwards["train_last"], saved_compile.SavedForward)
    own._keep_saved(None)
    assert own.saved_stored == ["train_last"] and own.saved_store_write_s > 0
    assert list(own.whole_compile_s()) == ["train_last"] and own.whole_compile_s()["train_last"] > 0
    kept = saved_compile.Store().find(own._store_key("train_last"))
    assert kept is not None and os.path.getsize(kept) > 0
    assert not [f for f in os.listdir(os.path.dirname(kept)) if f.endswith(".tmp")]
    arenas["own"] = own.arena.arena.clone()

    threads = []
    real_load = saved_compile.load

    def load(path, model, name=""):
        threads.append(threading.get_ident())
        return real_load(path, model, name)
    monkeypatch.setattr(saved_compile, "load", load)
    logs = []
    nxt = _trainer(pc2, tmp_path / "next", logs)
    nxt._find_stored(["train_base", "train_last"])
    assert nxt._stored == {"train_last": kept}
    with nxt._preloading():
        pass
    assert threads and threads[0] != threading.get_ident() and list(nxt._preloaded) == ["train_last"]
    nxt._load_saved(None, "train_last")
    assert nxt.saved_preloaded == ["train_last"] and nxt.saved_from_store == ["train_last"]
    assert nxt.saved_load_s["train_last"] > 0 and len(threads) == 1  # not loaded a second time
    _fill_inputs(nxt, "train_last")
    nxt.ex.train_step("train_last", "A")
    assert nxt.ex.saved_mismatch == {}
    nxt._keep_saved(None)
    assert nxt.saved_stored == []
    arenas["kept"] = nxt.arena.arena.clone()

    traced = _trainer(pc1, tmp_path / "traced")
    _fill_inputs(traced, "train_last")
    traced.ex.train_step("train_last", "A")
    arenas["traced"] = traced.arena.arena.clone()
    # the optimizers' learning rates differ between pc1 and pc2: compare each with its own
    # trainer's traced twin (pc1's here); the forward and backward compile is one
    assert torch.equal(arenas["own"], arenas["traced"])
    traced2 = _trainer(pc2, tmp_path / "traced2")
    _fill_inputs(traced2, "train_last")
    traced2.ex.train_step("train_last", "A")
    assert torch.equal(arenas["kept"], traced2.arena.arena)


def test_the_training_process_compiles_whole_what_no_child_takes(tmp_path, monkeypatch):
    logs = []
    tr = _capturing_trainer(tmp_path, monkeypatch, logs)
    tr._precompiler(["train_base", "train_last"], ["val_base"])
    # runtime.precompile_own=auto: the validation variant here, the children take the others
    assert tr._own_whole == ["val_base"] and tr._own_first == "val_base"
    tr = _capturing_trainer(tmp_path, monkeypatch, logs, precompile_own="first")
    tr._precompiler(["train_base", "train_last"], ["val_base"])
    assert tr._own_whole == ["train_base"] and tr._own_first == "train_base"
    tr = _capturing_trainer(tmp_path, monkeypatch, logs)
    _keep(tr, ["train_last", "val_base"])
    assert tr._precompiler(["train_base", "train_last"], ["val_base"]) is None
    assert tr._own_whole == ["train_base"]
    _keep(tr, ["train_base"])
    tr = _capturing_trainer(tmp_path, monkeypatch, logs)
    assert tr._precompiler(["train_base", "train_last"], ["val_base"]) is None
    assert tr._own_whole == [] and list(tr._stored) == ["train_base", "train_last", "val_base"]
    # no parallel compiles: every variant not kept is compiled here
    tr = _capturing_trainer(tmp_path / "none", monkeypatch, logs, precompile=0)
    assert tr._precompiler(["train_base", "train_last"], ["val_base"]) is None
    assert tr._own_whole == ["train_base", "train_last", "val_base"]
    # no store: compiled as before (through Dynamo, lazily)
    for off in ({"saved_store": False}, {"precompile_saved": False}, {"precompile_backward": True}):
        tr = _capturing_trainer(tmp_path / "off", monkeypatch, logs, **off)
        tr._precompiler(["train_base", "train_last"], ["val_base"])
        assert tr._own_whole == [], off


def test_a_kept_compile_that_does_not_load_is_dropped_and_compiled_here(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "cache"))
    logs = []
    tr = _trainer(small_config(compile="inductor"), tmp_path / "run", logs)
    store = saved_compile.Store()
    bad = tmp_path / "bad"
    bad.write_bytes(b"not a pickle")
    store.put(str(bad), tr._store_key("val_base"))
    tr._find_stored(["train_base", "val_base"])
    assert list(tr._stored) == ["val_base"]
    tr._load_saved(None, "val_base")
    assert tr.ex.saved_forwards == {} and tr.saved_from_store == [] and tr.saved_load_s == {}
    assert store.find(tr._store_key("val_base")) is None  # the next run compiles it again
    assert any(ln.startswith("  val_base: the saved compile kept by an earlier run did not load (")
               and ln.endswith("compiling it here (and dropping that file)") for ln in logs), logs
    # loaded on a thread during cuDNN's search: the same, when the variant warms up
    store.put(str(bad), tr._store_key("val_base"))
    logs.clear()
    tr._find_stored(["train_base", "val_base"])
    with tr._preloading():
        pass
    assert isinstance(tr._preloaded["val_base"][0], Exception)
    tr._load_saved(None, "val_base")
    assert tr.ex.saved_forwards == {} and tr.saved_preloaded == [] and tr._preloaded == {}
    assert store.find(tr._store_key("val_base")) is None
    assert any(ln.startswith("  val_base: the saved compile kept by an earlier run did not load (")
               for ln in logs), logs


def test_a_kept_compile_made_for_another_input_is_not_called_and_is_dropped(tmp_path, monkeypatch):
    """Were a key to miss a difference, the input's signature still catches it: the executor
    steps with its ordinary forward, and the file is dropped."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "cache"))
    logs = []
    tr = _trainer(small_config(), tmp_path / "run", logs)
    tr._store = saved_compile.Store()
    key = tr._store_key("train_base")
    (tmp_path / "f").write_bytes(b"x")
    tr._store.put(str(tmp_path / "f"), key)
    calls = []
    sig = saved_compile.Signature((2, 3, 16, 16), (768, 1, 48, 3), "torch.float32", "cpu", True, True, (False, ""))
    tr.ex.saved_forwards["train_base"] = saved_compile.SavedForward(lambda m, x: calls.append(x), tr.model, sig,
                                                                    "train_base")
    tr.saved_load_s["train_base"] = 0.1
    tr.saved_from_store.append("train_base")
    x = torch.randn(32, 3, 16, 16)
    assert tr.ex._forward_of("train_base", x) is tr.ex.forward_fn and calls == []
    assert tr.ex.saved_mismatch == {"train_base": "shape (2, 3, 16, 16) (compiled) against (32, 3, 16, 16)"}
    tr._keep_saved(None)
    assert tr.saved_from_store == [] and tr.saved_load_s == {} and tr._store.find(key) is None
    assert "  train_base: its saved compile was made for another input (shape (2, 3, 16, 16) (compiled) " \
           "against (32, 3, 16, 16)); compiled here instead" in logs, logs


class _Fake:
    seen: dict = {}

    def __init__(self, pc, order, n, log=None, device_index=0, also=None, launcher=None, twins=(), saved=False,
                 share_training=True):
        _Fake.seen = dict(order=order, n=n, twins=twins, saved=saved)


def _capturing_trainer(tmp_path, monkeypatch, logs, **runtime):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(pcm, "Precompiler", _Fake)
    monkeypatch.setattr(pcm, "caches_enabled", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (100 * GiB, 141 * GiB))
    pc = _rt(small_config(train_size=200, batch=32, val_size=64, val_batch=32), **{"precompile": 8, **runtime})
    tr = _trainer(pc, tmp_path / f"run{len(logs)}", logs)
    tr.inductor = True  # as on CUDA with runtime.compile=auto
    return tr


def _keep(tr, names):
    tr.run_dir.mkdir(parents=True, exist_ok=True)
    f = tr.run_dir / "f"
    f.write_bytes(b"x")
    for v in names:
        saved_compile.Store().put(str(f), tr._store_key(v))


def test_kept_variants_get_no_child_and_a_run_with_all_of_them_starts_none(tmp_path, monkeypatch):
    logs = []
    _Fake.seen = {}
    tr = _capturing_trainer(tmp_path, monkeypatch, logs, precompile_own="first")
    _keep(tr, ["train_last"])
    assert isinstance(tr._precompiler(["train_base", "train_last"], ["val_base"]), _Fake)
    assert _Fake.seen["order"] == [("val_base", False)] and _Fake.seen["n"] == 1 and _Fake.seen["saved"] is True
    assert "compiling 2 variants: train_base here, 1 in 1 parallel process" in logs, logs
    assert list(tr._stored) == ["train_last"]
    tr = _capturing_trainer(tmp_path, monkeypatch, logs)  # precompile_own=auto: the child takes train_base
    assert isinstance(tr._precompiler(["train_base", "train_last"], ["val_base"]), _Fake)
    assert _Fake.seen["order"] == [("train_base", True)] and _Fake.seen["n"] == 1
    assert "compiling 2 variants: val_base here, 1 in 1 parallel process" in logs, logs
    # all the variants after the first kept: no child, no precompiler
    _Fake.seen = {}
    tr = _capturing_trainer(tmp_path, monkeypatch, logs)
    _keep(tr, ["train_last", "val_base"])
    assert tr._precompiler(["train_base", "train_last"], ["val_base"]) is None and _Fake.seen == {}
    assert list(tr._stored) == ["train_last", "val_base"]
    # turned off: neither read nor written
    tr = _capturing_trainer(tmp_path, monkeypatch, logs, saved_store=False)
    assert isinstance(tr._precompiler(["train_base", "train_last"], ["val_base"]), _Fake)
    assert _Fake.seen["order"] == [("train_base", True), ("train_last", True)] and tr._stored == {}
    assert tr._store is None
    # with twins (precompile_backward) the saved compiles are not used: nor is the store
    tr = _capturing_trainer(tmp_path, monkeypatch, logs, precompile_backward=True)
    tr._precompiler(["train_base", "train_last"], ["val_base"])
    assert _Fake.seen["order"] == [("train_last", True), ("val_base", False)] and tr._stored == {}


def test_no_launcher_is_started_when_every_child_variant_is_kept(tmp_path, monkeypatch):
    from tr_hydra.runtime.runner import Trainer
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(pcm, "launcher_wanted", lambda *a: True)
    started = []

    class Launcher:
        def __init__(self, log=None):
            started.append(1)

        def close(self):
            pass

    monkeypatch.setattr(pcm, "Launcher", Launcher)
    pc = small_config(train_size=200, batch=32, val_size=64, val_batch=32)
    tr = Trainer(pc, tmp_path / "a", log=lambda *_: None, telemetry=False, source=False)
    assert tr._launcher is not None and started == [1]  # nothing kept yet
    _keep(tr, ["train_last", "val_base"])
    tr = Trainer(pc, tmp_path / "b", log=lambda *_: None, telemetry=False, source=False)
    assert tr._launcher is None and started == [1]
    pc_first = _rt(pc, precompile_first=True)  # the first variant would go to a child too
    tr = Trainer(pc_first, tmp_path / "c", log=lambda *_: None, telemetry=False, source=False)
    assert tr._launcher is not None and started == [1, 1]


def test_the_option_is_on_by_default_and_can_be_turned_off():
    from tr_hydra.cli._common import compose
    from tr_hydra.config.plan_config import plan_config_from
    from tr_hydra.errors import ConfigError
    assert plan_config_from(compose([])).runtime.saved_store is True
    assert plan_config_from(compose(["runtime.saved_store=false"])).runtime.saved_store is False
    assert plan_config_from(compose([])).runtime.saved_store_gb == 4.0
    assert plan_config_from(compose(["runtime.saved_store_gb=0.5"])).runtime.saved_store_gb == 0.5
    assert plan_config_from(compose(["runtime.saved_store_gb=null"])).runtime.saved_store_gb is None
    for bad in ("0", "-1"):
        with pytest.raises(ConfigError, match=r"runtime.saved_store_gb: must be null \(no limit\) or a size in GB > 0"):
            plan_config_from(compose([f"runtime.saved_store_gb={bad}"]))


def test_the_store_is_trimmed_least_recently_used_first_never_this_runs(tmp_path):
    store = saved_compile.Store(str(tmp_path / "store"))
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
    assert saved_compile.Store(str(tmp_path / "none")).trim(0) == (0, 0)  # no directory yet


def test_a_run_trims_the_store_to_its_limit_after_keeping_its_own(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "cache"))
    logs = []
    pc = _rt(small_config(compile="inductor"), saved_store_gb=2.5e-6)  # 2,500 bytes
    tr = _trainer(pc, tmp_path / "run", logs)
    tr._find_stored(["train_base", "train_last"])
    store = tr._store
    src = tmp_path / "src"
    src.write_bytes(b"x" * 1000)
    for i, k in enumerate(["old1", "old2", "old3"]):  # other plans' compiles, earlier runs
        os.utime(store.put(str(src), k), (1000 + i, 1000 + i))
    os.utime(store.put(str(src), tr._store_key("train_base")), (500, 500))  # this run's, older still
    tr._trim_store()
    assert store.find(tr._store_key("train_base")) and store.find("old3")
    assert not store.find("old1") and not store.find("old2")
    assert "runtime.saved_store: dropped the 2 least recently used kept compiles (0 MB) to hold the store " \
           "under runtime.saved_store_gb=2.5e-06" in logs, logs
    tr = _trainer(_rt(pc, saved_store_gb=None), tmp_path / "run2", logs)
    tr._find_stored(["train_base"])
    store.put(str(src), "old4")
    tr._trim_store()  # no limit: nothing dropped
    assert store.find("old3") and store.find("old4")


def test_tr_bench_says_which_loads_came_from_the_store():
    from tr_hydra.cli.bench import mix_table
    r = {"img_per_sec": 8637.0, "first_step_of_all_variants_seconds": 9.8,
         "step_ms_by_variant": {"train_base": 34.94, "train_last": 16.46},
         "saved_load_seconds": {"train_last": 0.59, "val_base": 0.3}, "saved_from_store": ["train_last", "val_base"]}
    mix = {"variants": {"train_base": {"batch": 256, "res": 224, "train": True},
                        "train_last": {"batch": 104, "res": 224, "train": True}}, "modes": {"tr": r}}
    line = next(ln for ln in mix_table(mix).splitlines() if "saved compile" in ln)
    assert line.endswith("; 2 of them kept by an earlier run (runtime.saved_store), no child compiled them"), line
    r["saved_preloaded"] = ["train_last", "val_base"]
    line = next(ln for ln in mix_table(mix).splitlines() if "saved compile" in ln)
    assert line.endswith("no child compiled them; 2 loaded on a thread during cuDNN's search"), line
    r["whole_compile_seconds"] = {"train_base": 41.27}
    assert "tr: compiled whole here, to be kept (runtime.saved_store): train_base 41.3s" \
        in mix_table(mix).splitlines()
    r["saved_from_store"] = []
    assert "kept by an earlier run" not in mix_table(mix)


if __name__ == "__main__":
    pytest.main([__file__, "-q"])
