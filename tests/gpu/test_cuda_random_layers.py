"""CUDA: dropout and stochastic depth inside the captured step. A replay draws the masks the
eager step draws from the same generator state (the eager model captured, and Inductor's
compile, whose seeds come from the same generator); a run resumed with graphs ends bit-identical
to one that never stopped, although each startup's warm-up draws masks of its own."""
from __future__ import annotations

import pytest
import torch

from tests.helpers import fit_stop_resume
from tests.random_layers import random_config
from tr_hydra.train.trainer import Trainer

pytestmark = pytest.mark.cuda


@pytest.fixture
def deterministic():
    yield
    torch.use_deterministic_algorithms(False)


@pytest.mark.parametrize("compile", ["none", "inductor"])
def test_a_replay_draws_the_masks_of_the_eager_step(tmp_path, deterministic, compile):
    tr = Trainer(random_config(device="cuda", compile=compile, epochs=1), tmp_path, log=lambda *_: None)
    before = torch.cuda.get_rng_state()
    tr.get_ready()
    assert tr.graphs is not None
    assert torch.equal(torch.cuda.get_rng_state(), before)  # startup's draws put back
    img, lab = tr.ex.input_views("train_base", "A")
    g = torch.Generator().manual_seed(7)
    img.copy_(torch.randn(img.shape, generator=g).to(img.dtype))
    lab.copy_(torch.randint(0, 10, lab.shape, generator=g))
    arena = tr.arena.arena.clone()

    def step(run, seed):
        """The step's loss sum and the generator's state after it, from the same weights."""
        tr.arena.arena.copy_(arena)
        torch.cuda.manual_seed(seed)
        run("train_base", "A")
        torch.cuda.synchronize()
        return tr.ex.result[0].item(), torch.cuda.get_rng_state()

    graph, graph_after = step(tr.graphs.train_step, 1)
    eager, eager_after = step(tr.ex.train_step, 1)
    again, _ = step(tr.graphs.train_step, 1)
    other, _ = step(tr.graphs.train_step, 2)
    assert graph == pytest.approx(eager, rel=1e-5)
    assert again == graph  # a replay reads the generator's state when it runs, not at capture
    assert torch.equal(graph_after, eager_after)  # a replay advances it as the eager step does
    assert abs(other - graph) > 1e-3 * abs(graph)  # another state, other masks


@pytest.mark.parametrize("compile", ["none", "inductor"])
def test_a_resumed_run_with_graphs_draws_the_masks_of_one_that_never_stopped(tmp_path, deterministic, compile):
    full, resumed, at_stop = fit_stop_resume(random_config(device="cuda", compile=compile), tmp_path, 3, epochs=2)
    assert at_stop[0].endswith("_s00000003.pt")
    a, b = full.final_state_dict(), resumed.final_state_dict()
    for k in a:
        assert torch.equal(a[k], b[k]), k
