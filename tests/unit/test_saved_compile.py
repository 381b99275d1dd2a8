"""runtime.precompile_saved: a variant's forward and backward compiled whole in a parallel-compile
child, saved, and loaded by the training process without Dynamo (CPU: Inductor's C++ code)."""
from __future__ import annotations

import dataclasses
import pickle

import pytest
import torch

from tr_hydra.runtime import precompile as pcm
from tr_hydra.runtime import saved_compile
from tests.helpers import small_config


def test_this_pytorch_can_save_and_load_a_whole_compile():
    assert saved_compile.supported() == ""


def _fill_inputs(tr, variant: str) -> None:
    img, lab = tr.ex.input_views(variant, "A")
    g = torch.Generator().manual_seed(1)
    img.copy_(torch.randn(img.shape, generator=g).to(img.dtype))
    lab.copy_(torch.randint(0, 10, lab.shape, generator=g))


def test_the_childrens_saved_compiles_load_here_and_step_to_the_same_bits(tmp_path, monkeypatch):
    """The Precompiler's real children compile a training and a validation variant whole and
    save them (with an EMA and the folded BatchNorm of validation). A trainer that loads the
    files and steps both variants ends with the same arena, bit for bit, as one that compiles
    them through Dynamo; the loaded forward refuses an input it was not compiled for."""
    from tr_hydra.runtime.runner import Trainer
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "cache"))
    pc = small_config(compile="inductor", train_size=80, val_size=40, ema=True, bn_folded=True)
    pc = dataclasses.replace(pc, runtime=dataclasses.replace(pc.runtime, precompile=2))
    logs = []
    pre = pcm.Precompiler(pc, [("train_last", True), ("val_last", False)], workers=2, log=logs.append, saved=True)
    try:
        pre.wait("train_last")
        pre.wait("val_last")
        s = pre.summary()
        paths = {v: pre.saved_forward(v) for v in ("train_last", "val_last")}
        assert all(paths.values()), (s, logs)
        for v in paths:
            assert s[v]["ok"] and s[v]["saved_bytes"][v] > 0 and "saved_errors" not in s[v], s
        arenas = {}
        for mode in ("saved", "traced"):
            tr = Trainer(pc, tmp_path / mode, log=lambda *_: None, telemetry=False, source=False, launcher=False)
            if mode == "saved":
                for v, p in paths.items():
                    tr.ex.load_saved_forward(v, p)
            _fill_inputs(tr, "train_last")
            tr.ex.train_step("train_last", "A")
            tr.model.eval()
            with tr.ex.folded():
                tr.ex.val_step("val_last", "A")
            tr.model.train()
            arenas[mode] = tr.arena.arena.clone()
            if mode == "saved":
                f = tr.ex.saved_forwards["train_last"]
                x, _ = tr.ex._model_input(saved_compile_ctx("train_last"))
                tr.model.eval()
                with pytest.raises(RuntimeError, match="train_last: called with another input.*training True"):
                    f(x)
                tr.model.train()
                with pytest.raises(RuntimeError, match=r"shape \(\d+, 3, 16, 16\) \(compiled\) against \(2,"):
                    f(x[:2])
    finally:
        pre.close()
    assert torch.equal(arenas["saved"], arenas["traced"])
    assert not torch.equal(arenas["saved"], torch.zeros_like(arenas["saved"]))


def saved_compile_ctx(variant: str):
    from tr_hydra.runtime.executor import StepContext
    return StepContext(variant, "A")


def test_load_refuses_a_file_of_another_format_or_pytorch(tmp_path):
    sig = saved_compile.Signature((1,), (1,), "torch.float32", "cpu", True, True, (False, ""))
    other = tmp_path / "other"
    other.write_bytes(pickle.dumps({"format": saved_compile.FORMAT + 1}))
    with pytest.raises(ValueError, match="not a saved compile of this tr_hydra"):
        saved_compile.load(str(other), torch.nn.Linear(1, 1))
    old = tmp_path / "old"
    old.write_bytes(pickle.dumps({"format": saved_compile.FORMAT, "torch": "2.0.0", "signature": sig, "fn": b""}))
    with pytest.raises(ValueError, match="saved by PyTorch 2.0.0"):
        saved_compile.load(str(old), torch.nn.Linear(1, 1))


def test_a_compile_that_cannot_be_saved_leaves_the_step_to_the_ordinary_compile(tmp_path, monkeypatch):
    """The recorder keeps the error, leaves no file and returns None (the executor then calls
    its ordinary forward); the compile-end callback runs either way."""
    def fails(*a, **k):
        raise RuntimeError("cannot serialize")
    monkeypatch.setattr(saved_compile, "compile_forward", fails)
    path = tmp_path / "train_last.forward"
    path.write_bytes(b"partial")
    ended = []
    rec = saved_compile.Recorder({"train_last": str(path)}, on_compiled=lambda: ended.append(1))
    net = torch.nn.Linear(3, 2)
    assert rec.forward("train_last", net, torch.randn(4, 3)) is None
    assert not path.exists() and ended == [1] and rec.paths == {}
    rep = rec.report()
    assert rep["saved_errors"] == {"train_last": "RuntimeError: cannot serialize"} and "train_last" in rep["saved_s"]


def test_the_executor_calls_its_ordinary_forward_where_the_recorder_could_not_save(tmp_path, monkeypatch):
    from tr_hydra.runtime.runner import Trainer
    monkeypatch.setattr(saved_compile, "compile_forward", lambda *a, **k: (_ for _ in ()).throw(OSError("disk full")))
    tr = Trainer(small_config(), tmp_path, log=lambda *_: None, telemetry=False, source=False, launcher=False)
    tr.ex.recorder = saved_compile.Recorder({"train_base": str(tmp_path / "f")})
    x = torch.randn(2, 3, 16, 16)
    assert tr.ex._forward_of("train_base", x) is tr.ex.forward_fn
    assert "train_base" not in tr.ex.saved_forwards and "disk full" in tr.ex.recorder.errors["train_base"]


def test_saved_compiles_are_used_only_where_the_compile_is_the_ordinary_one(tmp_path):
    from tr_hydra.runtime.runner import Trainer
    logs = []

    def wanted(twins=False, **runtime):
        pc = small_config()
        pc = dataclasses.replace(pc, runtime=dataclasses.replace(pc.runtime, **runtime))
        tr = Trainer(pc, tmp_path / str(len(logs)), log=logs.append, telemetry=False, source=False, launcher=False)
        return tr._saved_wanted(twins)

    assert wanted() is True
    n = len(logs)
    assert wanted(precompile_saved=False) is False and len(logs) == n  # turned off: nothing to say
    for runtime, why in (({"dynamic_batch": True}, "runtime.dynamic_batch"),
                         ({"recompute": "pointwise"}, "runtime.recompute"),
                         ({"reuse_blocks": True}, "runtime.reuse_blocks"),
                         ({"backward_streams": 2}, "runtime.backward_streams")):
        assert wanted(**runtime) is False
        assert any(f"runtime.precompile_saved: not used (not with {why})" in ln for ln in logs), logs
    assert wanted(twins=True) is False
    assert any("not with runtime.precompile_backward" in ln for ln in logs), logs


def test_a_saved_compile_that_does_not_load_is_traced_here_instead(tmp_path):
    from tr_hydra.runtime.runner import Trainer
    bad = tmp_path / "val_base.forward"
    bad.write_bytes(b"not a pickle")
    logs = []
    tr = Trainer(small_config(), tmp_path / "run", log=logs.append, telemetry=False, source=False, launcher=False)

    class Pre:
        def saved_forward(self, name):
            return str(bad) if name == "val_base" else None

    tr._load_saved(Pre(), "val_base")
    tr._load_saved(Pre(), "val_last")  # no file from its child: nothing to do
    assert tr.ex.saved_forwards == {} and tr.saved_load_s == {}
    assert any(ln.startswith("  val_base: its saved compile did not load (") and ln.endswith("tracing it here")
               for ln in logs), logs


def test_the_precompiler_hands_over_only_files_that_done_children_wrote(tmp_path):
    pre = pcm.Precompiler.__new__(pcm.Precompiler)  # the bookkeeping only: no child is started
    pre.children = [pcm._Child("train_last", True, saved=str(tmp_path / "a")),
                    pcm._Child("val_base", False, saved=str(tmp_path / "b")),
                    pcm._Child("val_last", False)]
    (tmp_path / "a").write_bytes(b"x")
    pre.children[0].ok = True
    pre.children[1].ok = True  # done, but wrote no file
    assert pre.saved_forward("train_last") == str(tmp_path / "a")
    assert pre.saved_forward("val_base") is None and pre.saved_forward("val_last") is None
    pre.children[0].ok = False  # a failed child's file is not used
    assert pre.saved_forward("train_last") is None
    assert pre.saved_forward("train_base") is None  # the main process's own variant


def test_the_option_is_on_by_default_and_can_be_turned_off():
    from tr_hydra.cli._common import compose
    from tr_hydra.config.plan_config import plan_config_from
    assert plan_config_from(compose([])).runtime.precompile_saved is True
    assert plan_config_from(compose(["runtime.precompile_saved=false"])).runtime.precompile_saved is False


def test_the_max_pooling_kernel_is_found_by_module_and_name():
    """A saved compile that launches the gathering max-pool backward (a user Triton kernel) finds
    it again by module and name when it is loaded."""
    pytest.importorskip("triton")
    from torch._dynamo.aot_compile_types import _deserialize_triton_kernel, _serialize_triton_kernel
    from tr_hydra.ops import maxpool
    info = _serialize_triton_kernel(maxpool._kernel())
    assert info == ("tr_hydra.ops.maxpool", "maxpool_gather_backward_kernel")
    assert _deserialize_triton_kernel(info) is maxpool._kernel()
    with pytest.raises(AttributeError):
        maxpool.no_such_thing  # noqa: B018


def test_tr_bench_prints_the_saved_compiles_and_their_loads():
    from tr_hydra.cli.bench import _precompile_line, mix_table
    s = {"train_last": {"ok": True, "seconds": 43.4, "start": "fork", "step_s": 40.0,
                        "saved_s": {"train_last": 34.5}, "saved_bytes": {"train_last": 9_000_000}},
         "val_last": {"ok": True, "seconds": 17.8, "start": "fork", "step_s": 15.0,
                      "saved_s": {"val_last": 2.0}, "saved_bytes": {},
                      "saved_errors": {"val_last": "RuntimeError: cannot serialize"}}}
    line = _precompile_line(s, 3.8)
    assert "train_last 43.4s (step 40.0s, compiled whole and saved in 34.5s)" in line, line
    assert "val_last 17.8s (step 15.0s, not saved (RuntimeError: cannot serialize))" in line, line
    r = {"img_per_sec": 8637.0, "first_step_of_all_variants_seconds": 50.8,
         "step_ms_by_variant": {"train_base": 34.94, "train_last": 16.46},
         "saved_load_seconds": {"train_last": 0.59}}
    mix = {"variants": {"train_base": {"batch": 256, "res": 224, "train": True},
                        "train_last": {"batch": 104, "res": 224, "train": True}}, "modes": {"tr": r}}
    assert "tr: the main process loaded 1 saved compile in 0.6s (runtime.precompile_saved): train_last 0.59s" \
        in mix_table(mix).splitlines()
    r["saved_load_seconds"] = {}  # none loaded (the option off, or no parallel compiles): no line
    assert "saved compile" not in mix_table(mix)
