"""Hyperparameter search and launching the Hydra way: the task returns trainer.objective, Hydra's
Optuna sweeper drives a search (failed trials told as failed, the search going on), the best
trial reruns to the same objective, Hydra's submitit launcher runs jobs (and ranks) as on SLURM,
and the sweep table shows the swept keys as columns. Tiny CPU runs, each in its own tmp_path."""
from __future__ import annotations

import json
import math
import os
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.integration.test_cli import ENV, _cli, run

pytest.importorskip("hydra_plugins.hydra_optuna_sweeper")
# digits, small enough to take seconds a trial, large enough that trials differ
DIGITS = ["trainer.epochs=2", "data.train_size=512", "data.val_size=128", "variants.batch_size=32",
          "runtime.device=cpu", "runtime.deterministic=true", "trainer.progress=false"]
TINY = ["recipe=cpu_smoke", "runtime.device=cpu", "data.train_size=128", "data.val_size=64"]


def _objective(run_dir: Path) -> float:
    return json.loads((run_dir / "metrics.json").read_text())["summary"]["objective_value"]


def _overrides(job: Path) -> dict[str, str]:
    return dict(o.split("=", 1) for o in yaml.safe_load((job / ".hydra" / "overrides.yaml").read_text()))


def _assert_plain(out) -> None:
    """A search's output on a pipe: no alembic setup chatter, no colour codes."""
    text = out.stdout + out.stderr
    assert "alembic" not in text and "\x1b[" not in text, text[:3000]


def test_optuna_search_on_digits_and_the_best_trial_reruns_to_its_objective(tmp_path):
    sweep = tmp_path / "search"
    out = run("tr-train", "hparams_search=optuna", "hydra.sweeper.n_trials=4", *DIGITS,
              f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    _assert_plain(out)
    assert "A new study created in memory with name: tr_hydra_search" in out.stdout  # optuna's lines kept
    assert "\t#3 : optimizer.lr=" in out.stdout and "sweep summary (" in out.stdout
    jobs = sorted((p for p in sweep.iterdir() if p.name.isdigit()), key=lambda p: int(p.name))
    assert [j.name for j in jobs] == ["0", "1", "2", "3"]
    values = {j.name: _objective(j) for j in jobs}  # each trial a run of its own, in its own dir
    for j in jobs:
        assert (j / "model_final.pt").is_file() and (j / "train.log").is_file()
    assert len({_overrides(j)["optimizer.lr"] for j in jobs}) == 4  # the sampler's own values

    result = yaml.safe_load((sweep / "optimization_results.yaml").read_text())
    assert result["best_value"] == max(values.values())
    best = next(j for j in jobs if values[j.name] == result["best_value"]
                and all(_overrides(j)[k] == str(v) for k, v in result["best_params"].items()))

    # the table: the sampled keys as columns, what every trial shares once above it
    table = (sweep / "summary.txt").read_text().splitlines()
    assert table[0].startswith("fixed: ") and "trainer.epochs=2" in table[0] and "optimizer.lr=" not in table[0]
    header = table[1].split()
    assert header[:4] == ["job", "optimizer.lr", "optimizer.weight_decay", "trainer.label_smoothing"]
    assert header[-3:] == ["best", "val/top1", "img/s"] and len(table) == 2 + 4
    assert table[2 + int(best.name)].endswith("<- best")

    again = tmp_path / "again"
    out = run("tr-train", "--rerun", str(best), f"hydra.run.dir={again}", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert _objective(again) == result["best_value"]  # deterministic: the same number exactly


def test_failed_and_diverged_trials_are_told_as_failed_and_the_search_goes_on(tmp_path):
    sweep = tmp_path / "search"
    out = run("tr-train", "hparams_search=optuna", "hydra.sweeper.n_trials=4", "optimizer.lr=choice(0.1,-1.0,1e30)",
              "trainer.max_nonfinite=1", "trainer.log_every=1", *DIGITS, f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr[-3000:]
    jobs = [p for p in sweep.iterdir() if p.name.isdigit()]
    assert len(jobs) == 4  # every trial ran
    failed = {j.name: (j / "failed.txt").read_text().strip() for j in jobs if (j / "failed.txt").is_file()}
    lrs = {j.name: float(_overrides(j)["optimizer.lr"]) for j in jobs}
    assert set(failed) == {n for n, lr in lrs.items() if lr != 0.1}, (failed, lrs)
    assert {lrs[n] for n in failed} == {-1.0, 1e30}  # this seed draws both kinds
    for n in failed:
        want = "optimizer.lr: must be > 0" if lrs[n] < 0 else "non-finite"
        assert want in failed[n] and f"Failed experiment: job {n}: " in out.stdout, failed[n]
    assert f"{len(failed)} of 4 sweep jobs failed" in out.stderr
    result = yaml.safe_load((sweep / "optimization_results.yaml").read_text())
    assert result["best_params"]["optimizer.lr"] == 0.1 and math.isfinite(result["best_value"])


def test_a_sweeper_told_the_wrong_direction_is_one_line(tmp_path):
    out = run("tr-train", "hparams_search=optuna", "trainer.objective=val/loss", *DIGITS,
              f"hydra.sweep.dir={tmp_path / 's'}", cwd=tmp_path)
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert out.returncode == 2 and len(lines) == 1, out.stderr[-2000:]
    assert ("trainer.objective=val/loss is minimised, but hydra.sweeper.direction=maximize would search for "
            "the worst run: set hydra.sweeper.direction=minimize") in lines[0]
    assert not (tmp_path / "s").exists()


def test_submitit_local_runs_each_job_and_each_rank_as_slurm_would(tmp_path):
    """Hydra's submitit launcher with its local executor (the SLURM launcher's code, run here):
    two jobs of two tasks each; every task reads its rank from the job's environment through
    submitit (as on SLURM), the ranks train together (gloo) and the job dir is rank 0's."""
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    sweep = tmp_path / "sweep"
    out = run("tr-train", "-m", "hydra/launcher=submitit_local", "hydra.launcher.tasks_per_node=2", "dist=ddp",
              "optimizer.lr=0.05,0.1", *TINY, f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    for job in ("0", "1"):
        d = sweep / job
        assert (d / "model_final.pt").is_file() and (d / "metrics.json").is_file()
        log = (d / "train.log").read_text()
        for task in (0, 1):
            assert "submitit: job " in log and f" on local, task {task} of 2 " in log, log
            assert f"rank {task} of 2 via " in log, log
        assert "weights identical on all 2 ranks" in log
    table = (sweep / "summary.txt").read_text().splitlines()
    assert table[0].startswith("fixed: dist=ddp ") and table[1].split()[:2] == ["job", "optimizer.lr"]
    assert [r.split()[1] for r in table[2:]] == ["0.05", "0.1"]


def test_a_plugin_not_installed_is_one_line_naming_the_extra(monkeypatch, capsys):
    import importlib.util

    from tr_hydra.cli import plugins
    from tr_hydra.cli.train import main
    real = importlib.util.find_spec
    monkeypatch.setattr(plugins.importlib.util, "find_spec",
                        lambda name, *a: None if name.startswith("hydra_plugins.") else real(name, *a))
    for args, extra in ((["hparams_search=optuna"], "search"), (["-m", "hydra/sweeper=optuna", "seed=1,2"], "search"),
                        (["-m", "hydra/launcher=submitit_slurm", "seed=1,2"], "slurm")):
        with pytest.raises(SystemExit) as e:
            main(args + ["runtime.device=cpu"])
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and len(err) == 1, err
        assert f"pip install 'tr_hydra[{extra}]'" in err[0] and f"pip install -e '.[{extra}]'" in err[0], err


def test_a_search_whose_every_trial_failed_ends_with_its_summary(tmp_path):
    """Optuna's sweeper asks for the best trial when none completed (``ValueError: No trials are
    completed yet``): the summary of what ran, one line, exit 1. Both trials are refused by the
    config check, at no cost."""
    sweep = tmp_path / "search"
    out = run("tr-train", "hparams_search=optuna", "hydra.sweeper.n_trials=2", "optimizer.lr=choice(-1.0,-2.0)",
              *TINY, f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr[-3000:]
    _assert_plain(out)
    rows = (sweep / "summary.txt").read_text().splitlines()[2:]
    assert [r.split()[0] for r in rows] == ["0", "1"] and all("failed: optimizer.lr: must be > 0" in r for r in rows)
    assert "sweep summary (" in out.stdout and rows[0] in out.stdout
    last = out.stderr.strip().splitlines()[-1]
    assert last == ("tr-train: every trial of the search failed (2 of 2, rows 'failed:' in the summary): "
                    "no best trial, no optimization_results.yaml"), out.stderr[-2000:]
    assert not (sweep / "optimization_results.yaml").exists()


def test_a_sweep_dir_that_refuses_writes_mid_search_ends_with_what_ran(tmp_path):
    """Job 0 (refused by the config check, at no cost) leaves its row; then the sweep dir refuses
    job 1's dir: the summary of what ran, one line naming the dir and the cause, exit 1."""
    from tests.integration.sweep_callbacks import modes_bind
    how, cause = ("readonly", "Permission denied") if modes_bind(tmp_path) else ("file", "File exists")
    sweep = tmp_path / "search"
    repo = str(Path(__file__).resolve().parents[2])
    env = dict(ENV, PYTHONPATH=os.pathsep.join(p for p in (repo, ENV.get("PYTHONPATH")) if p))
    try:
        out = subprocess.run(_cli("tr-train") + [
            "hparams_search=optuna", "hydra.sweeper.n_trials=2", "optimizer.lr=-1.0", *TINY,
            f"hydra.sweep.dir={sweep}", f"+hydra.callbacks.block.how={how}",
            "+hydra.callbacks.block._target_=tests.integration.sweep_callbacks.BlockTheSweepDir"],
            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    finally:
        if sweep.is_dir():
            sweep.chmod(0o755)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr[-3000:]
    table = out.stdout[out.stdout.index("sweep summary ("):].splitlines()
    assert table[-1].split()[0] == "0" and "failed: optimizer.lr: must be > 0, got -1.0" in table[-1], table
    last = out.stderr.strip().splitlines()[-1]
    assert last == f"tr-train: the sweep stopped after 1 job: hydra.sweep.dir={sweep}: {sweep / '1'}: {cause}", last
    assert "summary.txt not written" not in out.stderr  # the line above names the dir's error once
