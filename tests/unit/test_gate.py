"""The gate to PyTorch's internals (``tr_hydra.internals``): open only on the releases it was tested
with and where every patch target is there; closed, a run trains with stock ``torch.compile`` and
ends where the gated run ends, up to rounding."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.helpers import small_config
from tr_hydra import internals
from tr_hydra.train.trainer import Trainer


@pytest.fixture
def fresh_gate():
    internals.reset()
    yield
    internals.reset()


@pytest.mark.parametrize("version, opens", [("2.11.0+cu130", True), ("2.14.1", True), ("2.99.0", False),
                                            ("2.10.0", False)])
def test_the_gate_opens_on_the_tested_releases_only(monkeypatch, fresh_gate, version, opens):
    monkeypatch.delenv(internals.STOCK_VAR, raising=False)
    monkeypatch.setattr(torch, "__version__", version)
    gate = internals.state()
    assert gate.open == opens
    if not opens:
        v = version.split("+")[0]
        assert f"torch {v} is not a release tr_hydra was tested with (2.11, 2.14)" in gate.line()
        assert "stock torch.compile" in gate.line() and "\n" not in gate.line()


def test_the_stock_variable_closes_the_gate(monkeypatch, fresh_gate):
    monkeypatch.setenv(internals.STOCK_VAR, "1")
    assert not internals.is_open() and internals.state().why == "TR_HYDRA_STOCK=1"
    monkeypatch.setenv(internals.STOCK_VAR, "0")
    internals.reset()
    assert internals.is_open()


def test_a_missing_patch_target_closes_the_gate(monkeypatch, fresh_gate):
    th = pytest.importorskip("torch._inductor.runtime.triton_heuristics")
    monkeypatch.delenv(internals.STOCK_VAR, raising=False)
    monkeypatch.delattr(th.CachingAutotuner, "autotune_to_one_config")
    gate = internals.state()
    assert not gate.open and "has no CachingAutotuner.autotune_to_one_config" in gate.why


def test_a_forced_fallback_trains_and_ends_where_the_gated_run_ends(tmp_path, monkeypatch, fresh_gate):
    """Three runs of the same plan from the same seed on the CPU: Inductor behind an open gate,
    Inductor with the gate forced closed, and the eager step. The closed run says so in one line
    and ends as close to the open run as the open run is to the eager step (the rounding of a
    compiled step on this machine)."""
    out, logs = {}, {}
    for name, compile, stock in (("eager", "none", False), ("open", "inductor", False), ("stock", "inductor", True)):
        if stock:
            monkeypatch.setenv(internals.STOCK_VAR, "1")
        else:
            monkeypatch.delenv(internals.STOCK_VAR, raising=False)
        internals.reset()
        torch.manual_seed(0)
        pc = small_config(compile=compile, train_size=64, batch=32, val_size=32, val_batch=32, epochs=1)
        pc = dataclasses.replace(pc, runtime=dataclasses.replace(pc.runtime, precompile=0))
        logs[name] = []
        tr = Trainer(pc, tmp_path / name, log=logs[name].append)
        if name == "eager":
            init = {k: v.clone() for k, v in tr.final_state_dict().items()}
        tr.fit()
        out[name] = tr.final_state_dict()
        tr.close()
    said = [str(ln) for ln in logs["stock"] if str(ln).startswith("PyTorch internals:")]
    assert len(said) == 1 and not any(str(ln).startswith("PyTorch internals:") for ln in logs["open"])
    keys = [k for k, v in out["eager"].items() if v.is_floating_point()]
    rounding = max((out["open"][k] - out["eager"][k]).abs().max().item() for k in keys)
    moved = max((out["eager"][k] - init[k]).abs().max().item() for k in keys)
    assert moved > 100 * rounding  # the runs trained, and rounding is small beside what they learnt
    for k in keys:
        assert (out["stock"][k] - out["open"][k]).abs().max().item() <= rounding, k
