"""runtime.cudnn_benchmark_limit: how many cuDNN algorithms cudnn.benchmark times per
convolution shape; set for the trainer, and by tr-bench for its PyTorch modes alike."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from tests.helpers import small_config
from tr_hydra.cli._common import compose
from tr_hydra.config.plan_config import plan_config_from
from tr_hydra.errors import ConfigError
from tr_hydra.runtime import runner


@pytest.fixture
def restore_limit():
    before = torch.backends.cudnn.benchmark_limit
    yield
    torch.backends.cudnn.benchmark_limit = before


def test_the_limit_is_checked():
    assert plan_config_from(compose([])).runtime.cudnn_benchmark_limit is None
    assert plan_config_from(compose(["runtime.cudnn_benchmark_limit=0"])).runtime.cudnn_benchmark_limit == 0
    assert plan_config_from(compose(["runtime.cudnn_benchmark_limit=25"])).runtime.cudnn_benchmark_limit == 25
    with pytest.raises(ConfigError, match=r"runtime.cudnn_benchmark_limit: must be null or a count >= 0"):
        plan_config_from(compose(["runtime.cudnn_benchmark_limit=-1"]))


def test_a_trainer_sets_the_limit_and_the_next_one_gets_pytorchs_default_back(tmp_path, restore_limit):
    default = runner._PYTORCH_CUDNN_LIMIT
    base = small_config()
    for limit, want in ((0, 0), (3, 3), (None, default)):
        pc = dataclasses.replace(base, runtime=dataclasses.replace(base.runtime, cudnn_benchmark_limit=limit))
        runner.Trainer(pc, tmp_path, log=lambda *_: None, telemetry=False, source=False)
        assert torch.backends.cudnn.benchmark_limit == want, limit


def test_tr_bench_gives_the_limit_to_its_pytorch_modes_and_says_so(tmp_path, monkeypatch, capsys, restore_limit):
    import tr_hydra.bench as tb
    from tr_hydra.cli import bench
    seen = []
    real = tb.pytorch_runner

    def spy(*a, **k):
        seen.append(torch.backends.cudnn.benchmark_limit)
        return real(*a, **k)
    monkeypatch.setattr(tb, "pytorch_runner", spy)
    torch.backends.cudnn.benchmark_limit = 10
    out = tmp_path / "b.json"
    rc = bench.main(["data=synthetic", "data.train_size=64", "bench.modes=[eager]", "bench.steps=1",
                     "bench.repeats=1", "bench.warmup=1", "runtime.device=cpu", "runtime.cudnn_benchmark_limit=0",
                     f"bench.out={out}"])
    assert rc == 0 and seen == [0]
    assert "runtime.cudnn_benchmark_limit=0), for tr_hydra and every PyTorch mode alike" in capsys.readouterr().out
    assert json.loads(out.read_text())["runtime"]["cudnn_benchmark_limit"] == 0
