"""Faults never lose work and always explain themselves (see docs/reliability.md)."""
from __future__ import annotations

import dataclasses
import json
import math
import signal
import subprocess
import time

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from tr_hydra.compiler.compile import compile_plan
from tr_hydra.config.specs import OptimizerSpec, TrainerSpec
from tr_hydra.train import checkpoint as ck
from tr_hydra.runtime.guards import MemoryPlanError, NonFiniteError, check_memory
from tr_hydra.train.trainer import Trainer

from tests.helpers import small_config
from tests.integration.test_cli import ENV, _cli


def _poison(tr, index: int, value=float("nan")):
    """Make synthetic train batch ``index`` (of every epoch) non-finite."""
    imgs, _ = tr.source._bank("train", tr.pc.variant("train_base").res, tr.pc.batch_size)
    b = tr.pc.batch_size
    imgs[index * b:(index + 1) * b, 0, 0, 0] = value


def test_nonfinite_stops_after_max_with_checkpoint_and_names_region(tmp_path):
    pc = small_config(train_size=128, batch=32, trainer=TrainerSpec(epochs=5, log_every=1, max_nonfinite=2))
    tr = Trainer(pc, tmp_path, log=lambda *_: None)
    _poison(tr, 2)
    with pytest.raises(NonFiniteError) as e:
        tr.fit()
    msg = str(e.value)
    assert "2 steps with non-finite" in msg and "first at step 3" in msg and "G_BN_BIAS" in msg and "loss" in msg
    w = tr.arena.span(*__import__("tr_hydra.memory.regions", fromlist=["x"]).series_span("W", ("BN_BIAS", "DEEP_CONV")))
    assert torch.isfinite(w).all()  # the bad steps were skipped
    state = ck.load(ck.checkpoints_in(tmp_path)[0])  # written before stopping
    assert state["position"]["step"] == 7


def test_fp16_loss_scale_collapse_is_reported(tmp_path):
    pc = small_config(amp=True, amp_dtype="fp16", train_size=32, batch=8, res=8, val_res=8, lowres_res=8,
                      trainer=TrainerSpec(epochs=20, log_every=1, loss_scale=2.0 ** -10))
    tr = Trainer(pc, tmp_path, log=lambda *_: None)
    for i in range(4):
        _poison(tr, i, float("inf"))
    with pytest.raises(NonFiniteError, match="fp16 loss scale collapsed"):
        tr.fit()


def test_memory_check_names_figures_and_a_batch_that_fits():
    pc = small_config(model="resnet50", batch=64, res=64, val_res=64, train_size=640, val_size=64,
                      amp=True, lowres_res=48)
    c = compile_plan(pc)
    need = c.plan.total_bytes + c.activation_estimate
    free = int((c.plan.total_bytes + 0.5 * c.activation_estimate) * 1.1)  # room for half the activations
    with pytest.raises(MemoryPlanError) as e:
        check_memory(c, free, "cuda:0")
    msg = str(e.value)
    assert "variants.batch_size=64" in msg and "GiB are free" in msg
    fits = int(msg.split("variants.batch_size=")[-1].rstrip(")"))
    assert 1 <= fits < 64
    smaller = compile_plan(dataclasses.replace(pc, batch_size=fits, variants=small_config(
        model="resnet50", batch=fits, res=64, val_res=64, train_size=640, val_size=64, lowres_res=48).variants))
    check_memory(smaller, free, "cuda:0")  # the suggested batch does fit
    check_memory(c, int(need * 2), "cuda:0")


def _train_proc(tmp_path, *args):
    cmd = _cli("tr-train") + ["data=synthetic", "data.train_size=2048", "data.val_size=64",
                              "variants.batch_size=16", "trainer.epochs=40", "trainer.log_every=8",
                              f"hydra.run.dir={tmp_path / 'run'}", *args]
    return subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=ENV)


def _wait_for(pred, timeout=180):
    t = time.time()
    while time.time() - t < timeout:
        if pred():
            return True
        time.sleep(0.2)
    return False


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_preemption_signal_writes_checkpoint_and_resume_finishes(tmp_path, sig):
    p = _train_proc(tmp_path)
    assert _wait_for(lambda: (tmp_path / "run" / "metrics.json").is_file())  # an epoch is done
    p.send_signal(sig)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err[-2000:]
    assert f"stopped by {sig.name}" in out
    newest = ck.checkpoints_in(tmp_path / "run")[0]
    stopped_at = ck.load(newest)["position"]["step"]
    assert stopped_at % 128 != 0 or stopped_at > 0  # mid-epoch or at a boundary: either is fine
    done = subprocess.run(_cli("tr-train") + ["data=synthetic", "data.train_size=2048", "data.val_size=64",
                                              "variants.batch_size=16", "trainer.epochs=40",
                                              "trainer.log_every=8", "trainer.max_steps=" + str(stopped_at + 20),
                                              f"hydra.run.dir={tmp_path / 'run'}", "resume=auto"],
                          cwd=tmp_path, capture_output=True, text=True, env=ENV, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"step {stopped_at}" in done.stdout  # resumed where it stopped
    assert json.loads((tmp_path / "run" / "metrics.json").read_text())["summary"]["steps"] == stopped_at + 20


def test_kill_9_loses_at_most_one_checkpoint_interval(tmp_path):
    p = _train_proc(tmp_path)
    assert _wait_for(lambda: len(ck.checkpoints_in(tmp_path / "run")) >= 2)
    p.kill()  # SIGKILL: no handler runs
    p.communicate(timeout=60)
    newest = ck.newest_valid(tmp_path / "run", log=lambda *_: None)
    at = ck.load(newest)["position"]["step"]
    assert at >= 128  # at least the first whole epoch survived; at most one interval (1 epoch) lost
    done = subprocess.run(_cli("tr-train") + ["data=synthetic", "data.train_size=2048", "data.val_size=64",
                                              "variants.batch_size=16", "trainer.epochs=40",
                                              f"trainer.max_steps={at + 8}", f"hydra.run.dir={tmp_path / 'run'}",
                                              "resume=auto"],
                          cwd=tmp_path, capture_output=True, text=True, env=ENV, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"step {at}" in done.stdout


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(model=st.sampled_from(["resnet_mini", "convnet_mini"]),
       optimizer=st.sampled_from(["sgd", "momentum", "nesterov", "adam", "adamw", "lars"]),
       amp=st.sampled_from([None, "bf16", "fp16"]), ema=st.booleans(), bn_folded=st.booleans(),
       batch=st.integers(2, 8), train=st.integers(8, 40), val=st.integers(2, 20),
       res=st.sampled_from([8, 12, 16]), lowres=st.booleans())
def test_random_small_configurations_plan_and_train(tmp_path, model, optimizer, amp, ema, bn_folded,
                                                    batch, train, val, res, lowres):
    opt = OptimizerSpec(name=optimizer, lr=0.01, momentum=0.0 if optimizer == "sgd" else 0.9,
                        schedule="constant")
    if bn_folded and model == "convnet_mini":
        bn_folded = False  # nothing to fold
    pc = small_config(model=model, optimizer=opt, batch=batch, train_size=max(train, batch), val_size=val,
                      val_batch=4, res=res, val_res=res, lowres_res=8, lowres_epochs=int(lowres), epochs=2,
                      amp=amp is not None, amp_dtype=amp or "bf16", ema=ema, bn_folded=bn_folded,
                      trainer=TrainerSpec(epochs=2, max_steps=2))
    c = compile_plan(pc)
    c.plan.validate()  # all four validations
    own = [t for t in c.plan.dtensors if t.slot_bytes and t.region not in c.plan.shared]
    assert len({t.offset for t in own}) == len(own)  # no two tensors on one slot...
    for t in c.plan.dtensors:  # ...but the 16-bit gradients, each on its own 16-bit weight
        if t.region in c.plan.shared:
            twin = c.plan["amp." + t.name.removeprefix("grad16.")]
            assert (t.offset, t.slot_bytes, twin.region) == (twin.offset, twin.slot_bytes, c.plan.shared[t.region])
    assert bool(c.plan.shared) == (amp is not None)
    tr = Trainer(pc, tmp_path / f"r{np.random.randint(1 << 30)}", log=lambda *_: None, telemetry=False)
    res_ = tr.fit()
    assert res_.steps == 2
    assert all(torch.isfinite(v).all() for k, v in tr.final_state_dict().items() if v.is_floating_point())


def test_soak_1000_steps_with_data_faults(tmp_path):
    """1,000 steps on a folder with corrupt, non-image and truncated files: every bad file is
    replaced each epoch, the counts add up, and no checkpoint is lost."""
    from PIL import Image
    rng = np.random.default_rng(0)
    root = tmp_path / "data"
    files = []
    for split, n in (("train", 20), ("val", 4)):
        for c in range(2):
            d = root / split / f"c{c}"
            d.mkdir(parents=True)
            for i in range(n):
                p = d / f"{i:02d}.jpg"
                Image.fromarray(rng.integers(0, 255, (8, 8, 3), dtype=np.uint8)).save(p)
                files.append(p)
    bad = [root / "train/c0/03.jpg", root / "train/c1/07.jpg", root / "train/c1/11.jpg", root / "train/c0/15.jpg"]
    bad[0].write_bytes(b"\xff\xd8\xff\xe0 corrupt")                  # corrupt JPEG
    bad[1].write_text("not an image at all")                           # not an image
    bad[2].write_bytes(bad[2].read_bytes()[:40])                       # short read (truncated)
    bad[3].write_bytes(bytes(rng.integers(0, 255, 300, dtype=np.uint8)))  # random bytes
    out = subprocess.run(_cli("tr-train") + [
        "data=imagefolder", f"data.root={root}", "data.num_classes=2", "data.skip_corrupt=true",
        "variants.batch_size=4", "variants.val_batch_size=4", "variants.base_res=8", "variants.val_res=8",
        "trainer.epochs=100", "trainer.val_every=25", "trainer.checkpoint_every=10",
        "trainer.keep_checkpoints=3", "trainer.log_every=10", f"hydra.run.dir={tmp_path / 'run'}"],
        cwd=tmp_path, capture_output=True, text=True, env=ENV, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    m = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert m["summary"]["steps"] == 1000 and len(m["history"]) == 100
    import re
    found = sum(int(n) for n in re.findall(r"skipping (\d+) undecodable", out.stdout))
    assert found == 4  # each bad file found once, then replaced without a failed decode
    ckpts = ck.checkpoints_in(tmp_path / "run")
    assert [p.name for p in ckpts] == ["ckpt_e0100_s00001000.pt", "ckpt_e0090_s00000900.pt",
                                       "ckpt_e0080_s00000800.pt"]
    for p in ckpts:
        ck.load(p)  # every kept checkpoint passes its checksum
    assert all(math.isfinite(r["train"]["loss"]) for r in m["history"])
