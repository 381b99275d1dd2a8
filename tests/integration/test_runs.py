"""Runs people can trust: TensorBoard, checkpoints and exact resume, reruns, sweeps, recipes."""
from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from tr_hydra.config.specs import TrainerSpec
from tr_hydra.train import checkpoint as ck
from tr_hydra.train.trainer import Trainer

from tests.helpers import fit_stop_resume, small_config
from tests.integration.test_cli import run


def _det(pc):
    return dataclasses.replace(pc, runtime=dataclasses.replace(pc.runtime, deterministic=True))


def _strip(history):
    return [{k: v for k, v in r.items() if k != "img_per_sec"} for r in history]


def test_tensorboard_tags_present_and_finite(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    pc = small_config(epochs=2, ema=True, amp=True, amp_dtype="fp16", train_size=64, batch=16,
                      res=8, val_res=8, lowres_res=8, optimizer=small_config().optimizer.__class__(name="adam", lr=1e-3),
                      trainer=TrainerSpec(epochs=2, log_every=2))
    Trainer(pc, tmp_path, log=lambda *_: None).fit()
    ea = EventAccumulator(str(tmp_path / "tb"), size_guidance={"scalars": 0, "images": 0, "tensors": 0})
    ea.Reload()
    scalars = set(ea.Tags()["scalars"])
    want = {"train/loss", "train/top1", "train/top5", "val/loss", "val/top1", "val/top5",
            "val_ema/loss", "val_ema/top1", "val_ema/top5", "lr", "img_per_sec", "step_time_ms",
            "data_wait_ms", "loss_scale", "skipped_steps", "norms/W", "norms/G", "norms/M",
            "norms/V", "norms/E", "series/fraction/W", "series/bytes/G", "arena/total_bytes",
            "regions/bytes/008_W_BN_WEIGHT"}
    assert want <= scalars, want - scalars
    for tag in scalars:
        assert all(math.isfinite(e.value) for e in ea.Scalars(tag)), tag
    assert len(ea.Scalars("train/loss")) == 4  # every log interval: 2 per epoch
    assert "arena/memory_map" in ea.Tags()["images"]
    assert any("region_table" in t for t in ea.Tags()["tensors"])
    # the config as hparams, with the final metrics, in the run dir
    hp = [p for p in (tmp_path / "tb").rglob("events.out.tfevents*")]
    assert hp


def test_resume_is_exact(tmp_path):
    """4 epochs in one run == 2 epochs, stop, resume, 2 more: weights and logged metrics."""
    base = _det(small_config(train_size=96, batch=32, lowres_epochs=1, ema=True))
    full, resumed, at_stop = fit_stop_resume(base, tmp_path, 6, epochs=4)
    assert at_stop == ["ckpt_e0002_s00000006.pt", "ckpt_e0001_s00000003.pt"]
    a, b = full.final_state_dict(), resumed.final_state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    ha = json.loads((tmp_path / "a" / "metrics.json").read_text())["history"]
    hb = json.loads((tmp_path / "b" / "metrics.json").read_text())["history"]
    assert _strip(ha) == _strip(hb) and len(hb) == 4


def test_crash_while_writing_keeps_previous_checkpoint(tmp_path, monkeypatch):
    pc = small_config(train_size=64, batch=32)
    tr = Trainer(dataclasses.replace(pc, trainer=TrainerSpec(epochs=1)), tmp_path, log=lambda *_: None)
    tr.fit()
    first = ck.checkpoints_in(tmp_path)[0]
    def crash(*a, **k):
        raise KeyboardInterrupt("killed before the rename")
    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(KeyboardInterrupt):
        tr.checkpointer.save(2, 4, [])
    monkeypatch.undo()
    assert ck.checkpoints_in(tmp_path) == [first]  # the half-written file is only a .tmp
    assert ck.newest_valid(tmp_path, log=lambda *_: None) == first
    # a truncated newer file (a kill -9 on a filesystem without atomic rename) is skipped
    newer = first.with_name("ckpt_e0009_s00000099.pt")
    newer.write_bytes(first.read_bytes()[: first.stat().st_size // 2])
    notes = []
    assert ck.newest_valid(tmp_path, log=notes.append) == first
    assert "truncated or corrupt" in notes[0]


def test_incompatible_checkpoint_is_refused_naming_the_difference(tmp_path):
    pc = small_config(train_size=64, batch=32)
    tr = Trainer(dataclasses.replace(pc, trainer=TrainerSpec(epochs=1)), tmp_path / "a", log=lambda *_: None)
    tr.fit()
    path = ck.checkpoints_in(tmp_path / "a")[0]
    other = dataclasses.replace(pc, amp=True, resume=str(path))
    with pytest.raises(ck.CheckpointError, match=r"precision 'fp32' vs 'bf16'.*region A_FC_WEIGHT"):
        Trainer(other, tmp_path / "b", log=lambda *_: None).fit()


def test_keep_last_k_and_loading_runs_no_code(tmp_path):
    pc = small_config(train_size=64, batch=32)
    tr = Trainer(dataclasses.replace(pc, trainer=TrainerSpec(epochs=4, keep_checkpoints=2)), tmp_path,
                 log=lambda *_: None)
    tr.fit()
    assert len(ck.checkpoints_in(tmp_path)) == 2
    state = ck.load(ck.checkpoints_in(tmp_path)[0])  # weights_only: plain tensors and values
    assert state["position"] == {"epoch": 4, "step": 8}


def test_rerun_from_saved_config_is_exact(tmp_path):
    args = ["recipe=cpu_smoke", "runtime.deterministic=true", "data.train_size=128", "data.val_size=64"]
    out = run("tr-train", *args, f"hydra.run.dir={tmp_path / 'orig'}", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-1500:]
    out = run("tr-train", "--rerun", str(tmp_path / "orig"), f"hydra.run.dir={tmp_path / 'again'}", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-1500:]
    a = json.loads((tmp_path / "orig" / "metrics.json").read_text())["history"]
    b = json.loads((tmp_path / "again" / "metrics.json").read_text())["history"]
    assert _strip(a) == _strip(b)
    # without a run dir of its own, a rerun lands in a new one (Hydra's outputs/<date>/<time>
    # under its working directory), not in the run it replays
    before = (tmp_path / "again" / "metrics.json").read_bytes()
    out = run("tr-train", "--rerun", str(tmp_path / "again"), "trainer.epochs=1", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-1500:]
    assert (tmp_path / "again" / "metrics.json").read_bytes() == before
    assert len(list((tmp_path / "outputs").glob("*/*/metrics.json"))) == 1


def test_multirun_sweep_prints_summary(tmp_path):
    out = run("tr-train", "-m", "optimizer=sgd,lars", "amp=false,true", "recipe=cpu_smoke",
              "data.train_size=128", "data.val_size=64", f"hydra.sweep.dir={tmp_path / 'sweep'}", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-1500:]
    assert "sweep summary" in out.stdout
    table = (tmp_path / "sweep" / "summary.txt").read_text().splitlines()
    assert len(table) == 6  # the fixed overrides, the header, 4 runs
    assert table[0] == "fixed: recipe=cpu_smoke data.train_size=128 data.val_size=64"
    assert table[1].split()[:3] == ["job", "optimizer", "amp"]
    assert [r.split()[1:3] for r in table[2:]] == [["sgd", "False"], ["sgd", "True"], ["lars", "False"], ["lars", "True"]]  # as Hydra saved them
    for job in range(4):
        assert (tmp_path / "sweep" / str(job) / "tb").is_dir()
        assert (tmp_path / "sweep" / str(job) / "model_final.pt").is_file()


def _tiny_imagefolder(root: Path, classes=3, per_class=3, size=40):
    from PIL import Image
    rng = np.random.default_rng(0)
    for split in ("train", "val"):
        for c in range(classes):
            d = root / split / f"c{c}"
            d.mkdir(parents=True, exist_ok=True)
            for i in range(per_class):
                Image.fromarray(rng.integers(0, 255, (size, size, 3), dtype=np.uint8)).save(d / f"{i}.jpg")


@pytest.mark.parametrize("recipe", ["resnet50_imagenet_mlperf", "resnet50_imagenet_ffcv", "cifar_resnet18", "cpu_smoke"])
def test_recipes_compose_and_run(tmp_path, recipe):
    small = ["variants.batch_size=3", "variants.val_batch_size=3", "variants.base_res=32",
             "variants.lowres_res=24", "variants.val_res=32", "trainer.max_steps=2", "trainer.epochs=2"]
    if recipe.startswith("resnet50"):
        _tiny_imagefolder(tmp_path / "data")
        small += [f"data.root={tmp_path / 'data'}", "data.num_classes=3", "variants.lowres_epochs=1"]
    elif recipe == "cifar_resnet18":
        rng = np.random.default_rng(0)
        x = rng.integers(0, 255, (9, 32, 32, 3), dtype=np.uint8)
        y = rng.integers(0, 10, 9)
        np.savez(tmp_path / "c.npz", x_train=x, y_train=y, x_val=x, y_val=y)
        small += [f"data.path={tmp_path / 'c.npz'}"]
    else:
        small = ["trainer.max_steps=2"]
    out = run("tr-train", f"recipe={recipe}", *small, f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert (tmp_path / "run" / "model_final.pt").is_file()
