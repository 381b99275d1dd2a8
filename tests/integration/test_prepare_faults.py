"""tr-prepare's faults (issue 79): a dir in use, labels changed after the fact, a worker killed,
links and images it cannot take, keys it does not know, a deleted prepare.json; and the data
settings a preparation records for data=shards. All in process, on a few 8-pixel images."""
from __future__ import annotations

import json
import os
import signal
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tests.unit.test_data import make_folder
from tr_hydra.config.specs import DataSpec
from tr_hydra.errors import ConfigError


def _prepare(src: Path, out: Path, *extra: str) -> list[str]:
    return ["data=imagefolder", f"data.root={src}", f"prepare.out={out}", "prepare.workers=2", *extra]


def _main(args: list[str], capfd) -> tuple[int, str, str]:
    """tr-prepare in this process: (exit code, stdout, stderr), the workers' output included."""
    from tr_hydra.cli.prepare import main
    try:
        code = main(args)
    except SystemExit as e:
        code = e.code
    out, err = capfd.readouterr()
    return code, out, err


def _one_line(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err[-2000:]
    return lines[0]


def _tiny(tmp_path: Path, **kw) -> Path:
    src = tmp_path / "src"
    make_folder(src, per_class=(2, 2, 2), size=8, fmt="JPEG", **kw)
    return src


def _in_process(src: Path, out: Path, shard_samples: int = 4, **data) -> dict:
    from tr_hydra.data.prepare import Settings, prepare
    return prepare(DataSpec(name="imagefolder", root=str(src), **data), out,
                   Settings(max_side=8, shard_samples=shard_samples), workers=1, skip_corrupt=False,
                   log=lambda *_: None)


def test_a_prepare_into_a_dir_in_use_is_one_line_naming_the_holder(tmp_path, capfd):
    from tr_hydra.files import hold_dir
    src, out = _tiny(tmp_path), tmp_path / "out"
    out.mkdir()
    fd = hold_dir(out, "test")  # another run writing there (flock: a second open is refused, same process or not)
    try:
        code, _, err = _main(_prepare(src, out), capfd)
    finally:
        os.close(fd)
    line = _one_line(err)
    assert code == 2 and line.startswith(f"tr-prepare: error: prepare.out: {out} is in use by another run "
                                          f"(pid {os.getpid()})"), line
    assert list(out.iterdir()) == []  # nothing written
    code, _, err = _main(_prepare(src, out), capfd)  # the lock gone: the same command works
    assert code == 0 and (out / "index.json").is_file(), err


def test_labels_changed_cut_short_or_unchecked_are_one_line_until_prepared_again(tmp_path):
    from tr_hydra.data.shards import load_shards
    src, out = _tiny(tmp_path), tmp_path / "out"
    _in_process(src, out)
    labels = load_shards(out, log=lambda *_: None)[0]["train"][0]
    assert labels.tolist() == [0, 0, 1, 1, 2, 2]
    table, good = out / "train.npz", (out / "train.npz").read_bytes()
    with np.load(table) as z:
        cols = {k: z[k] for k in z.files}
    np.savez(table, **(cols | {"label": np.zeros_like(cols["label"])}))  # every label 0: a valid table
    with pytest.raises(ConfigError, match=rf"^data.root: {table} fails its SHA-256 check .*: it changed after "
                                          rf"tr-prepare wrote it; run tr-prepare again with prepare.out={out} "):
        load_shards(out, log=lambda *_: None)
    table.write_bytes(good[:len(good) // 2])
    with pytest.raises(ConfigError, match=rf"^data.root: {table} has {len(good) // 2:,} bytes, its index says "
                                          rf"{len(good):,}: .*cut short.*; run tr-prepare again"):
        load_shards(out, log=lambda *_: None)
    index = json.loads((out / "index.json").read_text())
    del index["splits"]["train"]["table"]  # as an index written before the tables had checksums
    (out / "index.json").write_text(json.dumps(index))
    table.write_bytes(good)
    with pytest.raises(ConfigError, match=r"holds no checksum of train.npz \(written by an older tr-prepare\): "
                                          r"run tr-prepare again"):
        load_shards(out, log=lambda *_: None)
    _in_process(src, out)  # what the lines say to do: it keeps the shards and rewrites the tables and index
    assert load_shards(out, log=lambda *_: None)[0]["train"][0].tolist() == labels.tolist()


def test_a_worker_killed_is_one_line_and_the_same_command_goes_on(tmp_path, monkeypatch, capfd):
    """A worker SIGKILLed mid-shard (the OOM killer): the pool breaks, one line, exit 2, within
    seconds (the alarm turns a hang into a failure); run again, it finishes."""
    import tr_hydra.data.prepare as prep
    src, out = tmp_path / "src", tmp_path / "out"
    make_folder(src, per_class=(4, 4, 4), size=8, fmt="JPEG")
    encode, parent = prep.encode, os.getpid()

    def dies_on_one(source, *a, **kw):  # in the forked workers only
        if os.getpid() != parent and str(source).endswith(os.path.join("train", "dog", "001.jpg")):
            os.kill(os.getpid(), signal.SIGKILL)
        return encode(source, *a, **kw)

    def hang(*_):
        raise TimeoutError("tr-prepare still waits for a dead worker")

    monkeypatch.setattr(prep, "encode", dies_on_one)
    old = signal.signal(signal.SIGALRM, hang)
    signal.alarm(30)
    try:
        code, _, err = _main(_prepare(src, out, "prepare.shard_samples=2"), capfd)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    line = _one_line(err)
    assert code == 2 and line == ("tr-prepare: error: prepare: a worker process died (killed by signal 9, SIGKILL: "
                                  "out of memory?); the finished shards are kept: run the same command again to go on")
    assert not (out / "index.json").exists() and not list(out.rglob("*.tmp"))
    monkeypatch.setattr(prep, "encode", encode)
    code, _, err = _main(_prepare(src, out, "prepare.shard_samples=2"), capfd)
    assert code == 0, err
    assert json.loads((out / "index.json").read_text())["splits"]["train"]["count"] == 12


# prepare() in a process of its own whose workers stall on one file (a test-side encode)
_STALLS = """
import sys, time, types
import tr_hydra.data.prepare as prep
encode = prep.encode
def stalls(source, *a, **kw):
    if str(source).endswith("001.jpg"):
        time.sleep(60)
    return encode(source, *a, **kw)
prep.encode = stalls
prep.prepare(types.SimpleNamespace(name="imagefolder", root=sys.argv[1]), sys.argv[2],
             prep.Settings(max_side=8, shard_samples=2), workers=2, skip_corrupt=False, log=lambda *_: None)
"""


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds the workers in /proc")
def test_a_tr_prepare_killed_leaves_no_worker_and_no_lock_behind(tmp_path):
    """tr-prepare itself SIGKILLed (the OOM killer's pick) with its workers busy: they die with
    it and none keeps prepare.out locked, so the same command goes on at once."""
    import subprocess
    import sys
    import time
    from tr_hydra.files import hold_dir
    src, out = _tiny(tmp_path), tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-c", _STALLS, str(src), str(out)], env=dict(os.environ))
    try:
        deadline = time.monotonic() + 20
        while not (out / "train" / ".shard-000000.tar.tmp").exists():  # a worker in cat/001.jpg
            assert proc.poll() is None and time.monotonic() < deadline, "prepare never reached the stalling file"
            time.sleep(0.02)
        workers = [int(d.name) for d in Path("/proc").iterdir() if d.name.isdigit() and _ppid(d) == proc.pid]
        assert len(workers) == 2
    finally:
        proc.kill()
        proc.wait()
    deadline = time.monotonic() + 5
    while any(_alive(w) for w in workers) and time.monotonic() < deadline:
        time.sleep(0.02)
    left = [w for w in workers if _alive(w)]
    for w in left:  # a regression: not left running after the test
        os.kill(w, signal.SIGKILL)
    assert not left, "workers outlived the killed tr-prepare"
    os.close(hold_dir(out, "test"))  # nobody holds it
    _in_process(src, out, shard_samples=2)  # and a run goes on
    assert json.loads((out / "index.json").read_text())["splits"]["train"]["count"] == 6


def _ppid(d: Path) -> int | None:
    try:
        return int(d.joinpath("stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def test_a_link_to_itself_or_to_nothing_is_an_undecodable_file(tmp_path, capfd):
    src, out = _tiny(tmp_path), tmp_path / "out"
    os.symlink("self.jpg", src / "train" / "cat" / "self.jpg")
    os.symlink("gone.jpg", src / "train" / "dog" / "link.jpg")
    code, _, err = _main(_prepare(src, out), capfd)
    line = _one_line(err)
    assert code == 2 and "prepare: cannot decode train/cat/self.jpg (cannot be read (a symbolic link): Too many " \
        "levels of symbolic links); set prepare.skip_corrupt=true" in line, line
    code, stdout, err = _main(_prepare(src, out, "prepare.skip_corrupt=true"), capfd)
    assert code == 0, err
    assert [ln for ln in stdout.splitlines() if ln.startswith("prepare: skipped ")] == [
        "prepare: skipped train/cat/self.jpg: cannot be read (a symbolic link): Too many levels of symbolic links",
        "prepare: skipped train/dog/link.jpg: cannot be read (a symbolic link): No such file or directory"]
    index = json.loads((out / "index.json").read_text())
    assert index["splits"]["train"]["count"] == 6 and index["splits"]["train"]["skipped"] == 2


def _png_claiming(path: Path, w: int, h: int) -> None:
    """A 1x1 PNG whose header says w x h (CRC made to match): PIL reads the size, never the pixels."""
    import io
    buf = io.BytesIO()
    Image.new("RGB", (1, 1)).save(buf, "PNG")
    png = bytearray(buf.getvalue())
    assert png[12:16] == b"IHDR"
    png[16:24] = struct.pack(">II", w, h)
    png[29:33] = struct.pack(">I", zlib.crc32(bytes(png[12:29])))
    path.write_bytes(bytes(png))


def test_an_unknown_format_or_a_huge_image_is_said_in_words(tmp_path, capfd):
    """A text file named .jpg: no BytesIO repr; a 169-megapixel PNG: refused by its size, before
    a decode (no 2 GB, no PIL warning on stderr)."""
    src, out = _tiny(tmp_path), tmp_path / "out"
    _png_claiming(src / "train" / "cat" / "big.png", 13000, 13000)
    (src / "train" / "emu" / "text.jpg").write_text("not an image")
    code, _, err = _main(_prepare(src, out), capfd)
    assert code == 2 and _one_line(err) == (
        "tr-prepare: error: prepare: cannot decode train/cat/big.png (13000 x 13000 pixels, 169 megapixels, more "
        "than prepare's cap of 89.5); set prepare.skip_corrupt=true to skip such files (finished shards are kept: "
        "run again to go on)")
    code, stdout, err = _main(_prepare(src, out, "prepare.skip_corrupt=true"), capfd)
    assert code == 0 and err == "", err
    assert [ln for ln in stdout.splitlines() if ln.startswith("prepare: skipped ")] == [
        "prepare: skipped train/cat/big.png: 13000 x 13000 pixels, 169 megapixels, more than prepare's cap of 89.5",
        "prepare: skipped train/emu/text.jpg: not an image: PIL recognises no image format in it"]


@pytest.mark.parametrize("key", ["+prepare.bogus=1", "+model.foo=1"])
def test_a_key_added_that_the_schema_does_not_declare_is_refused(tmp_path, capfd, key):
    src, out = _tiny(tmp_path), tmp_path / "out"
    code, _, err = _main(_prepare(src, out, key), capfd)
    name = key[1:].split("=")[0]
    assert code == 2 and _one_line(err).startswith(f"tr-prepare: error: {name}: not an option (+ adds only keys "
                                                   f"the schema declares; ")
    assert not out.exists()


def test_a_preparation_without_its_prepare_json_says_what_is_missing(tmp_path):
    src, out = _tiny(tmp_path), tmp_path / "out"
    _in_process(src, out)
    (out / "prepare.json").unlink()
    with pytest.raises(ConfigError, match=rf"^prepare.out={out} holds a finished preparation \(index.json and "
                                          rf"shards\) but no prepare.json .*: data=shards data.root={out} reads it "
                                          rf"as it is; to prepare again, delete that dir or pick another"):
        _in_process(src, out)
    (out / "index.json").unlink()
    with pytest.raises(ConfigError, match=r"holds tr-prepare shards but no prepare.json \(the settings and source "
                                          r"they were made from"):
        _in_process(src, out)


def test_a_preparation_records_the_data_settings_of_its_source(tmp_path):
    from tr_hydra.data.shards import recorded_data
    src, out = _tiny(tmp_path), tmp_path / "out"
    mine = dict(num_classes=3, mean=[1.0, 2.0, 3.0], std=[4.0, 5.0, 6.0], augment=False,
                crop_scale=[0.5, 1.0], crop_ratio=[0.9, 1.1], flip=False, val_crop=0.9)
    _in_process(src, out, train_size=4, num_threads=1, skip_corrupt=True, **mine)
    got = recorded_data(out)
    assert got == mine | {"channels": 3}  # where it runs (sizes, threads, skip_corrupt, root) is not recorded
    assert json.loads(json.dumps(got)) == got
    assert json.loads((out / "index.json").read_text())["data"]["name"] == "imagefolder"
    assert recorded_data(tmp_path / "nowhere") == {} and recorded_data(src) == {}
    index = json.loads((out / "index.json").read_text())
    del index["data"]  # written before the record was kept
    (out / "index.json").write_text(json.dumps(index))
    assert recorded_data(out) == {}
    (out / "index.json").write_text("{")
    assert recorded_data(out) == {}
