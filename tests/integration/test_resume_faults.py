"""Issue 79, the resume's side: a crafted checkpoint (its checksum right, its payload refused by
``weights_only`` or missing keys) is one line and ``resume=auto`` takes an older one; a run
stopped inside an epoch and resumed reports that epoch, and its throughput, as a run that never
stopped; a checkpoint older than those tallies still resumes, saying what its figures cover.
Tiny CPU runs."""
from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import zipfile

import pytest
import torch

from tests.helpers import fit_stop_resume, small_config
from tests.integration.test_cli import run
from tr_hydra.config.specs import TrainerSpec
from tr_hydra.train import checkpoint as ck
from tr_hydra.train import summary as sm
from tr_hydra.train import tally
from tr_hydra.train.stop import StopPolicy
from tr_hydra.train.trainer import Trainer


class _Call:
    """A pickle that calls a function when loaded without ``weights_only`` (here a harmless one)."""

    def __reduce__(self):
        return (os.getpid, ())


def _write(path, payload) -> None:
    """``payload`` (or the bytes of one) as a checkpoint file: the right magic and a SHA-256 that
    matches."""
    buf = io.BytesIO()
    if not isinstance(payload, bytes):
        torch.save(payload, buf)
    data = buf.getvalue() or payload
    path.write_bytes(ck.MAGIC + hashlib.sha256(data).digest() + data)


def _cut_pickle(path) -> bytes:
    """The payload of the checkpoint ``path`` with its pickle cut short (its tensors whole)."""
    old = zipfile.ZipFile(io.BytesIO(path.read_bytes()[40:]))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as z:
        for name in old.namelist():
            data = old.read(name)
            z.writestr(name, data[:len(data) // 2] if name.endswith("data.pkl") else data)
    return out.getvalue()


def _det(pc):
    return dataclasses.replace(pc, runtime=dataclasses.replace(pc.runtime, deterministic=True))


def _history(d):
    return json.loads((d / "metrics.json").read_text())["history"]


def _without(state, *keys):
    return {k: v for k, v in state.items() if k not in keys}


# ---------------------------------------------------------------------------- item 9
def test_a_crafted_checkpoint_is_one_error_and_resume_auto_takes_an_older_one(tmp_path):
    pc = small_config(train_size=64, batch=32, trainer=TrainerSpec(epochs=1))
    Trainer(pc, tmp_path, log=lambda *_: None).fit()
    good = ck.checkpoints_in(tmp_path)[0]
    state = ck.load(good)
    crafted = tmp_path / "checkpoints" / "ckpt_e0009_s00000099.pt"  # the newest by its name
    cases = [({"regions": {}, "call": _Call()}, "torch.load(weights_only=True) refuses (Trying to load unsupported GLOBAL"),
             (_without(state, "fingerprint"), "is not a whole tr_hydra checkpoint (no 'fingerprint')"),
             (state | {"position": {"epoch": 1, "step": "2"}}, "(position 'step' is '2', not a count)"),
             (state | {"rng": {}}, "('rng' has no torch generator state"),
             ([1, 2], "(a list, not a dict)"),
             (state | {"extra": {tally.EPOCH_KEY: {"epoch": 0}}}, "(extra.epoch_so_far.step is missing, not int)"),
             (_cut_pickle(good), "torch.load(weights_only=True) refuses ("),
             (b"\x80\x02J\x01\x02", "refuses (unpack requires a buffer of 4 bytes)")]  # (a struct.error)
    for payload, why in cases:
        _write(crafted, payload)
        with pytest.raises(ck.CheckpointError) as e:
            ck.load(crafted)
        msg = str(e.value)
        assert msg.startswith(f"resume: {crafted} ") and why in msg and "\n" not in msg, msg
        notes = []
        assert ck.newest_valid(tmp_path, log=notes.append) == good
        assert notes == [f"{msg}; trying an older one"], notes
    said = []  # resume=auto goes on from the newest valid one; resume=<the crafted file> stops
    res = Trainer(dataclasses.replace(pc, resume="auto"), tmp_path, log=said.append).fit()
    assert res.steps == 2 and f"resumed from {good} at epoch 2, step 2" in said, said
    with pytest.raises(ck.CheckpointError, match=r"refuses \(unpack requires a buffer of 4 bytes\)"):
        Trainer(dataclasses.replace(pc, resume=str(crafted)), tmp_path / "other", log=lambda *_: None).fit()


def test_an_explicit_resume_of_a_crafted_checkpoint_is_one_line(tmp_path):
    crafted = tmp_path / "ckpt_e0001_s00000001.pt"
    _write(crafted, {"call": _Call()})
    out = run("tr-train", "recipe=cpu_smoke", "runtime.device=cpu", "data.train_size=128", "data.val_size=64",
              f"resume={crafted}", f"hydra.run.dir={tmp_path / 'r'}", cwd=tmp_path)
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert out.returncode == 2 and len(lines) == 1 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert lines[0].startswith(f"tr-train: error: resume: {crafted} holds a payload that "
                               f"torch.load(weights_only=True) refuses ("), lines[0]


# ---------------------------------------------------------------------------- item 14
def _same_epochs(full, resumed):
    """The epochs' records of two runs agree: their train metrics to a few float32 roundings (the
    device sums each read's losses in float32, and a stop makes two reads of one), the rest
    exactly."""
    assert len(full) == len(resumed), (full, resumed)
    for a, b in zip(full, resumed):
        assert b["train"]["count"] == a["train"]["count"], (a, b)
        assert b["train"] == pytest.approx(a["train"], rel=4 * torch.finfo(torch.float32).eps, abs=0), (a, b)
        rest = lambda r: {k: v for k, v in r.items() if k not in ("train", "img_per_sec")}  # noqa: E731
        assert rest(b) == rest(a)


def test_a_stop_by_max_steps_inside_an_epoch_resumes_to_the_epochs_of_an_unbroken_run(tmp_path):
    base = _det(small_config(train_size=96, batch=32))  # 3 steps an epoch
    full, resumed, at_stop = fit_stop_resume(base, tmp_path, 4, epochs=2)
    assert at_stop == ["ckpt_e0001_s00000004.pt", "ckpt_e0001_s00000003.pt"]
    _same_epochs(_history(tmp_path / "a"), _history(tmp_path / "b"))
    a, b = full.final_state_dict(), resumed.final_state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    # the summary's throughput is the whole run's: its 192 images over the epochs' train time
    s = json.loads((tmp_path / "b" / "metrics.json").read_text())["summary"]
    secs = sum(96 / r["img_per_sec"] for r in _history(tmp_path / "b"))
    assert s["img_per_sec"] == pytest.approx(192 / secs, rel=1e-9)
    assert s["resumed_at_step"] == 4 and "timed_since_resume" not in s
    assert s["total_seconds"] >= secs
    assert "img/s (the whole run, resumed at step 4)" in sm.line(s)


@pytest.mark.parametrize("at, kept", [(5, ["ckpt_e0001_s00000005.pt", "ckpt_e0001_s00000003.pt"]),
                                      (3, ["ckpt_e0000_s00000003.pt"]),
                                      (6, ["ckpt_e0001_s00000006.pt", "ckpt_e0001_s00000003.pt"])])
def test_a_preemption_inside_an_epoch_resumes_to_the_epochs_of_an_unbroken_run(tmp_path, monkeypatch, at, kept):
    """Stopped as a signal stops it (after a step, before its read), at step 5 (epoch 2's second
    step: step 4 read into the host's tally, step 5 still in the device's accumulator), or at
    step 3 or 6 (an epoch's last, before its record and its validation; 6: the run's last), then
    resumed."""
    pc = _det(small_config(train_size=96, batch=32, trainer=TrainerSpec(epochs=2, log_every=1)))
    Trainer(pc, tmp_path / "a", log=lambda *_: None).fit()
    calls = []

    def stop_at(self, at_log):
        calls.append(1)
        return len(calls) == at
    with monkeypatch.context() as m:
        m.setattr(StopPolicy, "preempted", stop_at)
        assert Trainer(pc, tmp_path / "b", log=lambda *_: None).fit().preempted
    assert [p.name for p in ck.checkpoints_in(tmp_path / "b")] == kept
    res = Trainer(dataclasses.replace(pc, resume="auto"), tmp_path / "b", log=lambda *_: None).fit()
    _same_epochs(_history(tmp_path / "a"), _history(tmp_path / "b"))
    assert res.summary["resumed_at_step"] == at and res.img_per_sec == res.summary["img_per_sec"]
    secs = sum(96 / r["img_per_sec"] for r in res.epochs)
    assert res.img_per_sec == pytest.approx(192 / secs, rel=1e-9)


def test_a_checkpoint_without_the_tallies_resumes_and_says_what_its_figures_cover(tmp_path):
    base = _det(small_config(train_size=96, batch=32, trainer=TrainerSpec(epochs=2)))
    full = Trainer(base, tmp_path / "a", log=lambda *_: None)
    full.fit()
    old = tmp_path / "old"
    pc = dataclasses.replace(base, trainer=TrainerSpec(epochs=2, max_steps=4))
    Trainer(pc, old, log=lambda *_: None).fit()
    newest = ck.checkpoints_in(old)[0]
    state = ck.load(newest)
    _write(newest, state | {"extra": _without(state["extra"], tally.EPOCH_KEY, tally.RUN_KEY)})  # as before them
    said = []
    again = Trainer(dataclasses.replace(pc, trainer=TrainerSpec(epochs=2), resume="auto"), old, log=said.append)
    res = again.fit()
    a, b = full.final_state_dict(), again.final_state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)  # the resume itself is exact
    assert "resume: the checkpoint has no tally of epoch 2 before step 4; that epoch's train metrics cover " \
           "steps 5 on" in said, said
    last = res.epochs[-1]
    assert (last["epoch"], last["step"], last["train_from_step"], last["train"]["count"]) == (2, 6, 4, 64)
    assert res.summary["resumed_at_step"] == 4 and res.summary["timed_since_resume"] is True
    assert any(s.startswith("summary: ") and "img/s since the resume at step 4" in s for s in said), said
