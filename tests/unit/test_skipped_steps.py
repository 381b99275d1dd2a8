"""A skipped step (non-finite loss, gradients or BatchNorm statistics) leaves every persistent
region as it was, BatchNorm's running statistics included; trainer.max_nonfinite stops with the
weights of the step that reached it (issue 48, items 5 and 6)."""
from __future__ import annotations

import pytest
import torch

from tr_hydra.compiler.compile import instantiate_model
from tr_hydra.config.epochs import epoch_schedule
from tr_hydra.config.specs import OptimizerSpec, TrainerSpec
from tr_hydra.memory.regions import Region as R
from tr_hydra.runtime.guards import NonFiniteError
from tr_hydra.train import checkpoint as ck
from tr_hydra.train.trainer import Trainer

from tests.helpers import small_config

# scalars a skipped step legitimately moves: its flag and the counters of skipped steps
_COUNTERS = {"found_inf", "nonfinite", "nonfinite_step", "skipped"}


def _trainer(tmp_path, **kw):
    kw = dict(train_size=64, batch=16, res=8, val_res=8, lowres_res=8) | kw
    return Trainer(small_config(**kw), tmp_path, log=lambda *_: None)


def _persistent(tr) -> dict[str, torch.Tensor]:
    """Each persistent region's bytes (S and R_RESULT_ACCUMULATED left to ``_scalars``)."""
    out = {}
    for r in ck.persistent_regions(tr.arena):
        if r.series == "S" or r is R.R_RESULT_ACCUMULATED:
            continue
        out[r.name] = tr.arena.span(r, r, torch.uint8).clone()
    return out


def _scalars(tr) -> dict[str, float]:
    return {k: v.item() for k, v in tr.ex.s.items() if k not in _COUNTERS}


def _assert_unchanged(tr, before, scalars):
    after = _persistent(tr)
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert not changed, f"a skipped step changed {changed}"
    assert _scalars(tr) == scalars


@pytest.mark.parametrize("optimizer,ema,amp", [("momentum", False, False), ("adamw", True, False),
                                               ("lars", True, True)])
def test_a_skipped_step_leaves_every_persistent_region_as_it_was(tmp_path, optimizer, ema, amp):
    tr = _trainer(tmp_path, ema=ema, amp=amp, optimizer=OptimizerSpec(name=optimizer, lr=0.05, schedule="constant"))
    tr.run_steps(epoch_schedule(tr.pc, 0)[:2], "train")  # BN statistics, momenta, EMA under way
    before, scalars = _persistent(tr), _scalars(tr)
    assert before["B_PREV_MEAN"].any()
    img, _ = tr.ex.input_views("train_base", "A")
    img[0, 0, 0, 0] = float("inf")
    tr.ex.train_step("train_base", "A")
    assert tr.ex.scalar("found_inf") == 1.0 and tr.ex.scalar("nonfinite") == 1.0
    _assert_unchanged(tr, before, scalars)


def test_a_step_whose_bn_statistics_overflow_is_skipped(tmp_path):
    """Huge activations: the running variance overflows while the loss and the gradients stay
    finite (what optimizer.lr=1e6 did); the step is skipped and the statistics put back."""
    tr = _trainer(tmp_path)
    tr.run_steps(epoch_schedule(tr.pc, 0)[:1], "train")
    before, scalars = _persistent(tr), _scalars(tr)
    img, _ = tr.ex.input_views("train_base", "A")
    img.copy_(torch.randn(img.shape, generator=torch.Generator().manual_seed(0)) * 1e18)
    tr.ex.train_step("train_base", "A")
    assert tr.ex.scalar("found_inf") == 1.0
    assert "B_PREV_VAR" in tr.ex.nonfinite_report()
    assert torch.isfinite(tr.arena.span(R.B_PREV_MEAN, R.B_PREV_VAR)).all()
    _assert_unchanged(tr, before, scalars)


def test_a_taken_step_updates_bn_statistics_as_pytorch_batchnorm(tmp_path):
    tr = _trainer(tmp_path)
    tr.run_steps(epoch_schedule(tr.pc, 0)[:1], "train")
    ref = instantiate_model(tr.pc)
    ref.load_state_dict(tr.final_state_dict())
    ref.train()
    img, _ = tr.ex.input_views("train_base", "A")
    img.copy_(torch.randn(img.shape, generator=torch.Generator().manual_seed(1)))
    x = img.permute(0, 3, 1, 2).clone()
    old = tr.final_state_dict()
    tr.ex.train_step("train_base", "A")
    assert tr.ex.scalar("found_inf") == 0.0
    with torch.no_grad():
        ref(x)
    got, want = tr.final_state_dict(), ref.state_dict()
    names = [k for k in got if k.endswith(("running_mean", "running_var"))]
    assert len(names) >= 4
    for k in names:
        assert not torch.equal(got[k], old[k]), k  # the step moved them
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6, msg=k)


def _poison(tr, indexes, value=float("nan")):
    """Synthetic train batches ``indexes`` of the bank (of every epoch: the bank repeats) made non-finite."""
    imgs, _ = tr.source._bank("train", tr.pc.variant("train_base").res, tr.pc.batch_size)
    b = tr.pc.batch_size
    for i in indexes:
        imgs[i * b:(i + 1) * b, 0, 0, 0] = value


def test_max_nonfinite_stops_with_the_weights_of_the_step_that_reached_it(tmp_path):
    """Bad steps 3, 4, 7, 8 (bank batches 2 and 3), the count read every 8 steps: the run stops
    at the check at step 8 with the weights it had after step 2 (steps 5 and 6, finite, are
    not applied), and says so exactly."""
    trainer = TrainerSpec(epochs=2, log_every=8, max_nonfinite=1)
    tr = _trainer(tmp_path / "a", train_size=128, trainer=trainer)
    _poison(tr, (2, 3))
    with pytest.raises(NonFiniteError) as e:
        tr.fit()
    msg = str(e.value)
    assert "1 step with non-finite" in msg and "trainer.max_nonfinite=1 at step 3" in msg, msg
    assert "first at step 3" in msg and "so were the 5 steps after it, up to this check at step 8" in msg, msg
    assert "which are finite" in msg and not msg.endswith(": 8")
    stop = ck.load(ck.checkpoints_in(tmp_path / "a")[0])
    assert stop["position"]["step"] == 8
    ref = _trainer(tmp_path / "b", train_size=128, trainer=TrainerSpec(epochs=2, log_every=8, max_steps=2))
    ref.fit()
    for name in ("W_DEEP_CONV", "W_BN_WEIGHT", "M_DEEP_CONV", "B_PREV_MEAN", "B_PREV_VAR"):
        assert torch.equal(stop["regions"][name], ref.arena.span(R[name], R[name], torch.uint8).cpu()), name


def test_max_nonfinite_three_counts_only_the_steps_before_the_stop(tmp_path):
    trainer = TrainerSpec(epochs=2, log_every=8, max_nonfinite=3)
    tr = _trainer(tmp_path, train_size=128, trainer=trainer)
    _poison(tr, (2, 3))  # bad: 3, 4, 7 (the third), then 8 after the limit
    with pytest.raises(NonFiniteError) as e:
        tr.fit()
    msg = str(e.value)
    assert "3 steps with non-finite" in msg and "trainer.max_nonfinite=3 at step 7" in msg, msg
    assert "so was the 1 step after it, up to this check at step 8" in msg, msg
    assert tr.ex.scalar("nonfinite") == 3.0


def test_a_resumed_run_starts_with_the_limit_unreached(tmp_path):
    tr = _trainer(tmp_path, train_size=128, trainer=TrainerSpec(epochs=2, log_every=8, max_nonfinite=1))
    tr.run_steps(epoch_schedule(tr.pc, 0)[:1], "train")
    img, _ = tr.ex.input_views("train_base", "A")
    img[0, 0, 0, 0] = float("nan")
    tr.ex.train_step("train_base", "A")
    tr.ex.train_step("train_base", "B")
    assert tr.ex.nonfinite_limit_state() == (True, 1)
    tr.ex.set_nonfinite_limit(5)
    assert tr.ex.nonfinite_limit_state() == (False, 0)
