"""Issue 79, the resume's side: a crafted checkpoint (its checksum right, its payload refused by
``weights_only`` or missing keys) is one line and ``resume=auto`` takes an older one. Tiny CPU
runs."""
from __future__ import annotations

import dataclasses
import hashlib
import io
import os
import zipfile

import pytest
import torch

from tests.helpers import small_config
from tests.integration.test_cli import run
from tr_hydra.config.plan_config import TrainerSpec
from tr_hydra.train import checkpoint as ck
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
