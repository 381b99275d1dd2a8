"""trainer.objective (what a run returns to a sweeper) and the sweep table's columns."""
from __future__ import annotations

import math

import pytest

from tr_hydra.cli._common import compose
from tr_hydra.config import objective
from tr_hydra.errors import ConfigError
from tr_hydra.resolve import resolve
from tr_hydra.telemetry.sweep import format_table, split_overrides

HISTORY = [  # metrics.json's records; the second epoch ran no validation
    {"epoch": 1, "val": {"loss": 1.5, "top1": 40.0, "top5": 80.0}, "val_ema": {"loss": 1.7, "top1": 35.0, "top5": 75.0}},
    {"epoch": 2},
    {"epoch": 3, "val": {"loss": 0.9, "top1": 38.0, "top5": 90.0}, "val_ema": {"loss": 1.2, "top1": 45.0, "top5": 85.0}},
    {"epoch": 4, "val": {"loss": float("nan"), "top1": 10.0, "top5": 50.0}},
]


@pytest.mark.parametrize("name,want", [("val/top1", 40.0), ("val/top5", 90.0), ("val/loss", 0.9),
                                       ("val_ema/top1", 45.0), ("val_ema/top5", 85.0), ("val_ema/loss", 1.2)])
def test_the_best_over_the_epochs_that_ran_validation(name, want):
    assert objective.best(HISTORY, name) == want  # max of accuracies, min of losses, NaN ignored


def test_no_validation_is_nan():
    assert math.isnan(objective.best([{"epoch": 1}], "val/top1"))


def test_the_config_checks_the_objective():
    assert resolve(compose(["trainer.objective=val/loss"])).trainer.objective == "val/loss"
    with pytest.raises(ConfigError, match=r"trainer.objective: 'val/acc' is not one of val/top1, val/top5"):
        resolve(compose(["trainer.objective=val/acc"]))
    with pytest.raises(ConfigError, match="trainer.objective=val_ema/top1 needs ema=true"):
        resolve(compose(["trainer.objective=val_ema/top1"]))
    resolve(compose(["trainer.objective=val_ema/top1", "ema=true"]))


def test_a_sweeper_going_the_wrong_way_is_refused():
    objective.check_sweeper_direction("val/top1", "maximize")
    objective.check_sweeper_direction("val/loss", ["MINIMIZE"])
    objective.check_sweeper_direction("val/loss", None)  # a sweeper without a direction
    with pytest.raises(ConfigError, match="set hydra.sweeper.direction=maximize"):
        objective.check_sweeper_direction("val_ema/top5", "minimize")


def _row(job, overrides, value=None, failed=None, img=1000.0):
    return {"job": job, "overrides": overrides, "failed": failed, "unfinished": False,
            "objective": None if failed else "val/loss", "objective_value": value, "img_per_sec": img}


def test_the_table_has_a_column_per_swept_key_and_the_fixed_ones_above():
    rows = [_row("0", [("optimizer", "sgd"), ("seed", "1"), ("optimizer.lr", "0.30233257263183977")], 0.71),
            _row("1", [("optimizer", "sgd"), ("seed", "1"), ("optimizer.lr", "0.1")], failed="optimizer.lr: bad"),
            _row("2", [("optimizer", "sgd"), ("seed", "1"), ("optimizer.lr", "0.2"), ("amp", "true")], 0.52)]
    assert split_overrides(rows) == (["optimizer=sgd", "seed=1"], ["optimizer.lr", "amp"])
    lines = format_table(rows).splitlines()
    assert lines[0] == "fixed: optimizer=sgd seed=1"
    assert lines[1].split() == ["job", "optimizer.lr", "amp", "best", "val/loss", "img/s"]
    assert lines[2].split()[:3] == ["0", "0.302333", "-"] and lines[2].split()[3] == "0.7100"
    assert lines[3].split()[:3] == ["1", "0.1", "-"] and lines[3].endswith("failed: optimizer.lr: bad")
    assert lines[4].split()[:4] == ["2", "0.2", "true", "0.5200"] and lines[4].endswith("<- best")  # a loss: the least
    assert not lines[2].endswith("<- best")
