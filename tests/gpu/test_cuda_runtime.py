"""CUDA: capture, replay equal to the eager step, all six variants, fp16 skip, no allocations."""
from __future__ import annotations

import pytest
import torch

from tests.helpers import small_config
from tr_hydra.config.epochs import epoch_schedule
from tr_hydra.config.specs import OptimizerSpec
from tr_hydra import startup
from tr_hydra.runtime.build import Runtime
from tr_hydra.train.trainer import Trainer

pytestmark = pytest.mark.cuda


def _train(pc, tmp_path, name):
    tr = Trainer(pc, tmp_path / name, log=lambda *_: None)
    tr.fit()
    return tr


@pytest.mark.parametrize("amp_dtype", ["bf16", "fp16"])
def test_graph_replay_matches_eager(tmp_path, amp_dtype):
    kw = dict(amp=True, amp_dtype=amp_dtype, device="cuda", max_steps=12, epochs=2)
    eager = _train(small_config(cuda_graph=False, **kw), tmp_path, "eager")
    graph = _train(small_config(cuda_graph=True, **kw), tmp_path, "graph")
    assert graph.graphs is not None and eager.graphs is None
    a, b = eager.final_state_dict(), graph.final_state_dict()
    for k in a:
        if a[k].is_floating_point():
            err = (a[k] - b[k]).abs().max().item()
            scale = a[k].abs().max().item() + 1e-6
            assert err / scale < 2e-2, (k, err, scale)


def test_all_six_variants_captured_and_run(tmp_path):
    pc = small_config(device="cuda", train_size=200, batch=32, val_size=70, val_batch=32,
                      lowres_epochs=1, epochs=2, amp=True, ema=True, bn_folded=True)
    assert [v.name for v in pc.variants] == ["train_base", "train_last", "train_lowres",
                                            "train_lowres_last", "val_base", "val_last"]
    tr = Trainer(pc, tmp_path, log=lambda *_: None)
    res = tr.fit()
    assert len(tr.graphs.train) == 8 and len(tr.graphs.val) == 4
    for rec in res.epochs:
        assert rec["train"]["count"] > 0
        assert rec["val"]["count"] == 70 and rec["val_ema"]["count"] == 70


def test_fp16_inf_skips_update_on_graph(tmp_path):
    pc = small_config(device="cuda", amp=True, amp_dtype="fp16", max_steps=1,
                      optimizer=OptimizerSpec(name="adam", lr=1e-3, schedule="constant"))
    tr = Trainer(pc, tmp_path, log=lambda *_: None)
    tr.get_ready()
    tr.run_steps(epoch_schedule(pc, 0)[:2], "train")
    before = tr.arena.arena.clone()
    scale = tr.ex.scalar("loss_scale")
    img, lab = tr.ex.input_views("train_base", "A")
    img.fill_(float("inf"))
    tr.graphs.train_step("train_base", "A")
    torch.cuda.synchronize()
    assert tr.ex.scalar("found_inf") == 1.0
    assert tr.ex.scalar("loss_scale") == scale / 2
    from tr_hydra.memory.regions import Region as R
    for start, end in [(R.W_BN_BIAS, R.W_DEEP_CONV), (R.M_BN_BIAS, R.M_DEEP_CONV), (R.V_BN_BIAS, R.V_DEEP_CONV)]:
        off, n = tr.compiled.plan.region_range(start, end)
        assert torch.equal(before[off:off + n], tr.arena.arena[off:off + n]), start.name


@pytest.mark.parametrize("compile,folded_ema", [("none", False), ("inductor", False), ("inductor", True)])
def test_no_allocations_after_capture(tmp_path, compile, folded_ema):
    """Training and validation allocate nothing after capture: eager, and with Inductor (the
    default on CUDA: max pooling's gathering backward, ReLU's one-bit masks, the linear layer as
    a reduction); also with the EMA weights swapped in for a second validation and BatchNorm
    folded into a per-channel affine before each (the trainer's whole ``validate``)."""
    pc = small_config(device="cuda", train_size=200, batch=32, lowres_epochs=1, epochs=2, amp=True,
                      compile=compile, model="resnet18", num_classes=10, res=32, lowres_res=32, val_res=32,
                      bn_folded=folded_ema, ema=folded_ema)
    tr = Trainer(pc, tmp_path, log=lambda *_: None)
    tr.get_ready()
    assert compile == "none" or any(type(m).__name__ == "BitmaskReLU" for m in tr.model.modules())
    steps = []
    for e in (0, 1):
        steps += epoch_schedule(pc, e)
    tr.run_steps(steps, "train")  # first replays
    assert ("val_ema" in tr.validator.validate()) == folded_ema
    torch.cuda.synchronize()
    s0 = torch.cuda.memory_stats()
    m0 = torch.cuda.memory_allocated()
    for _ in range(100 // len(steps) + 1):
        tr.run_steps(steps, "train")
        tr.validator.validate()
    torch.cuda.synchronize()
    s1 = torch.cuda.memory_stats()
    assert torch.cuda.memory_allocated() == m0
    assert s1["allocation.all.allocated"] == s0["allocation.all.allocated"]
    assert s1["segment.all.allocated"] == s0["segment.all.allocated"]


def test_inductor_inside_captured_step_keeps_grads_in_arena(tmp_path):
    pc = small_config(device="cuda", compile="inductor", amp=True, epochs=2)
    tr = Trainer(pc, tmp_path, log=lambda *_: None)
    res = tr.fit()
    lo, hi = tr.arena.arena.data_ptr(), tr.arena.arena.data_ptr() + tr.arena.arena.numel()
    for p in tr.model.parameters():
        assert lo <= p.grad.data_ptr() < hi and lo <= p.data_ptr() < hi
    assert res.epochs[-1]["train"]["loss"] < res.epochs[0]["train"]["loss"] + 0.5


def test_deterministic_runs_are_bit_identical_with_graphs(tmp_path):
    import dataclasses
    base = small_config(device="cuda", amp=True, epochs=2, train_size=200, batch=32, lowres_epochs=1,
                        optimizer=OptimizerSpec(name="lars", lr=1.0, schedule="cosine"), ema=True)
    pc = dataclasses.replace(base, runtime=dataclasses.replace(base.runtime, deterministic=True))
    a = _train(pc, tmp_path, "a").final_state_dict()
    b = _train(pc, tmp_path, "b").final_state_dict()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("start", ["fork", "spawn"])
def test_precompiled_variants_are_loaded_whole_and_kept_for_the_next_run(tmp_path, monkeypatch, start):
    """Parallel compiles: every variant but one is compiled by a child (forked from the launcher,
    or a fresh process where forking is not available) into a fresh Inductor cache; each child
    compiles its variant whole and saves it, and the training process loads each file instead of
    tracing the variant, and trains. Where every other variant gets a child of its own, the
    training process compiles a validation variant itself (its compile ends with cuDNN's
    search) and warms it up first. The saved store keeps all six; a later run of the same plan
    with another learning rate loads all six, starts no child nor launcher, and trains."""
    import dataclasses
    from tr_hydra.startup import children
    torch._dynamo.reset()  # an earlier test's compile of the same model would be reused, loading nothing
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor_cache"))
    if start == "spawn":
        monkeypatch.setattr(children, "fork_available", lambda: False)
    pc = small_config(device="cuda", compile="inductor", amp=True, train_size=200, batch=32, val_size=70,
                      val_batch=32, lowres_epochs=1, epochs=2, res=32, lowres_res=24, val_res=32)
    pc = dataclasses.replace(pc, runtime=dataclasses.replace(pc.runtime, precompile=5))
    from tr_hydra.runtime import progress
    monkeypatch.setattr(progress, "EVERY_S", 1.0)  # the warm-up's progress lines, every second here
    logs = []
    tr = Trainer(pc, tmp_path / "run", log=logs.append)
    assert (tr._launcher is not None) == (start == "fork")
    res = tr.fit()
    rep = tr.startup
    s = rep.children
    mine = "val_base"
    kids = ["train_base", "train_last", "train_lowres", "train_lowres_last", "val_last"]
    assert rep.own == mine
    assert any(line.startswith(f"compiling 6 variants: {mine} here, 5 in 5 parallel processes") for line in logs), logs
    assert sorted(s) == kids and all(r["ok"] for r in s.values()), (s, logs)
    assert all(r["start"] == start for r in s.values()), s
    if start == "fork":
        assert all(r["import_s"] < 1.0 for r in s.values()), s
        assert rep.launcher_ready_s is not None
    # every child compiled its variant whole and saved it; the training process loaded all five
    assert all(set(r["saved_s"]) == {n} and r["saved_bytes"][n] > 0 and "saved_errors" not in r
               for n, r in s.items()), s
    assert sorted(rep.loaded_s) == kids, logs
    assert sorted(tr.ex.forwards.report().saved) == sorted(kids + [mine])  # its own compiled whole here too
    assert any(line.startswith("loaded the saved compiles of 5 variants") for line in logs), logs
    assert next(iter(rep.warmup_seconds)) == mine, rep.warmup_seconds
    # it traced no model forward for the children's variants
    assert all(rep.warmup_work[n].get("compiled", 0) == 0 for n in kids), rep.warmup_work
    assert rep.cudnn is not None and rep.cudnn.in_first_compile, logs
    assert res.epochs[-1]["train"]["loss"] == res.epochs[-1]["train"]["loss"]  # finite, not NaN
    assert res.epochs[-1]["val"]["loss"] == res.epochs[-1]["val"]["loss"]
    # while it compiled and waited, the warm-up said so; the lines end before the capture
    still = [i for i, line in enumerate(logs) if line.startswith("  still ")]
    captured = next(i for i, line in enumerate(logs) if line.startswith("captured "))
    assert still and max(still) < captured, logs
    every = sorted(kids + [mine])
    assert sorted(rep.kept) == every and rep.from_store == [], logs
    tr.close()
    pc2 = dataclasses.replace(pc, optimizer=dataclasses.replace(pc.optimizer, lr=pc.optimizer.lr * 2))
    logs2 = []
    tr2 = Trainer(pc2, tmp_path / "run2", log=logs2.append)
    res2 = tr2.fit()
    rep2 = tr2.startup
    assert rep2.children is None and sorted(rep2.from_store) == every, logs2
    assert sorted(rep2.loaded_s) == every and rep2.kept == [], logs2
    # loaded on a thread while cuDNN searched, before the warm-up (no compile to wait for)
    assert sorted(rep2.preloaded) == every and not rep2.cudnn.in_first_compile, logs2
    assert any(line.startswith("saved store: 6 of 6 variants' compiles kept by an earlier run")
               for line in logs2), logs2
    assert all(rep2.warmup_work[n].get("compiled", 0) == 0 for n in every), rep2.warmup_work
    assert res2.epochs[-1]["train"]["loss"] == res2.epochs[-1]["train"]["loss"]
    assert res2.epochs[-1]["val"]["loss"] == res2.epochs[-1]["val"]["loss"]
    tr2.close()


def test_warm_up_and_capture_share_one_set_of_blas_workspaces(tmp_path):
    """cuBLAS keeps a workspace per stream for the whole run. Warm-up and capture run on one
    stream per device, so besides the arenas the process holds one workspace set, within the
    plan's figure, however many trainers it builds."""
    import gc
    from tr_hydra.compiler.compile import BLAS_WORKSPACE_BYTES
    gc.collect()  # earlier tests' trainers, before the baseline
    if hasattr(torch._C, "_cuda_clearCublasWorkspaces"):  # and their streams' workspaces
        torch._C._cuda_clearCublasWorkspaces()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    tr = Runtime(small_config(device="cuda", amp=True), log=lambda *_: None, source=False)
    startup.get_ready(tr, None, lambda *_: None)
    torch.cuda.synchronize()
    streams = {seg["stream"] for seg in torch.cuda.memory_snapshot()
               if seg["stream"] != 0 and any(b["state"] == "active_allocated" for b in seg["blocks"])}
    assert len(streams) <= 1, streams  # a separate warm-up stream would hold a second set
    extra = torch.cuda.memory_allocated() - base - tr.arena.arena.numel()
    assert 0 < extra <= BLAS_WORKSPACE_BYTES + 2**20, extra / 2**20
    # a second trainer in the same process (a sweep's next job) captures on the same stream
    # and adds no workspace set
    tr2 = Runtime(small_config(device="cuda", amp=True), log=lambda *_: None, source=False)
    startup.get_ready(tr2, None, lambda *_: None)
    torch.cuda.synchronize()
    assert tr2.graphs.stream is tr.graphs.stream
    extra2 = torch.cuda.memory_allocated() - base - tr.arena.arena.numel() - tr2.arena.arena.numel()
    assert extra2 <= BLAS_WORKSPACE_BYTES + 2 * 2**20, extra2 / 2**20


def test_close_destroys_the_captured_graphs(tmp_path):
    tr = _train(small_config(device="cuda", max_steps=4, epochs=1), tmp_path, "run")
    graphs = tr.graphs
    assert graphs is not None and graphs.train and graphs.val
    kept = list(graphs.train.values()) + list(graphs.val.values())
    tr.close()
    assert tr.graphs is None and not graphs.train and not graphs.val
    for g in kept:  # reset: nothing left to replay
        with pytest.raises(RuntimeError):
            g.replay()


def _one_step(tmp_path, name, stem, compile, amp, stem_channels=None):
    """States before and after one captured training step of resnet18 at 64x64; ``stem``:
    ``s2d`` (what runs on CUDA) or ``conv`` (the model's own convolution, the fold switched
    off); ``stem_channels``: the channel multiple its input is padded to (None: as on CUDA)."""
    import dataclasses
    from tr_hydra.models import stem as stem_mod
    pc = small_config(model="resnet18", device="cuda", amp=amp, compile=compile, batch=16,
                      train_size=48, val_size=16, val_batch=16, res=64, val_res=64, lowres_res=64)
    pc = dataclasses.replace(pc, runtime=dataclasses.replace(pc.runtime, precompile=0))
    with pytest.MonkeyPatch.context() as mp:
        if stem == "conv":
            mp.setattr(stem_mod, "space_to_depth_stem", lambda *a, **k: [])
        if stem_channels is not None:
            mp.setattr(stem_mod, "stem_channel_multiple", lambda *a, _c=stem_channels: _c)
        tr = Trainer(pc, tmp_path / name, log=lambda *_: None, telemetry=False)
    tr.get_ready()
    before = {k: v.clone() for k, v in tr.final_state_dict().items()}
    tr.run_steps(epoch_schedule(pc, 0)[:1], "train")
    torch.cuda.synchronize()
    after = {k: v.clone() for k, v in tr.final_state_dict().items()}
    bank = next(iter(tr.source._banks.values()))[0]
    model_stem = type(tr.model.conv1)
    tr.close()
    return before, after, model_stem, bank


@pytest.mark.parametrize("compile", ["none", "inductor"])
def test_space_to_depth_stem_on_cuda_matches_the_plain_conv(tmp_path, compile, no_tf32):
    """On CUDA the stem is folded by default. One captured training step of resnet18 (eager
    model or Inductor) against an fp32 plain-conv step with TF32 off:
    - in fp32, the folded stem's step moves every tensor as the reference does (within 5e-2 of
      its change: measured up to 0.0101, the fp32 rounding of a different summation order
      amplified by the one-step change's cancellations; a wrong fold is O(1) off);
    - in bf16, every tensor is no further from the reference than the plain conv's bf16 step is
      (1.5x its distance + 0.02). bf16 alone puts a step 0.2-0.45 of its change away from the
      fp32 one here (measured), the plain conv's and the folded one's alike, so a fixed bound
      would say nothing.
    The same holds with the fold padded to 16 channels (the 8 of 16-bit runs doubled), the
    zero channels reaching the convolution as cuDNN or Inductor runs it.
    The synthetic bank sits in pinned host memory."""
    from tr_hydra.models.stem import ImageConv2d, SpaceToDepthConv2d
    b_ref, ref, kind, _ = _one_step(tmp_path, "ref", "conv", "none", False)
    assert kind is ImageConv2d
    runs = {}
    for name, stem, amp, sc in (("s2d32", "s2d", False, None), ("s2d16", "s2d", True, None),
                                ("conv16", "conv", True, None), ("s2d32p", "s2d", False, 16),
                                ("s2d16p", "s2d", True, 16)):
        before, after, kind, bank = _one_step(tmp_path, name, stem, compile, amp, sc)
        assert (kind is SpaceToDepthConv2d) == (stem == "s2d")
        assert not bank.is_cuda and bank.is_pinned()
        for k, w in b_ref.items():
            assert torch.equal(before[k], w), (name, k)  # the same start
        runs[name] = after

    def dist(name, k):
        change = (ref[k].double() - b_ref[k].double()).norm()
        return ((runs[name][k].double() - ref[k].double()).norm() / change).item()
    checked = 0
    for k, w in ref.items():
        if not w.is_floating_point() or torch.equal(w, b_ref[k]):
            continue
        checked += 1
        for fp32, bf16 in (("s2d32", "s2d16"), ("s2d32p", "s2d16p")):
            assert dist(fp32, k) < 5e-2, (fp32, k, dist(fp32, k))
            assert dist(bf16, k) <= 1.5 * dist("conv16", k) + 0.02, (bf16, k, dist(bf16, k), dist("conv16", k))
    assert checked > 50


def test_pointwise_recompute_on_cuda_matches_the_default_step_with_less_memory(tmp_path, monkeypatch, no_tf32):
    """runtime.recompute=pointwise with Inductor in the captured step: one fp32 step (TF32 off)
    moves every tensor as the default step does (within 5e-2 of its change, the bound the stem
    test uses for fp32 rounding amplified by cancellation: the recomputed
    values are the same arithmetic, fused differently), and the training graph's pool holds less
    than the default's: the memory the training captures reach above what was allocated before
    them (the process peak is set elsewhere when another test ran first: by a cuDNN algorithm
    search's workspace or Triton's autotuning in the warm-up, alike in both modes)."""
    import dataclasses
    from tr_hydra.runtime import graphs
    real = graphs.CudaGraphs._capture_each
    seen = {}

    def capture_each(self, variants, step, into):
        if step.__name__ != "train_step" or "peak" in seen:
            return real(self, variants, step, into)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        real(self, variants, step, into)
        torch.cuda.synchronize()
        seen["peak"] = torch.cuda.max_memory_allocated() - base
    monkeypatch.setattr(graphs.CudaGraphs, "_capture_each", capture_each)
    out = {}
    for mode in ("none", "pointwise"):
        seen.clear()
        pc = small_config(model="resnet18", device="cuda", amp=False, compile="inductor", batch=16,
                          train_size=48, val_size=16, val_batch=16, res=64, val_res=64, lowres_res=64)
        pc = dataclasses.replace(pc, runtime=dataclasses.replace(pc.runtime, recompute=mode, precompile=0))
        torch.cuda.empty_cache()
        tr = Trainer(pc, tmp_path / mode, log=lambda *_: None, telemetry=False)
        tr.get_ready()
        before = {k: v.clone() for k, v in tr.final_state_dict().items()}
        tr.run_steps(epoch_schedule(pc, 0)[:1], "train")
        torch.cuda.synchronize()
        peak = seen["peak"]
        assert peak > 0
        out[mode] = (before, {k: v.clone() for k, v in tr.final_state_dict().items()}, peak,
                     tr.compiled.activation_estimate)
        tr.close()
    (b0, want, peak0, est0), (b1, got, peak1, est1) = out["none"], out["pointwise"]
    assert est1 < est0 and peak1 < peak0, (peak1, peak0)
    checked = 0
    for k, w in want.items():
        assert torch.equal(b0[k], b1[k]), k
        change = (w.double() - b0[k].double()).norm()
        if not w.is_floating_point() or change == 0:
            continue
        checked += 1
        assert ((got[k].double() - w.double()).norm() / change).item() < 5e-2, k
    assert checked > 50


def test_trainers_compiling_differently_leave_a_reduce_overhead_step_alone(tmp_path):
    """tr-bench's situation: a torch.compile(mode="reduce-overhead") step built first, then two
    trainers with different recompute modes. The trainers drop only their own compiled code,
    so the baseline compiles nothing again and keeps its CUDA graph tree manager (a
    torch._dynamo.reset() would have shut it down; on the H200 the step then compiled and
    recorded again inside a timed repeat)."""
    import dataclasses
    from torch._dynamo.utils import counters
    from torch._inductor import cudagraph_trees
    from tr_hydra.bench import pytorch_runner
    from tr_hydra.internals import recompute
    torch._dynamo.reset()
    recompute._compiled_with.clear()
    step = pytorch_runner("resnet18", 16, 64, 10, "reduce-overhead", torch.device("cuda"), True)
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    idx = torch.cuda.current_device()
    manager = cudagraph_trees.get_manager(idx, create_if_none_exists=False)
    assert manager is not None
    for mode in ("none", "pointwise"):
        pc = small_config(model="resnet18", device="cuda", amp=True, compile="inductor", batch=16,
                          train_size=32, val_size=16, val_batch=16, res=64, val_res=64, lowres_res=64)
        pc = dataclasses.replace(pc, runtime=dataclasses.replace(pc.runtime, recompute=mode, precompile=0))
        tr = Trainer(pc, tmp_path / mode, log=lambda *_: None, telemetry=False)
        tr.get_ready()
        tr.close()
    graphs = counters["stats"]["unique_graphs"]
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    assert counters["stats"]["unique_graphs"] == graphs, "the baseline compiled again"
    assert cudagraph_trees.get_manager(idx, create_if_none_exists=False) is manager
    recompute._compiled_with.clear()


@pytest.mark.parametrize("compile", ["none", "inductor"])
def test_skipped_steps_on_graph_leave_every_persistent_region_bn_statistics_included(tmp_path, compile):
    """Inside the captured step (fused kernels, bf16 AMP, EMA): a non-finite step leaves every
    persistent region byte for byte, the BN running statistics its forward moved included; a
    clean step moves them again; once trainer.max_nonfinite is reached, a clean step is
    skipped as well (issue 48, items 5 and 6)."""
    from tr_hydra.config.specs import TrainerSpec
    from tr_hydra.memory.regions import Region as R
    from tr_hydra.train import checkpoint as ck
    pc = small_config(device="cuda", amp=True, ema=True, compile=compile,
                      optimizer=OptimizerSpec(name="adamw", lr=1e-3, schedule="constant"),
                      trainer=TrainerSpec(epochs=1, max_nonfinite=2))
    tr = Trainer(pc, tmp_path, log=lambda *_: None, telemetry=False)
    tr.get_ready()
    assert tr.graphs is not None and tr.ex.fused is not None
    tr.run_steps(epoch_schedule(pc, 0)[:2], "train")
    regions = [r for r in ck.persistent_regions(tr.arena) if r.series != "S" and r is not R.R_RESULT_ACCUMULATED]

    def persistent():
        torch.cuda.synchronize()
        return {r.name: tr.arena.span(r, r, torch.uint8).clone() for r in regions}

    def step(fill):
        img, _ = tr.ex.input_views("train_base", "A")
        if fill is None:
            img.copy_(torch.randn(img.shape, device=img.device, generator=torch.Generator(img.device).manual_seed(0)))
        else:
            img.fill_(fill)
        tr.graphs.train_step("train_base", "A")
        torch.cuda.synchronize()

    def changed(a, b):
        return [k for k in a if not torch.equal(a[k], b[k])]

    before = persistent()
    bn = tr.arena.span(R.B_PREV_MEAN, R.B_PREV_VAR).clone()
    step(float("inf"))
    assert tr.ex.scalar("found_inf") == 1.0 and tr.ex.scalar("nonfinite") == 1.0
    assert changed(before, persistent()) == []
    step(None)  # a clean step: taken
    assert tr.ex.scalar("found_inf") == 0.0
    after = tr.arena.span(R.B_PREV_MEAN, R.B_PREV_VAR)
    assert not torch.equal(after, bn) and torch.isfinite(after).all()
    assert "W_DEEP_CONV" in changed(before, persistent())
    before = persistent()
    step(float("nan"))  # the second: the limit is reached
    assert tr.ex.nonfinite_limit_state() == (True, 0)
    step(None)  # clean, but after the limit: skipped too, not counted
    assert tr.ex.nonfinite_limit_state() == (True, 1) and tr.ex.scalar("nonfinite") == 2.0
    assert changed(before, persistent()) == []
