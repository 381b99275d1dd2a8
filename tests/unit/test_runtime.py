"""Runtime behaviour on CPU: AMP, fp16 loss scaling, EMA, BN folding, variants, metrics."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from tr_hydra.compiler.compile import compile_plan
from tr_hydra.config.epochs import epoch_schedule, val_schedule
from tr_hydra.config.specs import OptimizerSpec, TrainerSpec
from tr_hydra.memory.regions import MATRIX_KINDS, PARAM_KINDS, Region as R, series_span
from tr_hydra.runtime.build import Runtime
from tr_hydra.train.trainer import Trainer
from tr_hydra.runtime.schedule import lr_at

from tests.helpers import assert_folding_keeps_the_logits, eager_val_metrics, small_config


def _trainer(tmp_path, **kw):
    return Trainer(small_config(**kw), tmp_path, log=lambda *_: None)


def test_bf16_amp_uses_16bit_leaves_and_learns(tmp_path):
    tr = _trainer(tmp_path, amp=True, epochs=3, train_size=256, val_size=64, res=16)
    conv = tr.model.layer1.conv1.weight
    assert conv.dtype == torch.bfloat16 and conv.grad.dtype == torch.bfloat16
    assert tr.model.bn1.weight.dtype == torch.float32  # BN parameters stay fp32
    res = tr.fit()
    assert res.epochs[-1]["train"]["loss"] < res.epochs[0]["train"]["loss"]
    # after the step, the A region is exactly the cast of the fp32 masters
    a = tr.arena.span(*series_span("A", MATRIX_KINDS))
    w = tr.arena.span(*series_span("W", MATRIX_KINDS))
    assert torch.equal(a, w.to(torch.bfloat16))


def test_fp16_inf_skips_update_and_halves_scale(tmp_path):
    opt = OptimizerSpec(name="adam", lr=1e-3, schedule="constant")
    tr = _trainer(tmp_path, amp=True, amp_dtype="fp16", optimizer=opt, train_size=64, batch=16, res=8,
                  val_res=8, lowres_res=8)
    steps = epoch_schedule(tr.pc, 0)
    tr.run_steps(steps[:2], "train")
    assert tr.ex.scalar("found_inf") == 0.0 and tr.ex.scalar("step") == 2.0
    before = tr.arena.arena.clone()
    scale = tr.ex.scalar("loss_scale")
    img, _ = tr.ex.input_views("train_base", "A")
    img[0, 0, 0, 0] = float("inf")
    tr.ex.train_step("train_base", "A")
    assert tr.ex.scalar("found_inf") == 1.0
    assert tr.ex.scalar("loss_scale") == scale / 2
    assert tr.ex.scalar("step") == 2.0 and tr.ex.scalar("skipped") == 1.0
    for start, end in [(R.W_BN_BIAS, R.W_DEEP_CONV), (R.A_FC_WEIGHT, R.A_DEEP_CONV),
                       (R.M_BN_BIAS, R.M_DEEP_CONV), (R.V_BN_BIAS, R.V_DEEP_CONV)]:
        off, n = tr.compiled.plan.region_range(start, end)
        assert torch.equal(before[off:off + n], tr.arena.arena[off:off + n]), start.name


def test_fp16_scale_grows_after_clean_steps(tmp_path):
    trainer = TrainerSpec(epochs=1, loss_scale=1024.0, loss_scale_growth_interval=2)
    tr = _trainer(tmp_path, amp=True, amp_dtype="fp16", trainer=trainer, train_size=96, batch=16,
                  res=8, val_res=8, lowres_res=8)
    tr.run_steps(epoch_schedule(tr.pc, 0)[:5], "train")
    assert tr.ex.scalar("loss_scale") == 1024.0 * 4  # doubled after steps 2 and 4


def test_ema_matches_hand_computed_average(tmp_path):
    tr = _trainer(tmp_path, ema=True, train_size=160, batch=32)
    w_span = tr.arena.span(*series_span("W", PARAM_KINDS))
    e = w_span.clone().double()
    bn = tr.arena.span(R.B_PREV_MEAN, R.B_PREV_VAR)
    eb = bn.clone().double()
    decay = tr.pc.ema_decay
    for t, s in enumerate(epoch_schedule(tr.pc, 0), start=1):
        tr.run_steps([s], "train")
        d = min(decay, (1 + t) / (10 + t))
        e = d * e + (1 - d) * w_span.double()
        eb = d * eb + (1 - d) * bn.double()
    got = tr.arena.span(*series_span("E", PARAM_KINDS)).double()
    assert torch.allclose(got, e, rtol=1e-5, atol=1e-7)
    assert torch.allclose(tr.arena.span(R.B_NEXT_MEAN, R.B_NEXT_VAR).double(), eb, rtol=1e-5, atol=1e-7)


def test_ema_validation_uses_ema_weights_and_restores_live(tmp_path):
    tr = _trainer(tmp_path, ema=True, epochs=1)
    tr.fit()
    live = tr.arena.arena.clone()
    out = tr.validator.validate()
    assert torch.equal(live, tr.arena.arena)  # swapped back bit for bit
    assert out["val"]["loss"] != out["val_ema"]["loss"]


def test_sema_switch_copies_ema_into_live(tmp_path):
    tr = _trainer(tmp_path, ema=True, amp=True, train_size=96)
    tr.run_steps(epoch_schedule(tr.pc, 0), "train")
    tr.ex.sema_switch()
    assert torch.equal(tr.arena.span(*series_span("W", PARAM_KINDS)), tr.arena.span(*series_span("E", PARAM_KINDS)))
    assert torch.equal(tr.arena.span(*series_span("A", MATRIX_KINDS)),
                       tr.arena.span(*series_span("W", MATRIX_KINDS)).to(torch.bfloat16))


def test_bn_folding_gives_the_same_logits(tmp_path):
    tr = _trainer(tmp_path, bn_folded=True, epochs=1)
    tr.fit()  # running statistics move away from their initial values
    assert_folding_keeps_the_logits(tr, torch.randn(8, 3, 16, 16))


def _ops_making_tensors(fn, *given: torch.Tensor) -> list[str]:
    """The ops ``fn`` runs whose result is not (a view of) one of ``given``: the temporaries a
    caching allocator would hand out on the GPU."""
    from torch.utils._python_dispatch import TorchDispatchMode
    storages = {t.untyped_storage().data_ptr() for t in given}
    made = []

    class Outputs(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in (out if isinstance(out, (tuple, list)) else (out,)):
                if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in storages:
                    made.append(str(func))
            return out

    with Outputs():
        fn()
    return made


def test_bn_fold_writes_only_its_outputs():
    """The fold runs after capture, before each validation: it makes no temporary and gives the
    plain formula's values bit for bit."""
    from tr_hydra.ops.range_ops import bn_fold
    g = torch.Generator().manual_seed(0)
    bias, weight, mean = (torch.randn(300, generator=g) for _ in range(3))
    var = torch.rand(300, generator=g) + 0.1
    eq_bias, eq_scale = torch.empty(300), torch.empty(300)
    args = (eq_bias, eq_scale, bias, weight, mean, var)
    assert _ops_making_tensors(lambda: bn_fold(*args, 1e-5), *args) == []
    assert torch.equal(eq_scale, weight * torch.rsqrt(var + 1e-5))
    assert torch.equal(eq_bias, bias - mean * eq_scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swap_exchanges_bits_without_a_temporary(dtype):
    """EMA validation swaps the live and EMA spans after capture: every bit (negative zero, NaN,
    infinities) trades places and nothing is allocated."""
    special = torch.tensor([-0.0, float("nan"), float("inf"), -float("inf"), 1e-40], dtype=torch.float32)
    a = torch.cat([torch.randn(200), special]).to(dtype)
    b = torch.cat([special, torch.randn(200)]).to(dtype)
    bits = {2: torch.int16, 4: torch.int32}[a.element_size()]
    a0, b0 = a.view(bits).clone(), b.view(bits).clone()
    from tr_hydra.ops.range_ops import swap
    assert _ops_making_tensors(lambda: swap(a, b), a, b) == []
    assert torch.equal(a.view(bits), b0) and torch.equal(b.view(bits), a0)


def test_val_metrics_match_eager_reference(tmp_path):
    """The last 6 samples run in val_last's graph: the metrics count exactly the 70 samples."""
    tr = _trainer(tmp_path, epochs=1, val_size=70, val_batch=32)
    assert val_schedule(tr.pc)[-1] == ("val_last", 2, 6)
    tr.fit()
    out = tr.validator.validate()["val"]
    ref = eager_val_metrics(tr)
    assert out["count"] == ref["count"] == 70
    assert math.isclose(out["loss"], ref["loss"], rel_tol=1e-5)
    assert math.isclose(out["top1"], ref["top1"]) and math.isclose(out["top5"], ref["top5"])


def test_label_smoothing_loss_matches_torch(tmp_path):
    tr = _trainer(tmp_path, label_smoothing=0.1, train_size=32, batch=32)
    s = epoch_schedule(tr.pc, 0)[0]
    x, y = tr.source.batch("train", 0, 32, 32, 16)
    with torch.no_grad():
        ref = F.cross_entropy(tr.model(x.permute(0, 3, 1, 2)), y.long(), label_smoothing=0.1).item()
    tr.run_steps([s], "train")
    assert math.isclose(tr.ex.read_metrics("train")["loss"], ref, rel_tol=1e-5)


def test_six_variants_and_epoch_schedules():
    pc = small_config(train_size=200, batch=32, val_size=70, val_batch=32, lowres_epochs=2, epochs=3)
    assert [(v.name, v.batch, v.res) for v in pc.variants] == [
        ("train_base", 32, 16), ("train_last", 8, 16), ("train_lowres", 32, 12),
        ("train_lowres_last", 8, 12), ("val_base", 32, 16), ("val_last", 6, 16)]
    e0, e2 = epoch_schedule(pc, 0), epoch_schedule(pc, 2)
    assert {v for v, _, _ in e0} == {"train_lowres", "train_lowres_last"}
    assert {v for v, _, _ in e2} == {"train_base", "train_last"}
    assert sum(size for _, _, size in e0) == 200  # nothing dropped
    assert sum(size for _, _, size in val_schedule(pc)) == 70


def test_drop_last_removes_last_variants():
    from tr_hydra.config.epochs import make_variants
    vs = make_variants(train_size=200, val_size=64, batch_size=32, val_batch_size=32, base_res=16,
                       lowres_res=12, lowres_epochs=1, val_res=16, drop_last=True)
    assert [v.name for v in vs] == ["train_base", "train_lowres", "val_base"]


def test_all_six_variants_train_on_cpu(tmp_path):
    tr = _trainer(tmp_path, train_size=100, batch=32, val_size=40, val_batch=32, lowres_epochs=1,
                  epochs=2, ema=True, bn_folded=True)
    res = tr.fit()
    assert len(res.epochs) == 2 and res.epochs[-1]["val"]["count"] == 40
    assert res.steps == 8


@pytest.mark.parametrize("schedule,expect", [
    ("constant", [0.05, 0.1, 0.1, 0.1]),
    ("step", [0.05, 0.1, 0.01, 0.01]),
    ("cosine", [0.05, 0.1, 0.05, 0.0]),
    ("poly", [0.05, 0.1, 0.025, 0.0]),
])
def test_lr_schedules_with_warmup(schedule, expect):
    # 10 steps per epoch, 1 warm-up epoch, 3 epochs (30 steps); milestones at epoch 2 for step
    opt = OptimizerSpec(lr=0.1, schedule=schedule, warmup_epochs=1.0, milestones=(2.0,), gamma=0.1,
                        poly_power=2.0)
    got = [lr_at(opt, s, 10, 30) for s in (4, 10, 20, 30)]
    assert got == pytest.approx(expect, abs=1e-12)


def test_max_steps_stops_early(tmp_path):
    tr = _trainer(tmp_path, epochs=5, max_steps=3)
    assert tr.fit().steps == 3


def test_lr_scalar_changes_without_rebuild(tmp_path):
    opt = OptimizerSpec(lr=0.1, schedule="cosine")
    tr = _trainer(tmp_path, optimizer=opt, train_size=128, batch=32)
    seen = []
    tr.run_steps(epoch_schedule(tr.pc, 0), "train", on_step=lambda k: seen.append(tr.ex.scalar("lr")))
    assert seen[0] == pytest.approx(0.1) and seen[-1] < seen[0]


def test_deterministic_cpu_runs_are_bit_identical(tmp_path):
    import dataclasses
    base = small_config(epochs=2, train_size=96, batch=32, lowres_epochs=1, ema=True)
    pc = dataclasses.replace(base, runtime=dataclasses.replace(base.runtime, deterministic=True))
    a = Trainer(pc, tmp_path / "a", log=lambda *_: None)
    ra = a.fit()
    b = Trainer(pc, tmp_path / "b", log=lambda *_: None)
    rb = b.fit()
    sa, sb = a.final_state_dict(), b.final_state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert ra.epochs[-1]["val"] == rb.epochs[-1]["val"]
    torch.use_deterministic_algorithms(False)


@pytest.mark.parametrize("compiled", [False, True])
def test_loss_metrics_match_torch_eager_and_compiled(compiled):
    """The loss node (eager, or compiled by Inductor as on CUDA) against F.cross_entropy and its
    autograd gradient, top-1/top-5 by hand."""
    from tr_hydra.runtime.executor import loss_and_metrics
    torch.manual_seed(3)
    b, k, eps = 12, 10, 0.1
    logits = torch.randn(b, k)
    y = torch.randint(0, k, (b,), dtype=torch.int32)
    feat, dist, gslot = torch.zeros(b, k), torch.zeros(b, k), torch.zeros(b, k)
    pred, result = torch.zeros(b, dtype=torch.int32), torch.zeros(4)
    fn = torch.compile(loss_and_metrics, dynamic=False) if compiled else loss_and_metrics
    fn(logits, y, torch.arange(k), torch.tensor([2.0]), feat, dist, gslot, pred, result, eps, float(b))
    ref = logits.clone().requires_grad_()
    loss = F.cross_entropy(ref, y.long(), label_smoothing=eps)
    loss.backward()
    assert math.isclose(result[0].item() / b, loss.item(), rel_tol=1e-6)
    assert torch.allclose(gslot, 2.0 * ref.grad, rtol=1e-5, atol=1e-7)  # times the loss scale
    assert pred.tolist() == logits.argmax(1).tolist() and torch.equal(feat, logits)
    assert result[1].item() == (logits.argmax(1) == y).sum().item()
    assert result[2].item() == (logits.topk(5, 1).indices == y[:, None].long()).any(1).sum().item()
    assert result[3].item() == b


def test_gradient_copy_takes_flat_views_only_for_matching_layouts():
    from tr_hydra.runtime.executor import _flat, _same_dense_layout
    w1 = torch.randn(8, 4, 1, 1)
    w3 = torch.randn(8, 4, 3, 3)
    cl1, cl3 = w1.to(memory_format=torch.channels_last), w3.to(memory_format=torch.channels_last)
    assert _same_dense_layout(cl1, w1)  # 1x1: both layouts put the same elements in the same order
    assert not _same_dense_layout(cl3, w3) and _same_dense_layout(cl3, cl3.clone())
    assert not _same_dense_layout(w3[:, :2], w3[:, :2].contiguous())  # a view with gaps
    assert not _same_dense_layout(w3, w3.half())
    dst = torch.empty_like(cl3)
    torch._foreach_copy_([_flat(dst)], [_flat(cl3.clone())])
    assert torch.equal(dst, w3)


@pytest.mark.parametrize("amp", [False, True])
def test_predicted_need_counts_the_gradients_the_backward_returns(tmp_path, amp):
    """autograd.grad returns one gradient per parameter in its leaf's dtype (16-bit matrices,
    fp32 BN under AMP), all alive before the copy into the arena: the prediction counts them,
    with no more than each slot's padding on top."""
    tr = _trainer(tmp_path, amp=amp)
    params = list(tr.model.parameters())
    returned = sum(p.numel() * p.element_size() for p in params)
    assert any(p.dtype == torch.bfloat16 for p in params) == amp
    c = tr.compiled
    assert returned <= c.gradient_transient <= returned + 2 * (255 + 16) * len(params)  # slot padding
    assert c.library_workspace == 0  # a CPU run holds no BLAS workspaces
    assert c.predicted_need == c.plan.total_bytes + c.activation_estimate + c.gradient_transient


def test_predicted_need_counts_one_set_of_blas_workspaces_on_cuda():
    """A CUDA run warms up and captures on one stream: one cuBLAS + cuBLASLt workspace set; a
    plan for ``runtime.device=auto`` counts it only where auto means CUDA."""
    from tr_hydra.compiler.compile import BLAS_WORKSPACE_BYTES
    auto = BLAS_WORKSPACE_BYTES if torch.cuda.is_available() else 0
    for device, lib in (("cuda", BLAS_WORKSPACE_BYTES), ("auto", auto), ("cpu", 0)):
        c = compile_plan(small_config(device=device, amp=True))
        assert c.library_workspace == lib
        assert c.predicted_need == c.plan.total_bytes + c.activation_estimate + c.gradient_transient + lib


def test_exit_destroys_graphs_before_the_process_group(monkeypatch):
    """A captured NCCL collective holds the communicator: the graphs must go first, and the group
    is destroyed even when releasing the graphs fails."""
    import tr_hydra.runtime.distributed as distributed
    from tr_hydra.cli.train import _close
    order = []
    monkeypatch.setattr(distributed, "shutdown", lambda: order.append("process group"))

    class Fake:
        def __init__(self, fail=False):
            self.fail = fail

        def close(self):
            order.append("graphs")
            if self.fail:
                raise RuntimeError("device lost")

    _close(Fake())
    assert order == ["graphs", "process group"]
    order.clear()
    with pytest.raises(RuntimeError, match="device lost"):
        _close(Fake(fail=True))
    assert order == ["graphs", "process group"]


def test_run_log_keeps_lines_and_the_error_that_ended_the_run(tmp_path, capsys):
    from tr_hydra.cli.train import _RunLog
    say = _RunLog(str(tmp_path))
    with pytest.raises(ValueError):
        with say.errors():
            say("epoch   1  step 10")
            raise ValueError("bad batch")
    assert "epoch   1  step 10" in capsys.readouterr().out
    lines = (tmp_path / "train.log").read_text().splitlines()
    assert lines[0].endswith("] epoch   1  step 10")
    assert lines[1].endswith("] stopped: ValueError: bad batch")


@pytest.mark.parametrize("amp_dtype,optimizer", [("bf16", "momentum"), ("fp16", "adam"), ("bf16", "lars")])
def test_gradients_on_the_16bit_weights_train_exactly_as_with_their_own_bytes(tmp_path, amp_dtype, optimizer):
    """With ``plan.share_grad16`` the 16-bit gradients overwrite the 16-bit weights after the
    backward: the weights, optimizer state, BN statistics and 16-bit weights after a run are
    bit-equal to a run whose gradients have their own bytes, and so are the losses."""
    from tr_hydra.train.checkpoint import persistent_regions
    opt = OptimizerSpec(name=optimizer, lr=1e-3 if optimizer == "adam" else 0.05, schedule="constant")
    runs = {}
    for share in (True, False):
        tr = _trainer(tmp_path / str(share), amp=True, amp_dtype=amp_dtype, optimizer=opt, epochs=2,
                      train_size=96, batch=32, lowres_epochs=1, share_grad16=share)
        res = tr.fit()
        assert bool(tr.compiled.plan.shared) == share
        regions = {r.name: tr.arena.span(r, r, torch.uint8).clone() for r in persistent_regions(tr.arena)}
        runs[share] = (res, regions, tr.compiled.plan.total_bytes)
    (ra, sa, ta), (rb, sb, tb) = runs[True], runs[False]
    assert ta < tb
    assert sa.keys() == sb.keys() and "A_DEEP_CONV" in sa
    for name in sa:
        assert torch.equal(sa[name], sb[name]), name
    assert [e["train"] for e in ra.epochs] == [e["train"] for e in rb.epochs]
    assert [e["val"] for e in ra.epochs] == [e["val"] for e in rb.epochs]


def test_inductor_step_on_cpu_trains_as_the_eager_step(tmp_path):
    """runtime.compile=inductor (the CUDA default) through the trainer's steps on the CPU: the
    compiled forward/backward reads the arena-bound weights and statistics, updates the BN
    statistics in the arena and returns gradients into it; two steps, each from the eager run's
    state (the second reads weights and statistics a step moved), end where the eager step's
    do: every tensor within 10x the larger of the two steps' own spread, each step taken again
    on its batch in another order (the same sums in another order; at least one fp32 ulp).
    Not free-running steps, nor a third: Inductor's fp32 step is chaotic there (a ReLU input
    within its rounding of 0 goes either way), the third step of this model from one start
    lands 5e-6, 8e-5 or 4e-3 from the eager step on a BN bias (relative) as the batch's order
    changes, while the eager step stays within 2e-7; steps 1 and 2 within 2x their spread."""
    rel = lambda a, b: ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-12)).item()

    def ulp(t):  # fp32's resolution of t: one unit in the last place of every element, relative
        return rel(torch.nextafter(t, torch.full_like(t, math.inf)), t)

    trs = {}
    for mode in ("none", "inductor"):
        torch.manual_seed(0)
        trs[mode] = Trainer(small_config(compile=mode, max_steps=2), tmp_path / mode, log=lambda *_: None)
        assert trs[mode].rt.inductor == (mode == "inductor")
    eager = trs["none"]
    assert eager.arena.arena.shape == trs["inductor"].arena.arena.shape  # one plan: one layout of the state
    steps = epoch_schedule(eager.pc, 0)[:2]

    def step(tr, start, s, order=None):
        """Step ``s`` from ``start`` (the whole arena: weights, gradients, optimizer state, BN
        statistics, counters), on its batch with the samples in ``order`` if given."""
        tr.arena.arena.copy_(start)
        src = tr.source
        if order is not None:
            batch = src.batch
            src.batch = lambda *a, **kw: tuple(t[order] for t in batch(*a, **kw))
        try:
            tr.run_steps(steps[s:s + 1], "train", step0=s)
        finally:
            if order is not None:
                del src.batch
        return tr.final_state_dict()

    start = eager.arena.arena.clone()
    for s in range(len(steps)):
        before = eager.final_state_dict()
        order = torch.randperm(steps[s][2], generator=torch.Generator().manual_seed(s))
        again = {m: step(tr, start, s, order) for m, tr in trs.items()}
        got = {m: step(tr, start, s) for m, tr in trs.items()}
        start = eager.arena.arena.clone()  # the eager step's end: the next step's start
        assert got["none"].keys() == got["inductor"].keys()
        for k, want in got["none"].items():
            if k.endswith("num_batches_tracked"):
                assert int(got["inductor"][k]) == int(want) == s + 1, k
                continue
            ours, theirs = rel(again["inductor"][k], got["inductor"][k]), rel(again["none"][k], want)
            err = rel(got["inductor"][k], want)
            assert err <= 10 * max(ours, theirs, ulp(want)), (
                f"step {s + 1}, {k}: {err:.2e} from the eager step's end; the steps' own spread: "
                f"compiled {ours:.2e}, eager {theirs:.2e}")
            # the statistics the compiled graph updates in place moved from the step's start
            if k.endswith(("running_mean", "running_var")):
                assert not torch.equal(got["inductor"][k], before[k]), k


def test_inductor_options_reach_the_models_compile_and_train_as_the_eager_step(tmp_path):
    """runtime.inductor_options go into the compile of the model's step: with
    ``cpp.simdlen=0`` the generated CPU code has no vector types, which Inductor's default
    code for the same kind of step has; the steps still end where the eager steps do."""
    import dataclasses
    from torch._inductor.utils import run_and_get_code
    torch._dynamo.reset()
    probe = torch.compile(lambda x: (x.sin() + 1).relu() * x)
    _, code = run_and_get_code(probe, torch.randn(4, 64))
    assert "Vectorized" in "\n".join(code)  # the check below can fail

    out = {}
    for mode, opts in (("none", ()), ("inductor", (("cpp.simdlen", 0),))):
        torch._dynamo.reset()
        torch.manual_seed(0)
        pc = small_config(compile=mode, train_size=72, batch=32, val_size=40, val_batch=32, epochs=1)
        pc = dataclasses.replace(pc, runtime=dataclasses.replace(pc.runtime, inductor_options=opts, precompile=0))
        logs = []
        tr = Trainer(pc, tmp_path / mode, log=logs.append)
        _, code = run_and_get_code(tr.fit)
        out[mode] = tr.final_state_dict()
        if mode == "inductor":
            text = "\n".join(code)
            assert code and "cpp_fused" in text and "Vectorized" not in text
            assert any("runtime.inductor_options: cpp.simdlen=0" in str(ln) for ln in logs), logs
    for k, ref in out["none"].items():
        torch.testing.assert_close(out["inductor"][k], ref, rtol=1e-4, atol=1e-4, msg=k)


def test_inductor_options_without_inductor_are_said_to_do_nothing(tmp_path):
    import dataclasses
    pc = small_config()  # CPU, runtime.compile=none
    pc = dataclasses.replace(pc, runtime=dataclasses.replace(
        pc.runtime, inductor_options=(("coordinate_descent_tuning", True),), recompute="pointwise"))
    logs = []
    Runtime(pc, log=logs.append, source=False)
    said = [str(ln) for ln in logs if "has no effect without Inductor" in str(ln)]
    assert said == ["runtime.recompute=pointwise has no effect without Inductor (runtime.compile)",
                    "runtime.inductor_options has no effect without Inductor (runtime.compile)"], logs


def test_a_batch_must_fill_its_variants_buffer(tmp_path):
    tr = Runtime(small_config(val_size=70, val_batch=32), log=lambda *_: None)
    x, y = tr.source.batch("val", 2, 32, 6, 16)
    full_x, full_y = tr.source.batch("val", 0, 32, 32, 16)
    tr.feeder.put("B", "val_base", (full_x, full_y))
    tr.feeder.put("B", "val_last", (x, y))
    img, lab = tr.ex.input_views("val_last", "B")
    assert torch.equal(lab, y) and torch.equal(img, x)
    with pytest.raises(ValueError, match="does not fit"):  # a part of a batch in a full buffer
        tr.feeder.put("B", "val_base", (x, y))
    tx, ty = tr.source.batch("train", 0, 32, 6, 16)
    with pytest.raises(ValueError, match="does not fit"):  # training never pads
        tr.feeder.put("A", "train_base", (tx, ty))
