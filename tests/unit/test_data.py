"""DALI input on CPU: exact order and values against numpy, sizes, and every bad-input case."""
from __future__ import annotations

import dataclasses
import subprocess
import sys
import threading
import weakref
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from tr_hydra.config.epochs import epoch_schedule
from tr_hydra.config.specs import DataSpec, TrainerSpec
from tr_hydra.data.dali_source import DaliSource, DataError, dali_threads
from tr_hydra.data.index import epoch_order
from tr_hydra.errors import ConfigError
from tr_hydra.train.trainer import Trainer

from tests.helpers import fit_stop_resume, small_config

MEAN, STD = (10.0, 20.0, 30.0), (50.0, 60.0, 70.0)


def _dense(batch) -> np.ndarray:
    return np.array(batch.images.as_tensor())


def make_folder(root: Path, classes=("cat", "dog", "emu"), per_class=(3, 2, 4), size=16, fmt="PNG",
                seed=0, **save_kw) -> dict[str, np.ndarray]:
    """root/train and root/val with random images; returns the pixel arrays by path."""
    rng = np.random.default_rng(seed)
    pixels = {}
    for split in ("train", "val"):
        for c, n in zip(classes, per_class):
            d = root / split / c
            d.mkdir(parents=True, exist_ok=True)
            for i in range(n):
                a = rng.integers(0, 256, (size, size, 3), dtype=np.uint8)
                p = d / f"{i:03d}.{'png' if fmt == 'PNG' else 'jpg'}"
                Image.fromarray(a).save(p, format=fmt, **save_kw)
                pixels[str(p)] = a
    return pixels


def folder_config(root, *, shuffle=False, augment=False, batch=4, res=16, amp=False, amp_dtype="bf16",
                  train=9, val=9, device="cpu", **data_kw):
    pc = small_config(train_size=train, val_size=val, batch=batch, val_batch=batch, res=res,
                      val_res=res, amp=amp, amp_dtype=amp_dtype, num_classes=3, device=device)
    data = DataSpec(name="imagefolder", root=str(root), num_classes=3, mean=MEAN, std=STD, shuffle=shuffle,
                    augment=augment, **data_kw)
    return dataclasses.replace(pc, data=data)


def test_imagefolder_exact_order_and_values(tmp_path):
    pixels = make_folder(tmp_path)
    src = DaliSource(folder_config(tmp_path).source_spec(), torch.device("cpu"), torch.float32)
    paths = src.index["train"].paths
    assert [Path(p).parent.name for p in paths] == ["cat"] * 3 + ["dog"] * 2 + ["emu"] * 4
    b0 = src.batch("train", 0, 4, 4, 16)
    want = np.stack([(pixels[p].astype(np.float32) - MEAN) / STD for p in paths[:4]])
    assert np.abs(_dense(b0) - want).max() < 1e-5  # read before the next batch reuses the buffers
    assert b0.labels.tolist() == [0, 0, 0, 1]
    b2 = src.batch("train", 2, 4, 1, 16)  # the partial last batch: 9 = 4 + 4 + 1
    assert _dense(b2).shape == (1, 16, 16, 3) and b2.labels.tolist() == [2]
    assert np.allclose(_dense(b2)[0], (pixels[paths[8]].astype(np.float32) - MEAN) / STD, atol=1e-5)


def test_fp16_output_is_padded_to_four_channels(tmp_path):
    make_folder(tmp_path, fmt="JPEG")
    src = DaliSource(folder_config(tmp_path, augment=True, amp=True, amp_dtype="fp16").source_spec(),
                     torch.device("cpu"), torch.float16)
    out = _dense(src.batch("train", 0, 4, 4, 12))
    assert out.shape == (4, 12, 12, 4) and out.dtype == np.float16
    assert np.all(out[..., 3] == 0)


def test_arrays_exact_order_and_values(tmp_path):
    rng = np.random.default_rng(1)
    x = rng.integers(0, 256, (10, 16, 16, 3), dtype=np.uint8)
    y = rng.integers(0, 3, 10)
    np.savez(tmp_path / "d.npz", x_train=x, y_train=y, x_val=x[:5], y_val=y[:5])
    pc = folder_config(tmp_path, train=10, val=5)
    pc = dataclasses.replace(pc, data=dataclasses.replace(pc.data, name="arrays", root=None,
                                                          path=str(tmp_path / "d.npz")))
    src = DaliSource(pc.source_spec(), torch.device("cpu"), torch.float32)
    for i, size in ((0, 4), (1, 4), (2, 2)):
        b = src.batch("train", i, 4, size, 16)
        want = (x[i * 4:i * 4 + size].astype(np.float32) - MEAN) / STD
        assert np.allclose(_dense(b), want, atol=1e-5)
        assert b.labels.tolist() == y[i * 4:i * 4 + size].tolist()


def test_shuffle_is_deterministic_and_shards_partition():
    a, b = epoch_order(100, 7, 0, True), epoch_order(100, 7, 0, True)
    assert np.array_equal(a, b) and not np.array_equal(a, epoch_order(100, 7, 1, True))
    assert sorted(a.tolist()) == list(range(100))
    shards = [epoch_order(100, 7, 3, True, s, 3) for s in range(3)]
    assert sorted(np.concatenate(shards).tolist()) == list(range(100))
    assert np.array_equal(epoch_order(5, 7, 0, False), np.arange(5))


def test_lowres_epochs_produce_lowres_images(tmp_path):
    make_folder(tmp_path, fmt="JPEG", size=20)
    src = DaliSource(folder_config(tmp_path, augment=True, res=16).source_spec(), torch.device("cpu"), torch.float32)
    assert _dense(src.batch("train", 0, 4, 4, 12)).shape == (4, 12, 12, 3)
    assert _dense(src.batch("val", 0, 4, 4, 16)).shape == (4, 16, 16, 3)


def test_training_on_imagefolder_sees_every_sample(tmp_path):
    make_folder(tmp_path, fmt="JPEG", per_class=(5, 4, 4))
    pc = dataclasses.replace(folder_config(tmp_path, augment=True, train=13, val=13, batch=4),
                             lowres_epochs=1)
    pc = dataclasses.replace(pc, variants=small_config(train_size=13, val_size=13, batch=4, val_batch=4,
                                                      res=16, lowres_epochs=1, num_classes=3).variants)
    tr = Trainer(pc, tmp_path / "run", log=lambda *_: None)
    res = tr.fit()
    assert res.epochs[0]["train"]["count"] == 13  # the last batch of 1 is trained, not dropped
    assert res.epochs[0]["val"]["count"] == 13
    assert {v for v, _, _ in epoch_schedule(pc, 0)} == {"train_lowres", "train_lowres_last"}


def test_digits_builds_a_fixed_split(tmp_path):
    from tr_hydra.data.digits import ensure_digits
    root = ensure_digits(tmp_path)
    n_train = sum(1 for _ in (root / "train").rglob("*.jpg"))
    n_val = sum(1 for _ in (root / "val").rglob("*.jpg"))
    assert (n_train, n_val) == (1437, 360)
    assert sorted(p.name for p in (root / "train").iterdir()) == [str(i) for i in range(10)]
    first = sorted((root / "train" / "3").iterdir())[0].name
    assert ensure_digits(tmp_path) == root and sorted((root / "train" / "3").iterdir())[0].name == first
    img = Image.open(next((root / "val").rglob("*.jpg")))
    assert img.size == (32, 32) and img.mode == "RGB"


# ---------------------------------------------------------------------- bad input
def test_missing_root_and_split(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        DaliSource(folder_config(tmp_path / "nope").source_spec(), torch.device("cpu"), torch.float32)
    (tmp_path / "train" / "a").mkdir(parents=True)
    with pytest.raises(ConfigError, match="holds no images"):
        DaliSource(folder_config(tmp_path).source_spec(), torch.device("cpu"), torch.float32)


def test_empty_class_folder_is_named(tmp_path):
    make_folder(tmp_path)
    (tmp_path / "val" / "dog").rename(tmp_path / "val" / "dog_old")
    (tmp_path / "val" / "dog").mkdir()
    with pytest.raises(ConfigError, match=r"val/dog holds no images"):
        DaliSource(folder_config(tmp_path).source_spec(), torch.device("cpu"), torch.float32)


@pytest.mark.parametrize("fault", ["truncated", "not_an_image"])
def test_corrupt_image_is_named_or_skipped(tmp_path, fault):
    make_folder(tmp_path, fmt="JPEG")
    bad = tmp_path / "train" / "dog" / "001.jpg"
    if fault == "truncated":
        bad.write_bytes(bad.read_bytes()[:60])
    else:
        bad.write_text("this is a text file, not a picture\n")
    src = DaliSource(folder_config(tmp_path).source_spec(), torch.device("cpu"), torch.float32)
    with pytest.raises(DataError, match=r"cannot decode .*dog/001\.jpg.*skip_corrupt"):
        src.batch("train", 1, 4, 4, 16)  # samples 4..7: cat/002, dog/000, dog/001, emu/000
    src = DaliSource(folder_config(tmp_path, skip_corrupt=True).source_spec(), torch.device("cpu"), torch.float32,
                     log=lambda *_: None)
    b = src.batch("train", 1, 4, 4, 16)
    assert _dense(b).shape == (4, 16, 16, 3) and src.skipped == 1
    src.batch("train", 1, 4, 4, 16)  # known bad now: replaced without a failed decode
    assert src.skipped == 2


@pytest.mark.parametrize("case,needle", [
    ("missing_key", "has no array 'y_val'"),
    ("dtype", "x_train must be uint8"),
    ("shape", "x_train must be uint8 of shape"),
    ("labels", "y_train has labels outside [0, 3)"),
    ("label_len", "y_train must be integer of shape"),
    ("objects", "holds an object array (key 'x_train'): write plain numeric arrays"),
])
def test_bad_npz(tmp_path, case, needle):
    x = np.zeros((4, 8, 8, 3), np.uint8)
    y = np.array([0, 1, 2, 0])
    arrays = dict(x_train=x, y_train=y, x_val=x, y_val=y)
    if case == "missing_key":
        del arrays["y_val"]
    elif case == "dtype":
        arrays["x_train"] = x.astype(np.float32)
    elif case == "shape":
        arrays["x_train"] = x[..., 0]
    elif case == "labels":
        arrays["y_train"] = np.array([0, 1, 2, 3])
    elif case == "label_len":
        arrays["y_train"] = y[:3]
    elif case == "objects":  # pickled by np.savez, refused by np.load(allow_pickle=False)
        arrays["x_train"] = np.array([x[0], "text", None, 1], dtype=object)
    np.savez(tmp_path / "d.npz", **arrays)
    pc = folder_config(tmp_path, train=4, val=4)
    pc = dataclasses.replace(pc, data=dataclasses.replace(pc.data, name="arrays", root=None,
                                                          path=str(tmp_path / "d.npz")))
    with pytest.raises(ConfigError) as e:
        DaliSource(pc.source_spec(), torch.device("cpu"), torch.float32)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_smaller_train_size_takes_a_spread_over_classes(tmp_path):
    make_folder(tmp_path, per_class=(4, 4, 4))
    pc = folder_config(tmp_path, train=6, val=12)
    src = DaliSource(pc.source_spec(), torch.device("cpu"), torch.float32)
    assert len(src.index["train"]) == 6 and len(set(src.index["train"].labels.tolist())) >= 2
    assert src.index["train"].paths == sorted(src.index["train"].paths)
    with pytest.raises(ConfigError, match="expects 13 val samples"):
        DaliSource(folder_config(tmp_path, train=6, val=13).source_spec(), torch.device("cpu"), torch.float32)


def _retired():
    for t in threading.enumerate():  # replaced streams are dropped on a background thread
        if t.name == "tr_hydra-dali-retire":
            t.join()


def test_stream_batches_equal_the_synchronous_decode_in_order(tmp_path):
    """The batches come from one asynchronous stream (DALI reading the files, decoding ahead),
    the partial last batch and the next epoch's first batches included; they are exactly the
    epoch's order and equal the synchronous decode. A request out of sequence (a resumed
    position) starts a new stream there."""
    make_folder(tmp_path, fmt="JPEG", per_class=(5, 4, 4))
    pc = dataclasses.replace(folder_config(tmp_path, shuffle=True, train=13, val=13), trainer=TrainerSpec(epochs=2))
    src = DaliSource(pc.source_spec(), torch.device("cpu"), torch.float32)
    ref = DaliSource(pc.source_spec(), torch.device("cpu"), torch.float32)
    stream = None
    for epoch in (0, 1):
        order = src.order("train", epoch)
        for i, size in ((0, 4), (1, 4), (2, 4), (3, 1)):
            got = src.batch("train", i, 4, size, 16, epoch=epoch)
            want = ref._decode("train", i, 4, size, 16, epoch)
            assert np.array_equal(_dense(got), _dense(want))
            assert got.labels.tolist() == ref.index["train"].labels[order[i * 4:i * 4 + size]].tolist()
            stream = stream or src._streams["train"]
            assert src._streams["train"] is stream  # one stream for both epochs
            if (epoch, i) == (0, 3):  # the epoch's end: the next epoch's first batches are decoding
                assert [f[0] for f in stream.fed] == [(1, 0)]
    assert src.ahead_used == 1
    assert stream.peek() is None and not stream.fed  # nothing decoding past the last epoch
    first = weakref.ref(stream)
    del stream
    b = src.batch("train", 2, 4, 4, 16, epoch=1)  # out of sequence: a new stream from batch 2
    assert src._streams["train"] is not first() and src._streams["train"].peek() == (1, 3)
    assert np.array_equal(_dense(b), _dense(ref._decode("train", 2, 4, 4, 16, 1)))
    _retired()
    assert first() is None
    # validation passes repeat: the stream wraps (the partial batch included) and keeps decoding
    # ahead across the wrap
    for i in (0, 1, 2, 3, 0, 1, 2, 3, 0):
        size = 1 if i == 3 else 4
        got = src.batch("val", i, 4, size, 16)
        assert np.array_equal(_dense(got), _dense(ref._decode("val", i, 4, size, 16)))
        assert len(src._streams["val"].fed) >= 1


def _draw(src, plan):
    return [_dense(src.batch("train", i, 4, size, res, epoch=e)).copy() for e, i, size, res in plan]


def _plan(pc, epochs):
    from tr_hydra.config.epochs import epoch_schedule
    return [(e, i, size, pc.variant(v).res) for e in epochs for v, i, size in epoch_schedule(pc, e)]


@pytest.mark.parametrize("stop", ["epoch_end", "mid_epoch"])
def test_resumed_stream_draws_the_same_crops(tmp_path, stop):
    """Augmentation draws come from the stream's generators, which run on across epochs; a
    source restored from ``state()`` (through a checkpoint file) draws exactly the crops and
    flips of a run that never stopped, at an epoch end and mid-epoch (a stopped run has taken
    the batch after its last step). Without the state the crops differ."""
    make_folder(tmp_path, fmt="JPEG", per_class=(5, 4, 4), size=24)
    pc = dataclasses.replace(folder_config(tmp_path, shuffle=True, augment=True, train=13, val=13),
                             trainer=TrainerSpec(epochs=3))
    plan = _plan(pc, (0, 1, 2))
    full = _draw(DaliSource(pc.source_spec(), torch.device("cpu"), torch.float32), plan)
    cut = 4 if stop == "epoch_end" else 6          # the first batch the resumed run asks for
    taken = cut if stop == "epoch_end" else cut + 1  # what the stopped run took from its stream
    first = DaliSource(pc.source_spec(), torch.device("cpu"), torch.float32)
    assert all(np.array_equal(a, b) for a, b in zip(_draw(first, plan[:taken]), full))
    torch.save({"data": [first.state()]}, tmp_path / "ck.pt")
    state = torch.load(tmp_path / "ck.pt", weights_only=True)["data"][0]
    again = DaliSource(pc.source_spec(), torch.device("cpu"), torch.float32)
    again.restore(state)
    rest = _draw(again, plan[cut:])
    assert all(np.array_equal(a, b) for a, b in zip(rest, full[cut:]))
    fresh = DaliSource(pc.source_spec(), torch.device("cpu"), torch.float32)
    assert not all(np.array_equal(a, b) for a, b in zip(_draw(fresh, plan[cut:]), full[cut:]))


def test_stream_stops_at_a_change_of_resolution(tmp_path):
    """Low-resolution epochs, then full resolution: the low-resolution stream decodes nothing
    past its last epoch; the full-resolution one starts at the switch and equals the synchronous
    decode."""
    make_folder(tmp_path, fmt="JPEG", per_class=(5, 4, 4), size=20)
    pc = dataclasses.replace(folder_config(tmp_path, train=13, val=13), lowres_epochs=1, trainer=TrainerSpec(epochs=2))
    pc = dataclasses.replace(pc, variants=small_config(train_size=13, val_size=13, batch=4, val_batch=4, res=16,
                                                      lowres_epochs=1, num_classes=3).variants)
    src = DaliSource(pc.source_spec(), torch.device("cpu"), torch.float32)
    ref = DaliSource(pc.source_spec(), torch.device("cpu"), torch.float32)
    plan = _plan(pc, (0, 1))
    assert {p[3] for p in plan[:4]} == {12} and {p[3] for p in plan[4:]} == {16}
    for e, i, size, res in plan:
        got = src.batch("train", i, 4, size, res, epoch=e)
        assert np.array_equal(_dense(got), _dense(ref._decode("train", i, 4, size, res, e)))
        if (e, i) == (0, 3):
            low = src._streams["train"]
            assert low.peek() is None and not low.fed
    assert src._streams["train"].key == (16, 4) and src.ahead_used == 0


def test_dali_threads_auto_shares_the_cores_among_local_ranks(monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert dali_threads(3) == 3
    assert dali_threads("auto", 1, cpus=16) == 16
    assert dali_threads("auto", 2, cpus=16) == 8
    assert dali_threads("auto", 4, cpus=2) == 1
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # torchrun's figure wins over the fallback
    assert dali_threads("auto", 8, cpus=16) == 4


def test_training_resumed_mid_epoch_on_jpegs_is_exact(tmp_path):
    """Augmented JPEG training, 3 epochs in one run == stopped mid-epoch (max_steps), resumed,
    finished: identical weights, since the checkpoint carries the input stream's state."""
    import json
    make_folder(tmp_path / "data", fmt="JPEG", per_class=(5, 4, 4), size=20)
    base = folder_config(tmp_path / "data", shuffle=True, augment=True, train=13, val=13)
    base = dataclasses.replace(base, runtime=dataclasses.replace(base.runtime, deterministic=True))
    full, resumed, at_stop = fit_stop_resume(base, tmp_path, 6, epochs=3, log_every=1)
    assert at_stop[0] == "ckpt_e0001_s00000006.pt"  # epoch 2, batch 2 next
    a, b = full.final_state_dict(), resumed.final_state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    ha = json.loads((tmp_path / "a" / "metrics.json").read_text())["history"]
    hb = json.loads((tmp_path / "b" / "metrics.json").read_text())["history"]
    assert ha[-1]["val"] == hb[-1]["val"]


def test_checkpoint_is_written_when_the_input_state_cannot_be_read(tmp_path, monkeypatch):
    """A source whose state fails (its pipeline broken by the error that stops the run) still
    gets the checkpoint written, without the input state, and says so."""
    from tr_hydra.train import checkpoint as ck
    make_folder(tmp_path / "data", fmt="JPEG", per_class=(5, 4, 4), size=20)
    pc = folder_config(tmp_path / "data", augment=True, train=13, val=13)
    notes = []
    tr = Trainer(dataclasses.replace(pc, trainer=TrainerSpec(epochs=1)), tmp_path / "run", log=notes.append)
    tr.fit()
    good = ck.load(ck.checkpoints_in(tmp_path / "run")[0])
    assert good["extra"]["data"][0]["res"] == 16
    def broken():
        raise RuntimeError("Critical error in pipeline: decoder gone")
    monkeypatch.setattr(tr.source, "state", broken)
    path = tr.checkpointer.save(1, 99, [])
    assert "extra" in ck.load(path) and "data" not in ck.load(path)["extra"]
    assert any("the input state is not saved (Critical error in pipeline" in n for n in notes)


@pytest.mark.parametrize("load", [None, 0.9])
def test_hw_decoder_load_reaches_the_gpu_decoder(tmp_path, monkeypatch, load):
    """``data.hw_decoder_load`` goes to the mixed (GPU) JPEG decoder when set; unset, DALI's own
    default stands. (The graph is defined, not built: no GPU here.)"""
    from nvidia.dali import fn
    make_folder(tmp_path, fmt="JPEG")
    src = DaliSource(folder_config(tmp_path, hw_decoder_load=load).source_spec(), torch.device("cuda"), torch.float16)
    seen = {}

    class Defined(Exception):
        pass

    def decoder(*args, **kw):
        seen.update(kw)
        raise Defined
    monkeypatch.setattr(fn.decoders, "image", decoder)
    with pytest.raises(Defined):
        src._build("train", 16, 4, stream=True)
    assert seen["device"] == "mixed"
    assert seen.get("hw_decoder_load") == load and ("hw_decoder_load" in seen) == (load is not None)


@pytest.mark.parametrize("name,decode,threads,host", [
    ("shards", "auto", 16, True), ("shards", "auto", 12, True), ("shards", "auto", 11, False),
    ("imagefolder", "auto", 64, False), ("shards", "gpu", 16, False), ("imagefolder", "host", 2, True)])
def test_data_decode_picks_where_jpegs_are_decoded(name, decode, threads, host):
    """``data.decode=auto``: tr-prepare's small JPEGs on the host where the rank has 12 threads
    or more, full-size folders on the GPU; ``host``/``gpu`` as asked; a CPU run decodes on the
    host whatever it says."""
    from tr_hydra.data.dali_source import decodes_on_host
    d = DataSpec(name=name, decode=decode)
    assert decodes_on_host(d, True, threads) is host
    assert decodes_on_host(d, False, threads) is True


@pytest.mark.parametrize("decode,augment", [("host", True), ("host", False), ("gpu", True), ("gpu", False)])
def test_host_decode_hands_the_gpu_only_the_normalisation(tmp_path, monkeypatch, decode, augment):
    """A CUDA run with ``data.decode=host`` decodes and resizes on DALI's CPU operators and moves
    the result to the GPU for the crop, flip and normalisation; with ``gpu`` the decoder is
    nvJPEG's mixed one. (The graph is defined, not built: no GPU here.)"""
    from nvidia.dali import fn
    make_folder(tmp_path, fmt="JPEG")
    src = DaliSource(folder_config(tmp_path, decode=decode, augment=augment).source_spec(), torch.device("cuda"),
                     torch.float16)
    seen = {}

    class Defined(Exception):
        pass
    decoder = fn.decoders.image_random_crop if augment else fn.decoders.image

    def spy(*args, **kw):
        seen["decoder"] = kw["device"]
        return decoder(*args, **kw)

    def normalise(img, **kw):
        seen["normalised_on"] = img.device
        raise Defined
    monkeypatch.setattr(fn.decoders, "image_random_crop" if augment else "image", spy)
    monkeypatch.setattr(fn, "crop_mirror_normalize", normalise)
    with pytest.raises(Defined):
        src._build("train", 16, 4, stream=True)
    assert seen == {"decoder": "cpu" if decode == "host" else "mixed", "normalised_on": "gpu"}


def test_a_checkpoint_decoded_elsewhere_is_refused_on_resume(tmp_path):
    """The input state a checkpoint keeps says where its JPEGs were decoded; a resume that would
    decode them elsewhere (other pixels, other crops) is one line naming data.decode. A
    checkpoint from before the key was kept decoded with nvJPEG on CUDA, on the host on the CPU."""
    make_folder(tmp_path, fmt="JPEG")
    cpu = DaliSource(folder_config(tmp_path, augment=True).source_spec(), torch.device("cpu"), torch.float32)
    cpu.batch("train", 0, 4, 4, 16)
    state = cpu.state()
    assert state["decode"] == "host"
    cpu.restore(state)
    cpu.restore({k: v for k, v in state.items() if k != "decode"})
    with pytest.raises(ConfigError, match="decoded its JPEGs on the GPU; resume on a GPU to draw"):
        cpu.restore(dict(state, decode="gpu"))
    for decode, old_ok in (("gpu", True), ("host", False)):  # defined on "cuda", not built: no GPU here
        src = DaliSource(folder_config(tmp_path, augment=True, decode=decode).source_spec(), torch.device("cuda"),
                         torch.float16)
        src.restore(dict(state, decode=decode))
        if old_ok:
            src.restore({k: v for k, v in state.items() if k != "decode"})
        else:
            with pytest.raises(ConfigError, match="data.decode=gpu"):
                src.restore({k: v for k, v in state.items() if k != "decode"})


def test_synthetic_bank_in_the_input_buffer_layout_is_one_plain_copy(tmp_path):
    """With channel_pad (what the trainer passes on CUDA) the bank has the input buffer's padded
    channels, zero beyond the image's, so the feeder's copy is contiguous on both sides; the model
    sees the same images as from an unpadded bank."""
    import torch

    from tr_hydra.data.synthetic import SyntheticSource
    from tr_hydra.train.trainer import Trainer
    from tests.helpers import small_config
    tr = Trainer(small_config(amp=True, res=16), tmp_path, log=lambda *_: None)
    cp = tr.compiled.plan["input_A.data"].strides[2]
    assert cp == 4  # 16-bit input buffers pad 3 channels to 4
    args = (10, 3, 7, "cpu", torch.bfloat16, 64, 32)
    plain, padded = SyntheticSource(*args), SyntheticSource(*args, channel_pad=cp)
    x, y = plain.batch("train", 1, 32, 32, 16)
    xp, yp = padded.batch("train", 1, 32, 32, 16)
    assert xp.shape == (32, 16, 16, 4) and xp.is_contiguous()
    assert torch.equal(xp[..., :3], x) and not xp[..., 3:].any() and torch.equal(yp, y)
    tr.feeder.put("B", "train_base", (xp, yp))
    img, lab = tr.ex.input_views("train_base", "B")
    assert img.shape == (32, 16, 16, 3) and torch.equal(img, x) and torch.equal(lab, y)


def test_bf16_runs_keep_dalis_fp16_in_the_input_buffer(tmp_path):
    """DALI has no bf16: under bf16 compute the input buffer holds DALI's fp16 as delivered (the
    bytes of the decode, no staging buffer, no cast pass), and the model under autocast sees the
    same values a cast to bf16 on the copy gave: the logits are equal. Training runs on it."""
    from tr_hydra.train.trainer import Trainer
    pixels = make_folder(tmp_path, size=16)
    pc = folder_config(tmp_path, amp=True, amp_dtype="bf16")
    tr = Trainer(dataclasses.replace(pc, trainer=TrainerSpec(epochs=1)), tmp_path / "run", log=lambda *_: None)
    assert tr.ex.input_dtype == torch.float16
    assert not hasattr(tr.feeder, "_staging")
    batch = tr.source.batch("train", 0, 4, 4, 16)
    dense = _dense(batch)
    assert dense.dtype == np.float16
    tr.feeder.put("B", "train_base", batch)
    img, lab = tr.ex.input_views("train_base", "B")
    assert img.dtype == torch.float16
    assert torch.equal(img, torch.from_numpy(dense[..., :3]))  # the decode's bits
    paths = tr.source.index["train"].paths
    want = np.stack([(pixels[p].astype(np.float32) - MEAN) / STD for p in paths[:4]])
    assert np.abs(img.float().numpy() - want).max() < 2e-2  # fp16 of the normalised pixels
    x = img.permute(0, 3, 1, 2)
    with torch.no_grad(), tr.ex._autocast():
        got = tr.ex.forwards.traced(x)
        ref = tr.ex.forwards.traced(x.to(torch.bfloat16))
    assert torch.equal(got, ref)
    result = tr.fit()
    assert result.steps == 3 and all(np.isfinite(e["train"]["loss"]) and np.isfinite(e["val"]["loss"])
                                     for e in result.epochs), result.epochs
    # fp16 compute and synthetic data keep the compute dtype in the buffer
    from tr_hydra.runtime.executor import input_dtype
    assert input_dtype(dataclasses.replace(pc, amp_dtype="fp16"), torch.float16) is None
    assert input_dtype(small_config(amp=True), torch.bfloat16) is None
    assert input_dtype(dataclasses.replace(pc, amp=False), torch.bfloat16) is None


def test_synthetic_banks_built_ahead_hold_the_same_values_and_are_not_made_twice(monkeypatch, tmp_path):
    """build_ahead makes the banks on a thread (while the steps compile); the batches are the
    same bit for bit as banks made at first use, and a bank made ahead is not made again."""
    import time
    from tr_hydra.data import synthetic
    keys = [("train", 16, 8), ("val", 12, 6)]
    inline = synthetic.SyntheticSource(10, 3, 5, "cpu", torch.bfloat16, 40, 20, channel_pad=4)
    ahead = synthetic.SyntheticSource(10, 3, 5, "cpu", torch.bfloat16, 40, 20, channel_pad=4)
    made = []
    real = synthetic.SyntheticSource._make

    def slow_make(self, *key):
        made.append((self is ahead, key))
        time.sleep(0.2)  # the first batch() below comes while the thread is still making
        return real(self, *key)
    monkeypatch.setattr(synthetic.SyntheticSource, "_make", slow_make)
    ahead.build_ahead(keys + keys)
    for split, res, batch in keys:
        for i in range(3):
            a = ahead.batch(split, i, batch, batch, res)
            b = inline.batch(split, i, batch, batch, res)
            assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert [k for mine, k in made if mine] == keys  # each once, on the thread
    assert not ahead._thread.is_alive()
    # the trainer asks for every variant's bank ahead, keyed as its steps will ask
    from tr_hydra.train.trainer import Trainer
    monkeypatch.setattr(synthetic.SyntheticSource, "_make", real)
    pc = small_config(train_size=200, batch=32, val_size=64, val_batch=32, lowres_epochs=1, res=16, lowres_res=12)
    tr = Trainer(pc, tmp_path, log=lambda *_: None, telemetry=False)
    assert sorted(tr.source._ahead) == [("train", 12, 32), ("train", 16, 32), ("val", 16, 32)]


def test_a_process_that_exits_while_banks_are_made_ahead_exits_cleanly():
    """The thread making synthetic banks runs torch ops; a process leaving while it runs (a run
    that fails just after building its trainer) must end with its own exit code, not abort
    in PyTorch's teardown ("terminate called without an active exception", status 134)."""
    code = ("import sys, torch\n"
            "from tr_hydra.data.synthetic import SyntheticSource\n"
            "src = SyntheticSource(10, 3, 0, torch.device('cpu'), torch.float32, 4096, 64)\n"
            "src.build_ahead([('train', 160, 256), ('train', 192, 256), ('train', 224, 256)])\n"
            "assert src._thread.is_alive()\n"
            "sys.exit(3)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 3, (r.returncode, r.stderr[-2000:])
    assert "terminate called" not in r.stderr


def test_closing_a_source_stops_its_banks_ahead_after_the_one_in_progress(monkeypatch):
    """close(): the thread ends after the bank it is making; the others are made at first use,
    with the same values."""
    import time
    from tr_hydra.data import synthetic
    keys = [("train", 16, 8), ("train", 12, 8), ("val", 12, 6)]
    real = synthetic.SyntheticSource._make
    started = threading.Event()

    def slow_make(self, *key):
        started.set()
        time.sleep(0.3)
        return real(self, *key)
    monkeypatch.setattr(synthetic.SyntheticSource, "_make", slow_make)
    src = synthetic.SyntheticSource(10, 3, 5, "cpu", torch.float32, 40, 20)
    src.build_ahead(keys)
    assert started.wait(10)
    src.close()
    assert not src._thread.is_alive() and src not in synthetic._AHEAD
    assert len(src._made) == 1 and all(src._ahead[k].is_set() for k in keys)
    monkeypatch.setattr(synthetic.SyntheticSource, "_make", real)
    ref = synthetic.SyntheticSource(10, 3, 5, "cpu", torch.float32, 40, 20)
    for split, res, batch in keys:
        a, b = src.batch(split, 1, batch, batch, res), ref.batch(split, 1, batch, batch, res)
        assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_file_reads_are_plain_not_mapped(tmp_path):
    """DALI's file read gets ``dont_use_mmap``: plain reads, measured faster than mapping each
    file (the values: ``test_imagefolder_exact_order_and_values``)."""
    from nvidia.dali import fn
    make_folder(tmp_path)
    src = DaliSource(folder_config(tmp_path).source_spec(), torch.device("cpu"), torch.float32)
    seen = {}
    real = fn.io.file.read

    def read(*args, **kw):
        seen.update(kw)
        return real(*args, **kw)
    monkeypatch = pytest.MonkeyPatch()
    with monkeypatch.context() as mp:
        mp.setattr(fn.io.file, "read", read)
        seen.clear()
        src._build("train", 16, 4, stream=False)
    assert seen["dont_use_mmap"] is True
