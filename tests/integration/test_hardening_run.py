"""Issue 48, the run's side: disk errors are one line (no .tmp left, earlier checkpoints
intact), TensorBoard on a read-only or full disk is one warning, a bad .npz is one line, a stop
on non-finite steps keeps finite BN statistics, a finished run's summary survives its resume,
every checkpoint corrupt is refused, fewer class folders than classes is said, the decoders'
own lines stay off stderr. Tiny CPU runs."""
from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import stat
import subprocess
import zipfile

import numpy as np
import pytest
import torch

from tests.helpers import small_config
from tests.integration.test_cli import run
from tr_hydra.config.specs import TrainerSpec
from tr_hydra.errors import ConfigError, DiskError
from tr_hydra.train import checkpoint as ck
from tr_hydra.train.trainer import Trainer

TINY = ["data.train_size=256", "data.val_size=64", "runtime.device=cpu"]


def _one_line(out) -> str:
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr[-3000:]
    return lines[0]


def _tmp_files(d):
    return sorted(str(p) for p in d.rglob("*.tmp"))


def _mount(*args) -> bool:
    if os.geteuid() != 0 or not shutil.which("mount"):
        return False
    return subprocess.run(["mount", *args], capture_output=True).returncode == 0


@contextlib.contextmanager
def read_only(d):
    """``d`` read-only for this process: a read-only bind mount as root (root writes through
    a mode), the mode bits otherwise (files in it too: TensorBoard reopens its file each write)."""
    d = str(d)
    if os.geteuid() == 0:
        if not (_mount("--bind", d, d) and _mount("-o", "remount,bind,ro", d)):
            subprocess.run(["umount", d], capture_output=True)
            pytest.skip("root, but no read-only bind mount here")
        try:
            yield "Read-only file system"
        finally:
            subprocess.run(["umount", d], check=True)
        return
    modes = {p: p.stat().st_mode for p in [*_paths(d)]}
    for p in modes:
        p.chmod(0o555 if p.is_dir() else 0o444)
    try:
        yield "Permission denied"
    finally:
        for p, m in modes.items():
            p.chmod(m)


def _paths(d):
    from pathlib import Path
    d = Path(d)
    return [d, *d.rglob("*")]


@pytest.fixture
def small_disk(tmp_path):
    """A 560 KiB tmpfs (root only: a real full disk)."""
    d = tmp_path / "disk"
    d.mkdir()
    if not _mount("-t", "tmpfs", "-o", "size=560k", "tmpfs", str(d)):
        pytest.skip("mounting a tmpfs needs root")
    yield d
    subprocess.run(["umount", str(d)], check=True)


# ---------------------------------------------------------------------------- item 3: disk errors
def test_checkpoints_made_read_only_mid_run_is_one_line(tmp_path):
    """The first checkpoint written, checkpoints/ becomes read-only while the run goes on: the
    second one fails as one line, the first stays whole, no .tmp."""
    import time

    from tests.integration.test_cli import ENV, _cli
    d = tmp_path / "r"
    args = ["data.train_size=1024", "data.val_size=64", "runtime.device=cpu", "trainer.epochs=2",
            f"hydra.run.dir={d}"]
    proc = subprocess.Popen(_cli("tr-train") + args, cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=ENV)
    try:
        t0 = time.monotonic()
        while not ck.checkpoints_in(d) and proc.poll() is None and time.monotonic() - t0 < 300:
            time.sleep(0.02)
        first = ck.checkpoints_in(d)
        assert [p.name for p in first] == ["ckpt_e0001_s00000016.pt"], proc.communicate()
        with read_only(d / "checkpoints") as cause:
            out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    out = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    line = _one_line(out)
    assert out.returncode == 2, out.stderr
    assert line == f"tr-train: error: checkpoint: cannot write {d}/checkpoints/ckpt_e0002_s00000032.pt: {cause}", line
    assert ck.checkpoints_in(d) == first and ck.load(first[0])["position"]["step"] == 16
    assert _tmp_files(d) == []


def test_a_full_disk_is_one_line_with_earlier_checkpoints_intact(tmp_path, small_disk):
    d = small_disk / "run"
    out = run("tr-train", *TINY, "trainer.epochs=4", f"hydra.run.dir={d}", cwd=tmp_path)
    line = _one_line(out)
    assert out.returncode == 2 and line.startswith("tr-train: error: ") and "No space left on device" in line, line
    assert str(d) in line
    kept = ck.checkpoints_in(d)
    assert kept and all(ck.load(p) for p in kept)
    assert _tmp_files(d) == []


def test_a_failed_write_removes_its_temporary_file(tmp_path, monkeypatch):
    """ENOSPC where a full disk says it (the data written, at fsync): checkpoints, model_final.pt
    and metrics.json each leave no .tmp and raise one DiskError naming the file."""
    tr = Trainer(small_config(train_size=64, batch=32, trainer=TrainerSpec(epochs=1)), tmp_path,
                 log=lambda *_: None)
    tr.fit()
    before = {p.name: p.read_bytes() for p in (tmp_path / "checkpoints").iterdir()}
    real = os.fsync

    def full(fd):
        if stat.S_ISREG(os.fstat(fd).st_mode):  # a file, not the directory's rename fsync
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd)
    monkeypatch.setattr(os, "fsync", full)
    cases = [(lambda: tr.checkpointer.save(1, 2, []), "checkpoint", tmp_path / "checkpoints" / "ckpt_e0001_s00000002.pt"),
             (tr.checkpointer.save_final, "weights", tmp_path / "model_final.pt"),
             (lambda: tr.metrics.write([]), "metrics", tmp_path / "metrics.json")]
    for call, what, path in cases:
        with pytest.raises(DiskError) as e:
            call()
        assert str(e.value) == f"{what}: cannot write {path}: No space left on device"
        assert _tmp_files(tmp_path) == []
    monkeypatch.undo()
    assert {p.name: p.read_bytes() for p in (tmp_path / "checkpoints").iterdir()} == before
    assert json.loads((tmp_path / "metrics.json").read_text())["summary"]  # the old file stands


def test_tensorboard_on_a_read_only_dir_is_one_warning_and_training_goes_on(tmp_path):
    d = tmp_path / "r"
    (d / "tb").mkdir(parents=True)
    with read_only(d / "tb") as cause:
        out = run("tr-train", *TINY, "trainer.epochs=1", f"hydra.run.dir={d}", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Traceback" not in out.stderr and "Exception in thread" not in out.stderr, out.stderr[-3000:]
    warn = [ln for ln in out.stdout.splitlines() if ln.startswith("tensorboard:")]
    assert len(warn) == 1 and f"{d}/tb/" in warn[0] and cause in warn[0], out.stdout
    assert (d / "model_final.pt").is_file() and ck.checkpoints_in(d)


def test_tensorboard_made_read_only_mid_run_is_one_warning(tmp_path, capfd):
    from tr_hydra.telemetry.tensorboard import Telemetry
    tr = Trainer(small_config(train_size=64, batch=32), tmp_path, log=lambda *_: None, telemetry=False)
    said = []
    tel = Telemetry(tmp_path, tr.compiled, tr.arena, log=said.append)
    tel.start(0)
    tel.writer.flush()
    m = {"loss": 1.0, "top1": 0.0, "top5": 0.0}
    with read_only(tmp_path / "tb") as cause:
        for step in range(1, 4):  # the writer's thread fails; the next call says it, once
            tel.train(step, m, lr=0.1, img_per_sec=1.0, step_time_ms=1.0, data_wait_ms=0.0, loss_scale=None,
                      skipped=0.0)
            if tel.writer is not None:
                with contextlib.suppress(Exception):
                    tel.writer.flush()
        tel.val(4, "val", m)
        tel.close({"a": 1}, {"x": 1.0})
    assert len(said) == 1 and said[0].startswith(f"tensorboard: cannot write {tmp_path}/tb/"), said
    assert cause in said[0] and "TensorBoard is off" in said[0]
    assert tel.writer is None
    err = capfd.readouterr().err
    assert "Traceback" not in err and "Exception in thread" not in err, err


# ---------------------------------------------------------------------------- item 4: bad .npz
def _npz(tmp_path):
    x = np.zeros((32, 8, 8, 3), np.uint8)
    y = np.arange(32) % 10
    good = tmp_path / "good.npz"
    np.savez(good, x_train=x, y_train=y, x_val=x[:16], y_val=y[:16])
    text = tmp_path / "text.npz"
    text.write_text("x_train,y_train\n1,2\n")
    cut = tmp_path / "cut.npz"
    cut.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    damaged = tmp_path / "damaged.npz"
    raw = bytearray(good.read_bytes())
    raw[400:500] = bytes(b ^ 0xFF for b in raw[400:500])
    damaged.write_bytes(bytes(raw))
    return text, cut, damaged


def test_a_bad_npz_is_one_config_error_naming_the_file(tmp_path):
    from types import SimpleNamespace

    from tr_hydra.data.index import load_arrays
    from tr_hydra.data.sizes import dataset_sizes
    text, cut, damaged = _npz(tmp_path)
    for path, why, sizes in ((text, "is not a .npz archive", True), (cut, "truncated or damaged", True),
                             (damaged, "truncated or damaged", False)):  # (its labels are whole)
        data = SimpleNamespace(name="arrays", path=str(path), train_size=None, val_size=None, root=None)
        reads = [lambda: dataset_sizes(data, None, None)] if sizes else []
        for read in reads + [lambda: load_arrays(path, 10)]:
            with pytest.raises(ConfigError) as e:
                read()
            msg = str(e.value)
            assert msg.startswith("data.path: ") and str(path) in msg and why in msg and "\n" not in msg, msg
    with pytest.raises(zipfile.BadZipFile):  # (what numpy itself says about the damaged one)
        np.load(damaged)["x_train"]


@pytest.mark.parametrize("sizes", [False, True])
def test_a_bad_npz_from_the_command_line_is_one_line(tmp_path, sizes):
    text, cut, _ = _npz(tmp_path)
    given = ["data.train_size=32", "data.val_size=16"] if sizes else []  # (where the arrays are read for training)
    for path, why in ((text, "is not a .npz archive"), (cut, "is a truncated or damaged .npz archive")):
        out = run("tr-train", "data=arrays", f"data.path={path}", "variants.batch_size=16",
                  "variants.val_batch_size=16", "runtime.device=cpu", *given, f"hydra.run.dir={tmp_path / 'r'}",
                  cwd=tmp_path)
        line = _one_line(out)
        assert out.returncode == 2 and line.startswith(f"tr-train: error: data.path: {path} {why}"), line


# ---------------------------------------------------------------------------- item 5 end to end
def test_a_stop_on_nonfinite_steps_keeps_finite_bn_statistics(tmp_path):
    d = tmp_path / "r"
    out = run("tr-train", *TINY, "trainer.epochs=3", "optimizer.lr=1e6", "trainer.max_nonfinite=1",
              f"hydra.run.dir={d}", cwd=tmp_path)
    line = _one_line(out)
    assert out.returncode == 2 and "reached trainer.max_nonfinite=1 at step" in line, line
    assert line.endswith("no skipped step changed the weights or the BatchNorm statistics, which are finite"), line
    stop = ck.load(ck.checkpoints_in(d)[0])
    for name in ("B_PREV_MEAN", "B_PREV_VAR", "W_BN_WEIGHT", "W_DEEP_CONV", "M_DEEP_CONV"):
        assert torch.isfinite(stop["regions"][name].view(torch.float32)).all(), name


# ---------------------------------------------------------------------------- item 7
def test_a_resumed_finished_run_keeps_its_summary(tmp_path):
    pc = small_config(train_size=64, batch=32, trainer=TrainerSpec(epochs=1))
    Trainer(pc, tmp_path, log=lambda *_: None).fit()
    first = json.loads((tmp_path / "metrics.json").read_text())
    assert first["summary"]["img_per_sec"] > 0
    said = []
    import dataclasses
    res = Trainer(dataclasses.replace(pc, resume="auto"), tmp_path, log=said.append).fit()
    again = json.loads((tmp_path / "metrics.json").read_text())
    assert again["summary"] == first["summary"] and again["history"] == first["history"]
    assert res.img_per_sec == first["summary"]["img_per_sec"] and res.steps == 2
    assert any(s.startswith("nothing to train: the run was complete at step 2") for s in said), said


def test_every_checkpoint_corrupt_is_refused_and_kept_unless_resume_none(tmp_path):
    import dataclasses
    pc = small_config(train_size=64, batch=32, trainer=TrainerSpec(epochs=2))
    Trainer(pc, tmp_path, log=lambda *_: None).fit()
    found = ck.checkpoints_in(tmp_path)
    assert len(found) == 2
    for p in found:
        p.write_bytes(p.read_bytes()[:1000])
    cut = {p: p.read_bytes() for p in found}
    said = []
    with pytest.raises(ck.CheckpointError) as e:
        Trainer(dataclasses.replace(pc, resume="auto"), tmp_path, log=said.append).fit()
    msg = str(e.value)
    assert msg.startswith(f"resume=auto: all 2 checkpoints in {tmp_path / 'checkpoints'} are corrupt (")
    assert msg.endswith("; they are kept: move them away, or train in another run dir (leave hydra.run.dir "
                        "out for a new one)") and "resume=none" not in msg and "\n" not in msg, msg
    # an older one is tried only where there is one
    notes = [s for s in said if "checksum mismatch" in s]
    assert [s.endswith("; trying an older one") for s in notes] == [True, False], notes
    assert {p: p.read_bytes() for p in ck.checkpoints_in(tmp_path)} == cut
    res = Trainer(dataclasses.replace(pc, resume="none"), tmp_path, log=lambda *_: None).fit()  # afresh
    assert res.steps == 4 and all(ck.load(p) for p in ck.checkpoints_in(tmp_path))


def _folder(root, classes: int, per_class: int = 4, broken: int = 0):
    from PIL import Image
    rng = np.random.default_rng(0)
    for split in ("train", "val"):
        for c in range(classes):
            cd = root / split / f"c{c}"
            cd.mkdir(parents=True)
            for i in range(per_class):
                Image.fromarray(rng.integers(0, 255, (20, 20, 3), dtype=np.uint8)).save(cd / f"{i}.jpg", quality=90)
    for i in range(broken):  # truncated JPEGs: half a file, and its first 300 bytes
        p = root / "train" / f"c{i}" / "0.jpg"
        raw = p.read_bytes()
        p.write_bytes(raw[: len(raw) // 2] if i % 2 == 0 else raw[:300])


def test_fewer_class_folders_than_num_classes_is_said(tmp_path):
    from tests.unit.test_data import folder_config
    from tr_hydra.data.dali_source import load_index
    _folder(tmp_path / "img", classes=2)
    pc = folder_config(tmp_path / "img", train=8, val=8)
    said = []
    load_index(pc.source_spec(), said.append)
    assert len(said) == 1 and said[0].startswith(f"data: {tmp_path / 'img' / 'train'} has 2 class folders but "
                                                 f"data.num_classes=3: 1 of the model's outputs never"), said
    _folder(tmp_path / "img3", classes=3)
    said.clear()
    load_index(folder_config(tmp_path / "img3", train=8, val=8).source_spec(), said.append)
    assert said == []


def test_skipped_truncated_jpegs_print_only_tr_hydras_line(tmp_path):
    _folder(tmp_path / "img", classes=3, per_class=8, broken=2)
    out = run("tr-train", "data=imagefolder", f"data.root={tmp_path / 'img'}", "data.num_classes=3",
              "variants.batch_size=8", "variants.val_batch_size=8", "data.skip_corrupt=true",
              "runtime.device=cpu", f"hydra.run.dir={tmp_path / 'r'}", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stderr.strip() == "", out.stderr[-3000:]
    assert "data: skipping 2 undecodable file(s)" in out.stdout, out.stdout


def test_the_stderr_filter_drops_decoder_lines_and_passes_the_rest(capfd):
    from tr_hydra.data.decoder_noise import DecoderNoiseFilter
    f = DecoderNoiseFilter()
    try:
        assert f.serving()
        os.write(2, b"\x1b[0;31m[ERROR] \x1b[0m[jpeg_parser] Invalid marker\n")
        os.write(2, b"Premature end of JPEG data\nsomething else\n")
        os.write(2, b"progress 1/2\r")
        os.write(2, b"Corrupt JPEG data: 12 extraneous bytes before marker 0xd9\n")
    finally:
        f.stop()
    os.write(2, b"after\n")
    assert capfd.readouterr().err == "something else\nprogress 1/2\rafter\n"
    assert f.dropped == 3 and not f.thread.is_alive()
