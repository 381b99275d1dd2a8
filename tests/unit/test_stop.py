"""The stop policy: a preemption signal stops the run at the step after it (one rank), the
numbers ``health`` refuses stop it at the read that sees them, each as a ``Stop`` at that step."""
from __future__ import annotations

import os
import signal
from types import SimpleNamespace

import pytest
import torch

from tr_hydra.runtime.distributed import SINGLE
from tr_hydra.runtime.guards import NonFiniteError
from tr_hydra.train.stop import Stop, StopPolicy


class _Ex:
    """The executor's scalars ``health`` reads, fp16 (so the loss scale is checked)."""
    fp16 = True

    def __init__(self, loss_scale: float):
        self.s = {"nonfinite": 0.0, "skipped": 31.0, "loss_scale": loss_scale}

    def scalar(self, name):
        return self.s[name]

    def nonfinite_report(self):
        return "first at step 3 in loss"


def _policy(loss_scale: float = 1024.0) -> StopPolicy:
    pc = SimpleNamespace(trainer=SimpleNamespace(max_nonfinite=5, log_every=4))
    rt = SimpleNamespace(dist=SINGLE, device=torch.device("cpu"), ex=_Ex(loss_scale))
    return StopPolicy(pc, rt)


def test_a_signal_stops_one_rank_at_the_next_step_even_between_log_intervals():
    before = signal.getsignal(signal.SIGTERM)
    with _policy() as policy:
        policy.after_step(6, 1, at_log=False)  # no signal: goes on
        os.kill(os.getpid(), signal.SIGTERM)
        with pytest.raises(Stop) as e:
            policy.after_step(7, 1, at_log=False)
        assert (e.value.step, e.value.epoch, e.value.error) == (7, 1, None)
        assert policy.signal_name == "SIGTERM"
    assert signal.getsignal(signal.SIGTERM) is before  # the handler put back on leaving


def test_a_collapsed_loss_scale_stops_at_the_read_carrying_healths_error():
    _policy(2.0 ** -14).after_read(12, 2)  # the smallest scale allowed: goes on
    with pytest.raises(Stop) as e:
        _policy(2.0 ** -15).after_read(12, 2)
    assert (e.value.step, e.value.epoch) == (12, 2) and isinstance(e.value.error, NonFiniteError)
    assert str(e.value.error) == ("training stopped: the fp16 loss scale collapsed to 3.05e-05 after 31 "
                                  "skipped steps (first at step 3 in loss); try amp_dtype=bf16 or a lower lr")
