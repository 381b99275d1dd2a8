"""A run dir has one owner and one record: a second tr-train on a held dir, a `..` path, every
spelling of "no resume" into a finished run, a resume that would change the run, an override Hydra
cannot parse or look up, a full disk when the record is written. Refusals run in this process
(``main``), before anything is trained; two tiny CPU runs show a resume keeping the record."""
from __future__ import annotations

import errno
import json
import os
import subprocess
import sys

import pytest
import yaml

from tests.integration.test_cli import run
from tests.integration.test_hardening_cli import TINY, _files, _one_line
from tr_hydra.cli import train
from tr_hydra.cli.rerun import rerun_overrides
from tr_hydra.config.plan_config import resume_choice
from tr_hydra.errors import ConfigError, DirInUse
from tr_hydra.files import hold_dir


def _refused(capsys, *argv) -> str:
    with pytest.raises(SystemExit) as e:
        train.main(list(argv))
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert e.value.code == 2 and len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def _finished(d):
    """A dir as a finished run leaves it (what the run-dir checks look at)."""
    (d / ".hydra").mkdir(parents=True)
    (d / ".hydra" / "config.yaml").write_text("model: {name: resnet_mini, width: 16}\n")
    (d / "metrics.json").write_text(json.dumps({"describe": {}, "history": []}))
    (d / "model_final.pt").write_bytes(b"weights")
    return _files(d)


def test_a_dir_is_held_by_one_process(tmp_path):
    fd = hold_dir(tmp_path, "hydra.run.dir")
    try:
        with pytest.raises(DirInUse) as e:  # another open of the dir: another owner
            hold_dir(tmp_path, "hydra.run.dir")
        assert f"hydra.run.dir: {tmp_path} is in use by another run (pid {os.getpid()})" in str(e.value)
        code = f"from tr_hydra.files import hold_dir; hold_dir({str(tmp_path)!r}, 'x')"
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=os.getcwd())
        assert p.returncode != 0 and f"pid {os.getpid()}" in p.stderr, p.stderr
    finally:
        os.close(fd)
    hold_dir(tmp_path, "hydra.run.dir")  # released: the next owner gets it


def test_a_second_run_on_a_held_run_or_sweep_dir_is_refused_naming_the_holder(tmp_path, capsys):
    d = tmp_path / "run"
    d.mkdir()
    fd = hold_dir(d, "hydra.run.dir")  # as a first tr-train there holds it
    try:
        line = _refused(capsys, *TINY, f"hydra.run.dir={d}")
        assert f"{d} is in use by another run (pid {os.getpid()})" in line, line
        assert list(d.iterdir()) == []  # nothing of the refused run landed
        s = tmp_path / "sweep"
        s.mkdir()
        fd2 = hold_dir(s, "hydra.sweep.dir")
        line = _refused(capsys, "-m", *TINY, "optimizer.lr=0.1,0.2", f"hydra.sweep.dir={s}")
        assert f"{s} is in use by another run (pid {os.getpid()})" in line and list(s.iterdir()) == [], line
        os.close(fd2)
    finally:
        os.close(fd)


def test_a_dotted_path_is_resolved_before_the_check_and_a_refused_run_writes_nothing(tmp_path, capsys):
    before = _finished(tmp_path / "run1")
    line = _refused(capsys, *TINY, f"hydra.run.dir={tmp_path}/nothere/../run1")
    assert f"hydra.run.dir={tmp_path}/run1 already holds a run's results" in line, line
    assert _files(tmp_path / "run1") == before and sorted(os.listdir(tmp_path)) == ["run1"]
    line = _refused(capsys, *TINY, f"hydra.run.dir={tmp_path}/new/deeper/../../run1")  # made dirs go too
    assert sorted(os.listdir(tmp_path)) == ["run1"], line


@pytest.mark.parametrize("spelling", ["none", "false", "null", "off", "''"])
def test_every_spelling_of_no_resume_into_a_finished_run_is_refused(tmp_path, capsys, spelling):
    before = _finished(tmp_path / "run1")
    line = _refused(capsys, *TINY, f"hydra.run.dir={tmp_path / 'run1'}", f"resume={spelling}")
    assert "already holds a run's results" in line and "a run never writes over another's" in line, line
    assert _files(tmp_path / "run1") == before


def test_resume_choice_has_one_no():
    for v in (None, False, "", "none", "None", "NULL", "false", "off", "no"):
        assert resume_choice(v) is None, v
    assert resume_choice("auto") == "auto" and resume_choice("ck.pt") == "ck.pt"
    with pytest.raises(ConfigError, match="resume: auto .* got true"):
        resume_choice(True)


def test_an_override_hydra_cannot_parse_or_look_up_is_one_line(tmp_path, capsys):
    line = _refused(capsys, *TINY, f"hydra.run.dir={tmp_path}/ünï")
    assert line == (f"tr-train: error: hydra.run.dir={tmp_path}/ünï: Hydra cannot parse this override: quote the "
                    f"value (hydra.run.dir='{tmp_path}/ünï') where it holds spaces, non-ASCII letters or any of "
                    f"()[]{{}}=,'\""), line
    line = _refused(capsys, *TINY, f"+model.{'x' * 5000}=1")
    assert line.startswith("tr-train: error: +model.xxx") and "5,007 characters): not an option" in line, line
    assert len(line) < 300 and os.listdir(tmp_path) == []


def test_a_resume_keeps_the_runs_record_and_changes_only_what_it_may(tmp_path, capsys):
    """A run whose train_size comes from the environment and which runs deterministic; resumed to
    a second epoch with the variable changed and deterministic left out: the saved (resolved)
    config is what runs, the record is the original's, the log names the change; a change of
    what the run computes is refused; a rerun replays the resolved values and no hydra.*."""
    d = tmp_path / "exp1"
    env = {"TRH_N": "128"}
    args = [a for a in TINY if not a.startswith("data.train_size")]
    out = run("tr-train", *args, "data.train_size=${oc.env:TRH_N}", "runtime.deterministic=true",
              "trainer.epochs=1", f"hydra.run.dir={d}", cwd=tmp_path, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    saved = yaml.safe_load((d / ".hydra" / "config.yaml").read_text())
    assert saved["data"]["train_size"] == 128 and saved["runtime"]["deterministic"] is True
    assert "- data.train_size=${oc.env:TRH_N}" in (d / ".hydra" / "overrides.yaml").read_text()
    record = {p.name: p.read_bytes() for p in (d / ".hydra").iterdir()}

    # a saved hydra.yaml naming a file outside the run: a rerun replays none of hydra.*
    with open(d / ".hydra" / "hydra.yaml", "a") as f:
        f.write("  overrides:\n    hydra:\n    - hydra.job_logging.handlers.file.filename=/tmp/victim.txt\n")
    replay = rerun_overrides(d)
    assert "data.train_size=128" in replay and not [o for o in replay if o.startswith(("hydra", "+hydra"))]
    (d / ".hydra" / "hydra.yaml").write_bytes(record["hydra.yaml"])

    line = _refused(capsys, f"hydra.run.dir={d}", "resume=auto", "optimizer.lr=0.05")
    assert f"hydra.run.dir={d} already holds a run of another config (optimizer.lr 0.1 there, 0.05 here)" in line, line

    out = run("tr-train", f"hydra.run.dir={d}", "resume=auto", "trainer.epochs=2", cwd=tmp_path, env={"TRH_N": "64"})
    assert out.returncode == 0 and "resumed from" in out.stdout, out.stderr[-2000:]
    assert {p.name: p.read_bytes() for p in (d / ".hydra").iterdir()} == record
    history = json.loads((d / "metrics.json").read_text())["history"]
    assert [h["epoch"] for h in history] == [1, 2]
    assert "resume: the run's saved config, with trainer.epochs 1 -> 2" in (d / "train.log").read_text()


def test_a_full_disk_when_the_record_is_written_is_one_line_and_leaves_no_empty_file(tmp_path):
    from tests.integration.test_hardening_run import _mount
    disk = tmp_path / "disk"
    disk.mkdir()
    if not _mount("-t", "tmpfs", "-o", "size=4k", "tmpfs", str(disk)):
        pytest.skip("mounting a tmpfs needs root")
    try:
        with open(disk / "filler", "wb") as f:
            try:
                f.write(b"\0" * 65536)
            except OSError as e:
                assert e.errno == errno.ENOSPC
        out = run("tr-train", *TINY, f"hydra.run.dir={disk}/run", cwd=tmp_path)
        line = _one_line(out)
        assert out.returncode == 2 and line.startswith(f"tr-train: error: record: cannot write {disk}/run/.hydra/"), line
        assert "No space left on device" in line
        assert [p for p in (disk / "run").rglob("*") if p.is_file()] == []
    finally:
        subprocess.run(["umount", str(disk)], check=True)


def test_a_resume_of_a_run_saved_with_an_option_since_removed_is_not_refused_for_it(tmp_path):
    """A run recorded while data.image_size was an option resumes: what a saved key no longer
    declares is fixed now (--rerun drops it too), and only the options are compared."""
    from omegaconf import OmegaConf

    from tr_hydra.cli._common import compose
    from tr_hydra.cli.record import RECORD, resume_changes
    saved = OmegaConf.to_container(compose(TINY), resolve=True, enum_to_str=True)
    saved["data"]["image_size"] = 32
    (tmp_path / RECORD).mkdir()
    (tmp_path / RECORD / "config.yaml").write_text(yaml.safe_dump(saved))
    was = saved["trainer"]["log_every"]
    assert resume_changes(tmp_path, compose([*TINY, "trainer.log_every=7"])) == [f"trainer.log_every {was!r} -> 7"]
    with pytest.raises(ConfigError, match=r"another config \(optimizer\.lr"):
        resume_changes(tmp_path, compose([*TINY, "optimizer.lr=0.5"]))
