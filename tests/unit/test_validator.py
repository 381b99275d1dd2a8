"""The validator's metrics against an eager evaluation of the same weights, and the executor's
move of one accumulator into another."""
from __future__ import annotations

import math

import pytest
import torch

from tr_hydra.memory.regions import PARAM_KINDS, Region as R, series_span
from tr_hydra.train.trainer import Trainer

from tests.helpers import eager_val_metrics, small_config


def _close(got: dict, want: dict, rel: float, samples: int) -> None:
    assert got["count"] == want["count"]
    assert math.isclose(got["loss"], want["loss"], rel_tol=rel), (got, want)
    for k in ("top1", "top5"):  # (``samples``: how many predictions a fold's rounding may flip)
        assert abs(got[k] - want[k]) <= 100 * samples / want["count"] + 1e-9, (k, got, want)


@pytest.mark.parametrize("bn_folded", [False, True])
def test_live_and_ema_validation_are_the_eager_metrics_of_those_weights(tmp_path, bn_folded):
    tr = Trainer(small_config(ema=True, bn_folded=bn_folded, epochs=1, val_size=70), tmp_path,
                 log=lambda *_: None, telemetry=False)
    tr.fit()
    a = tr.arena
    saved = a.arena.clone()
    live = eager_val_metrics(tr)
    # the EMA weights and statistics written over the live ones, by hand
    a.span(*series_span("W", PARAM_KINDS)).copy_(a.span(*series_span("E", PARAM_KINDS)))
    a.span(R.B_PREV_MEAN, R.B_PREV_VAR).copy_(a.span(R.B_NEXT_MEAN, R.B_NEXT_VAR))
    ema = eager_val_metrics(tr)
    a.arena.copy_(saved)
    assert live["loss"] != ema["loss"]  # (the two are told apart)
    out = tr.validator.validate()
    assert set(out) == {"val", "val_ema"}
    rel, samples = (1e-4, 1) if bn_folded else (1e-5, 0)
    _close(out["val"], live, rel, samples)
    _close(out["val_ema"], ema, rel, samples)


def test_move_metrics_replaces_the_target_and_empties_the_source(tmp_path):
    tr = Trainer(small_config(ema=True), tmp_path, log=lambda *_: None, telemetry=False)
    ex = tr.ex
    ex.acc["val_ema"].copy_(torch.tensor([100.0, 9.0, 9.0, 10.0]))  # replaced, not added to
    ex.acc["val"].copy_(torch.tensor([6.0, 2.0, 3.0, 4.0]))  # loss sum, top-1 hits, top-5 hits, count
    ex.move_metrics("val", "val_ema")
    assert ex.acc["val"].tolist() == [0.0, 0.0, 0.0, 0.0]
    assert ex.read_metrics("val_ema") == {"loss": 1.5, "top1": 50.0, "top5": 75.0, "count": 4.0}
