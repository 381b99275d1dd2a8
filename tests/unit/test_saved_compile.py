"""Whole compiles: a variant's forward and backward compiled whole in a parallel-compile child,
saved, and loaded by the training process without Dynamo (CPU: Inductor's C++ code)."""
from __future__ import annotations

import dataclasses
import pickle

import pytest
import torch

from tr_hydra import startup
from tr_hydra.internals import saved_compile
from tr_hydra.runtime.build import Runtime
from tr_hydra.startup import children as pcm
from tests.helpers import small_config

GiB = 2**30


def _fill_inputs(rt, variant: str) -> None:
    img, lab = rt.ex.input_views(variant, "A")
    g = torch.Generator().manual_seed(1)
    img.copy_(torch.randn(img.shape, generator=g).to(img.dtype))
    lab.copy_(torch.randint(0, 10, lab.shape, generator=g))


def test_the_childrens_saved_compiles_load_here_and_step_to_the_same_bits(tmp_path, monkeypatch):
    """The Precompiler's real children compile a training and a validation variant whole and
    save them (with an EMA and the folded BatchNorm of validation). A runtime that loads the
    files and steps both variants ends with the same arena, bit for bit, as one that compiles
    them through Dynamo; the loaded forward refuses an input it was not compiled for."""
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
            rt = Runtime(pc, log=lambda *_: None, source=False)
            if mode == "saved":
                for v, p in paths.items():
                    rt.forwards.load(v, p)
            _fill_inputs(rt, "train_last")
            rt.ex.train_step("train_last", "A")
            rt.model.eval()
            with rt.ex.folded():
                rt.ex.val_step("val_last", "A")
            rt.model.train()
            arenas[mode] = rt.arena.arena.clone()
            if mode == "saved":
                f = rt.forwards.saved("train_last")
                x, _ = rt.ex._model_input(saved_compile_ctx("train_last"))
                rt.model.eval()
                with pytest.raises(RuntimeError, match="train_last: called with another input.*training True"):
                    f(x)
                rt.model.train()
                with pytest.raises(RuntimeError, match=r"shape \(\d+, 3, 16, 16\) \(compiled\) against \(2,"):
                    f(x[:2])
    finally:
        pre.close()
    assert torch.equal(arenas["saved"], arenas["traced"])
    assert not torch.equal(arenas["saved"], torch.zeros_like(arenas["saved"]))


def saved_compile_ctx(variant: str):
    from tr_hydra.runtime.executor import StepContext
    return StepContext(variant, "A")


def test_the_cpu_model_computes_nchw_and_its_whole_compile_loads_back(tmp_path, monkeypatch):
    """On the CPU each plain convolution reads contiguous copies (``model_prep.NCHWConv2d``): the
    same numbers as ``F.conv2d`` over NCHW tensors, its weight's gradient back in the
    channels_last arena view. The model so prepared is compiled whole, saved and loaded back (a
    forward set as a closure was not: PyTorch 2.11 cannot load a guard on its default argument)."""
    from tr_hydra.runtime.model_prep import NCHWConv2d
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "cache"))
    rt = Runtime(small_config(compile="inductor"), log=lambda *_: None, source=False)
    convs = [m for m in rt.model.modules() if isinstance(m, torch.nn.Conv2d)]
    assert convs and all(type(m) is NCHWConv2d for m in convs if type(m).__module__ != "tr_hydra.models.stem")
    conv = next(m for m in convs if type(m) is NCHWConv2d)
    assert conv.weight.is_contiguous(memory_format=torch.channels_last) and not conv.weight.is_contiguous()
    x = torch.randn(2, conv.in_channels, 8, 8).to(memory_format=torch.channels_last).requires_grad_()
    x2 = x.detach().contiguous().requires_grad_()
    w = conv.weight.detach().contiguous().requires_grad_()
    ref = torch.nn.functional.conv2d(x2, w, conv.bias, conv.stride, conv.padding)
    conv.weight.grad.zero_()  # the arena's gradient view, which backward accumulates into
    out = conv(x)
    assert torch.equal(out, ref)
    out.square().sum().backward()
    ref.square().sum().backward()
    assert torch.equal(conv.weight.grad, w.grad) and torch.equal(x.grad, x2.grad)
    v = rt.pc.variants[0]
    x = torch.randn(v.batch, 3, v.res, v.res)
    f = saved_compile.compile_forward(rt.model, x, name=v.name)
    saved_compile.save(f, str(tmp_path / "f"))
    g = saved_compile.load(str(tmp_path / "f"), rt.model, v.name)
    assert torch.equal(g(x), f(x))


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
    monkeypatch.setattr(saved_compile, "compile_forward", lambda *a, **k: (_ for _ in ()).throw(OSError("disk full")))
    rt = Runtime(small_config(), log=lambda *_: None, source=False)
    rec = rt.forwards.record({"train_base": str(tmp_path / "f")})
    x = torch.randn(2, 3, 16, 16)
    assert rt.forwards.for_variant("train_base", x) is rt.forwards.traced
    assert rt.forwards.saved("train_base") is None and "disk full" in rec.errors["train_base"]
    got = rt.forwards.report()
    assert got.served == {"train_base": "traced"} and "disk full" in got.errors["train_base"]


def test_saved_compiles_are_used_only_where_the_compile_is_the_ordinary_one(tmp_path, monkeypatch):
    """A whole compile leaves out runtime.recompute's partitioner options: with them, the
    children save nothing (they only fill Inductor's caches), this process compiles nothing
    whole and the saved store is not used; one line says so. Without them, all three are on."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "cache"))
    seen = {}

    class Fake:
        def __init__(self, pc, order, n, log=None, device_index=0, launcher=None, saved=True):
            seen.update(order=order, saved=saved)
    monkeypatch.setattr(startup, "Precompiler", Fake)
    monkeypatch.setattr(startup, "caches_enabled", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (100 * GiB, 141 * GiB))

    def plan(**runtime):
        pc = small_config(train_size=80, val_size=40)
        pc = dataclasses.replace(pc, runtime=dataclasses.replace(pc.runtime, precompile=1, **runtime))
        rt = Runtime(pc, log=lambda *_: None, source=False)
        rt.inductor = True  # as on CUDA
        logs = []
        seen.clear()
        return startup._Plan(rt, None, logs.append), logs

    p, logs = plan()
    assert seen["saved"] is True and p.kc is not None and p.whole == ["train_base"] and p.own == "train_base"
    assert not any("no whole compiles" in ln for ln in logs), logs
    p, logs = plan(recompute="pointwise")
    assert seen["saved"] is False and p.kc is None and p.whole == [] and p.own == "train_base"
    assert seen["order"] == [("train_last", True), ("val_base", False), ("val_last", False)]
    assert any(ln.startswith("runtime.recompute=pointwise: no whole compiles") for ln in logs), logs


def test_a_saved_compile_that_does_not_load_is_traced_here_instead(tmp_path):
    bad = tmp_path / "val_base.forward"
    bad.write_bytes(b"not a pickle")
    logs = []
    rt = Runtime(small_config(), log=lambda *_: None, source=False)

    class Pre:
        def saved_forward(self, name):
            return str(bad) if name == "val_base" else None

    plan = startup._Plan(rt, None, logs.append)  # no Inductor here: a plan of nothing
    plan.pre = Pre()
    rep = startup.StartupReport()
    plan.load(rt, "val_base", rep, logs.append)
    plan.load(rt, "val_last", rep, logs.append)  # no file from its child: nothing to do
    assert rt.forwards.report().saved == {} and rep.loaded_s == {}
    assert [ln for ln in logs if ln.startswith("  val_base: its saved compile did not load (")
            and ln.endswith("tracing it here")], logs
    assert len(logs) == 1, logs


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
