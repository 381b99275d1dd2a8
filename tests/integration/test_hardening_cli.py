"""Issue 48, tr-train's side: a rerun never writes into the run it replays, a run dir holding
another run's results is refused, a sweep runs every job and rows the failed ones, an impossible
run dir is one line, the stop line has no stray step, `+` adds only keys the schema declares.
Tiny CPU runs, each in its own tmp_path."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.integration.test_cli import run

TINY = ["recipe=cpu_smoke", "runtime.device=cpu", "data.train_size=128", "data.val_size=64"]


def _files(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def _one_line(out) -> str:
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr[-2000:]
    return lines[0]


def test_rerun_never_writes_into_the_run_it_replays(tmp_path):
    orig = tmp_path / "orig"
    out = run("tr-train", *TINY, "trainer.epochs=2", f"hydra.run.dir={orig}", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    before = _files(orig)
    assert {"metrics.json", "model_final.pt", ".hydra/config.yaml"} <= set(before)

    # by default a new outputs/<date>/<time>, the original untouched
    out = run("tr-train", "--rerun", str(orig), "trainer.epochs=1", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert _files(orig) == before
    new = [p.parent for p in (tmp_path / "outputs").glob("*/*/metrics.json")]
    assert len(new) == 1 and (new[0] / "model_final.pt").is_file()
    assert str(orig) not in (new[0] / ".hydra" / "hydra.yaml").read_text()

    # the original's dir named on the rerun's own command line: refused, nothing written there
    # (its .hydra/ neither); a resume of another plan there too
    for extra, needle in ((["trainer.epochs=1"], "resume=auto"),
                          (["model.width=8", "resume=auto"], "another config (model.width 16 there, 8 here)")):
        out = run("tr-train", "--rerun", str(orig), *extra, f"hydra.run.dir={orig}", cwd=tmp_path)
        line = _one_line(out)
        assert out.returncode == 2 and f"hydra.run.dir={orig} already holds a run" in line, line
        assert needle in line, line
        assert _files(orig) == before

    # an explicit new dir is honoured; a resume of that same run in its own dir goes on
    out = run("tr-train", "--rerun", str(orig), f"hydra.run.dir={tmp_path / 'again'}", cwd=tmp_path)
    assert out.returncode == 0 and (tmp_path / "again" / "metrics.json").is_file(), out.stderr[-2000:]
    assert _files(orig) == before
    out = run("tr-train", "--rerun", str(orig), "resume=auto", "trainer.epochs=3", f"hydra.run.dir={orig}",
              cwd=tmp_path)
    assert out.returncode == 0 and "resumed from" in out.stdout, out.stderr[-2000:]
    assert json.loads((orig / "metrics.json").read_text())["history"][-1]["epoch"] == 3


def test_a_sweep_runs_every_job_and_rows_the_failed_ones(tmp_path):
    """Job 0 stops on non-finite steps, job 1 fails its config check, job 2 trains: all three
    run, the failed ones are rows 'failed: <one line>', the exit code says some failed."""
    sweep = tmp_path / "sweep"
    out = run("tr-train", "-m", "optimizer.lr=1e30,-1,0.1", *TINY, "trainer.epochs=2", "trainer.log_every=1",
              "trainer.max_nonfinite=1", f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    assert out.returncode == 1, out.stderr[-2000:]
    assert "Traceback" not in out.stderr and "2 of 3 sweep jobs failed" in out.stderr, out.stderr[-2000:]
    table = (sweep / "summary.txt").read_text().splitlines()
    assert len(table) == 5 and table[2:] == out.stdout.rstrip().splitlines()[-3:], (table, out.stdout)
    assert table[0].startswith("fixed: recipe=cpu_smoke ") and table[1].split()[:2] == ["job", "optimizer.lr"]
    stop, check, ok = table[2:]
    # the trainer's own words, ending with them (not with the step: ': 2')
    assert "failed: training stopped: " in stop and "non-finite" in stop and not re.search(r": \d+$", stop), stop
    assert stop.split("failed: ")[1] == (sweep / "0" / "failed.txt").read_text().strip()
    assert list((sweep / "0" / "checkpoints").glob("ckpt_*.pt"))  # the stop's checkpoint
    assert check.endswith("failed: optimizer.lr: must be > 0, got -1.0"), check
    assert "failed" not in ok and re.search(r"^\s+2\s+0\.1\s+\d+\.\d{2}\s+[\d,]+\.\d$", ok), ok
    assert (sweep / "2" / "model_final.pt").is_file() and not (sweep / "2" / "failed.txt").exists()
    # the same sweep dir again: refused before anything is written (it holds that sweep's results)
    out = run("tr-train", "-m", "optimizer.lr=0.1,0.2", *TINY, f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    assert out.returncode == 2 and "already holds another sweep's results (jobs 0, 2)" in _one_line(out)


def test_a_sweep_value_of_the_wrong_type_is_one_line(tmp_path):
    out = run("tr-train", "-m", "optimizer.lr=0.1,abc", *TINY, f"hydra.sweep.dir={tmp_path / 'sweep'}",
              cwd=tmp_path)
    line = _one_line(out)
    assert out.returncode == 2 and "optimizer.lr=abc" in line and "could not be converted to Float" in line, line
    assert not (tmp_path / "sweep").exists()


def test_an_impossible_run_dir_is_one_line(tmp_path):
    (tmp_path / "afile").write_text("")
    cases = [("hydra.run.dir", tmp_path / "afile" / "x", f"{tmp_path / 'afile'} is a file, not a directory"),
             ("hydra.run.dir", tmp_path / "afile", f"{tmp_path / 'afile'} is a file, not a directory"),
             ("hydra.sweep.dir", tmp_path / "afile" / "s", "is a file, not a directory")]
    if Path("/proc/self").is_dir():
        cases.append(("hydra.run.dir", Path("/proc/x"), "cannot make /proc/x: No such file or directory"))
    for key, path, cause in cases:
        out = run("tr-train", *(["-m", "seed=1,2"] if "sweep" in key else []), *TINY, f"{key}={path}",
                  cwd=tmp_path)
        line = _one_line(out)
        assert out.returncode == 2 and line.startswith(f"tr-train: error: {key}={path}: ") and cause in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]  # the check left nothing behind


def test_a_nonfinite_stop_is_one_line_without_the_step_appended(tmp_path):
    out = run("tr-train", *TINY, "optimizer.lr=1e30", "trainer.log_every=1", "trainer.max_nonfinite=1",
              f"hydra.run.dir={tmp_path / 'r'}", cwd=tmp_path)
    line = _one_line(out)
    assert out.returncode == 2 and line.startswith("tr-train: error: training stopped: ") and "non-finite" in line, line
    assert not re.search(r": \d+$", line), line  # the trainer's words end the line, not the step
    assert list((tmp_path / "r" / "checkpoints").glob("ckpt_*.pt"))


def test_one_line_leaves_out_a_cause_that_is_only_a_number():
    """The trainer raises a step's error while handling its internal stop (whose text is the
    step): the line ends with the error, not ': 12'. A number alone is still said."""
    from tr_hydra.cli._common import one_line
    from tr_hydra.runtime.guards import NonFiniteError

    class _Stop(Exception):  # as the trainer's: leaves the epoch loop, its text the step
        def __init__(self, step, epoch, error=None):
            super().__init__(step)
            self.step, self.epoch, self.error = step, epoch, error
    err = NonFiniteError("training stopped: 3 steps with non-finite loss")
    try:
        try:
            raise _Stop(12, 0, error=err) from None
        except _Stop as stop:
            raise stop.error
    except NonFiniteError as e:
        assert e.__context__ is not None and str(e.__context__) == "12"
        assert one_line(e) == "training stopped: 3 steps with non-finite loss"
    assert one_line(KeyError(5)) == "5"
    try:
        try:
            raise OSError("disk")
        except OSError:
            raise RuntimeError("checkpoint not written")
    except RuntimeError as e:
        assert one_line(e) == "checkpoint not written: disk"


GROUPS = ["model", "optimizer", "data", "variants", "trainer", "runtime", "plan", "dist", "bench"]


@pytest.mark.parametrize("key", [f"{g}.foo" for g in GROUPS] + ["foo", "data.crop_scale_x"])
def test_plus_adds_only_keys_the_schema_declares(key):
    from tr_hydra.cli._common import compose
    from tr_hydra.resolve import resolve
    from tr_hydra.errors import ConfigError
    with pytest.raises(ConfigError, match=rf"^{re.escape(key)}: not an option \(\+ adds only keys"):
        resolve(compose([f"+{key}=1"]))


def test_plus_into_a_free_form_map_is_kept():
    from tr_hydra.cli._common import compose
    from tr_hydra.resolve import resolve
    pc = resolve(compose(["+runtime.inductor_options.max_autotune=true"]))
    assert pc.runtime.inductor_options == (("max_autotune", True),)
    pc = resolve(compose(["runtime.inductor_options={benchmark_fusion:true}",
                                   "+runtime.inductor_options.max_autotune=false"]))
    assert dict(pc.runtime.inductor_options) == {"benchmark_fusion": True, "max_autotune": False}


def test_plus_unknown_key_on_the_command_line_is_one_line(tmp_path):
    out = run("tr-train", "+model.foo=1", *TINY, f"hydra.run.dir={tmp_path / 'r'}", cwd=tmp_path)
    line = _one_line(out)
    assert out.returncode == 2 and line.startswith("tr-train: error: model.foo: not an option"), line
    assert not (tmp_path / "r").exists()
