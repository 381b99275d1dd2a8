"""CUDA input: the mixed (nvJPEG) pipeline and the A/B feeder under captured graphs."""
from __future__ import annotations


import numpy as np
import pytest
import torch

# DALI is a dependency on Linux x86_64; where it is missing these tests are skipped, not failed
pytest.importorskip("nvidia.dali")

from tests.unit.test_data import _dense, folder_config, make_folder
from tr_hydra.data.dali_source import DaliSource
from tr_hydra.train.trainer import Trainer

pytestmark = pytest.mark.cuda


def test_mixed_decode_matches_cpu_pipeline(tmp_path):
    # no resize, no chroma subsampling (libjpeg-turbo's "fancy" 4:2:0 upsampling differs from
    # nvJPEG's): what is left to compare is the two decoders' IDCT rounding
    make_folder(tmp_path, fmt="JPEG", size=16, quality=95, subsampling=0)
    pc = folder_config(tmp_path, res=16, amp=True, amp_dtype="fp16", device="cuda")
    gpu = DaliSource(pc.source_spec(), torch.device("cuda"), torch.float16)
    cpu = DaliSource(pc.source_spec(), torch.device("cpu"), torch.float16)
    g = gpu.batch("train", 0, 4, 4, 16)
    assert "GPU" in type(g.images).__name__
    a = np.array(g.images.as_cpu().as_tensor()).astype(np.float32)
    b = _dense(cpu.batch("train", 0, 4, 4, 16)).astype(np.float32)
    assert a.shape == b.shape == (4, 16, 16, 4)
    # nvJPEG and libjpeg-turbo round the IDCT differently (random-noise JPEGs are the worst case)
    assert np.abs(a - b).mean() < 0.1
    assert np.corrcoef(a[..., :3].ravel(), b[..., :3].ravel())[0, 1] > 0.98


@pytest.mark.parametrize("amp_dtype", ["bf16", "fp16"])
def test_jpeg_training_with_graphs_and_ab_feeder(tmp_path, amp_dtype):
    make_folder(tmp_path, fmt="JPEG", per_class=(6, 5, 5), size=20)
    pc = folder_config(tmp_path, augment=True, amp=True, amp_dtype=amp_dtype, train=16, val=16, batch=4,
                       device="cuda")
    tr = Trainer(pc, tmp_path / "run", log=lambda *_: None)
    res = tr.fit()
    assert tr.graphs is not None
    assert res.epochs[-1]["train"]["count"] == 16 and res.epochs[-1]["val"]["count"] == 16
    assert all(np.isfinite(r["train"]["loss"]) for r in res.epochs)
    # both input buffers hold real images (the feeder alternated A and B)
    for buf in ("A", "B"):
        img, _ = tr.ex.input_views("val_base", buf)
        assert img.float().abs().sum().item() > 0


@pytest.mark.parametrize("decode", ["host", "gpu"])
def test_training_on_shards_with_graphs_equals_the_folder(tmp_path, decode):
    """data=shards on the GPU (captured graphs, A/B feeder), decoded on the host or by nvJPEG:
    images under max_side, so the shards hold the folder's bytes, fed in the folder's order;
    deterministic, the two runs end with the same weights."""
    import dataclasses
    from tr_hydra.config.specs import DataSpec
    from tr_hydra.data.prepare import Settings, prepare
    make_folder(tmp_path / "data", fmt="JPEG", per_class=(6, 5, 5), size=20)
    prepare(DataSpec(name="imagefolder", root=str(tmp_path / "data")), tmp_path / "shards",
            Settings(max_side=32, shard_samples=5), workers=2, skip_corrupt=False, log=lambda *_: None)
    pc = folder_config(tmp_path / "data", augment=True, shuffle=True, amp=True, train=16, val=16, batch=4,
                       device="cuda", decode=decode)
    pc = dataclasses.replace(pc, runtime=dataclasses.replace(pc.runtime, deterministic=True))
    runs = {}
    for name, data in (("folder", pc.data), ("shards", dataclasses.replace(pc.data, name="shards",
                                                                          root=str(tmp_path / "shards")))):
        tr = Trainer(dataclasses.replace(pc, data=data), tmp_path / name, log=lambda *_: None)
        res = tr.fit()
        assert tr.graphs is not None and res.epochs[-1]["train"]["count"] == 16
        runs[name] = tr.final_state_dict()
        tr.close()
    assert all(torch.equal(runs["folder"][k], runs["shards"][k]) for k in runs["folder"])
