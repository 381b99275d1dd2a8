"""Random layers on CPU: dropout (nn.Dropout before the fc) and stochastic depth
(torchvision.ops.StochasticDepth on a residual branch) draw their masks from PyTorch's default
generator inside the step, deterministic reruns are bit-identical, a resumed run draws the
masks of the run that never stopped, and what startup draws does not shift that stream."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import fit_stop_resume
from tests.random_layers import RandomMini, random_config
from tr_hydra import startup
from tr_hydra.runtime import rng
from tr_hydra.train.trainer import Trainer


@pytest.fixture
def deterministic():
    yield
    torch.use_deterministic_algorithms(False)


def _fit(pc, out):
    tr = Trainer(pc, out, log=lambda *_: None)
    tr.fit()
    return tr.final_state_dict()


def _equal(a, b) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_the_step_draws_its_masks_from_the_default_generator(tmp_path, deterministic):
    """One training step's loss equals plain PyTorch's (the same weights, the same batch, the
    same generator state, F.cross_entropy), and another generator state gives another loss."""
    tr = Trainer(random_config(epochs=1), tmp_path, log=lambda *_: None)
    ref = RandomMini(10)
    ref.load_state_dict(tr.final_state_dict())
    ref.train()
    img, lab = tr.ex.input_views("train_base", "A")
    g = torch.Generator().manual_seed(7)
    img.copy_(torch.randn(img.shape, generator=g))
    lab.copy_(torch.randint(0, 10, lab.shape, generator=g))
    x, y = img.permute(0, 3, 1, 2).clone(), lab.long().clone()

    def step_loss(seed):
        tr.arena.arena.copy_(arena)  # each step from the same weights
        torch.manual_seed(seed)
        tr.ex.train_step("train_base", "A")
        return tr.ex.result[0].item() / len(y)

    def ref_loss(seed):
        torch.manual_seed(seed)
        with torch.no_grad():
            return F.cross_entropy(ref(x), y).item()
    arena = tr.arena.arena.clone()
    assert step_loss(1) == pytest.approx(ref_loss(1), rel=1e-5)
    assert step_loss(2) == pytest.approx(ref_loss(2), rel=1e-5)
    assert abs(ref_loss(1) - ref_loss(2)) > 1e-3  # the masks differ, and so does the loss


def test_deterministic_runs_with_random_layers_are_bit_identical(tmp_path, deterministic):
    pc = random_config(epochs=2)
    assert _equal(_fit(pc, tmp_path / "a"), _fit(pc, tmp_path / "b"))


def test_the_masks_are_drawn(tmp_path, deterministic):
    """With p=0 the model trains to exactly ResNetMini's weights (the same start); with p>0 the
    weights differ from both."""
    plain = _fit(random_config(model="resnet_mini", epochs=1), tmp_path / "plain")
    p0 = _fit(random_config(model="test_random_mini_p0", epochs=1), tmp_path / "p0")
    drawn = _fit(random_config(epochs=1), tmp_path / "drawn")
    assert _equal(plain, p0)
    assert not torch.equal(drawn["fc.weight"], p0["fc.weight"])
    assert not torch.equal(drawn["layer1.conv1.weight"], p0["layer1.conv1.weight"])


@pytest.mark.parametrize("stop_at", [3, 4], ids=["after_epoch_1", "inside_epoch_2"])
def test_a_resumed_run_draws_the_masks_of_one_that_never_stopped(tmp_path, deterministic, stop_at):
    full, resumed, at_stop = fit_stop_resume(random_config(), tmp_path, stop_at, epochs=3)
    assert at_stop and at_stop[0].endswith(f"_s{stop_at:08d}.pt")
    assert _equal(full.final_state_dict(), resumed.final_state_dict())


def _drawing_startup(rt, launcher=None, log=print):
    """A stand-in for startup on CUDA, on the CPU: warm-up steps of every training variant, run
    eagerly with the arena put back afterwards, as ``CudaGraphs.capture`` does, and one probe
    filled with normal values, as cuDNN's search does. Its draws move the generator."""
    before = torch.get_rng_state()
    snapshot = rt.ex.arena.arena.clone()
    for v in [v.name for v in rt.pc.variants if v.train]:
        for _ in range(2):
            rt.ex.train_step(v, "A")
    torch.empty(64).normal_()
    rt.ex.arena.arena.copy_(snapshot)
    assert not torch.equal(torch.get_rng_state(), before)
    return startup.StartupReport()


def test_what_startup_draws_does_not_shift_a_resumed_runs_masks(tmp_path, deterministic, monkeypatch):
    """With a startup that draws random numbers (the CUDA warm-up's and cuDNN's), a run resumed
    after epoch 1 still ends bit-identical to one that never stopped; without putting the
    generators back after startup it does not, which is what this test would catch."""
    monkeypatch.setattr(startup, "_get_ready", _drawing_startup)
    full, resumed, _ = fit_stop_resume(random_config(), tmp_path / "kept", 3, epochs=2)
    assert _equal(full.final_state_dict(), resumed.final_state_dict())
    monkeypatch.setattr(rng.StartupDraws, "put", lambda self: None)
    full, resumed, _ = fit_stop_resume(random_config(), tmp_path / "shifted", 3, epochs=2)
    assert not _equal(full.final_state_dict(), resumed.final_state_dict())



@pytest.mark.parametrize("mode", ["none", "pointwise"])
def test_runtime_recompute_never_draws_a_mask_again_in_the_backward(mode):
    """AOTAutograd's partitioner under ``runtime.recompute``'s options, on dropout and stochastic
    depth: the forward graph draws, the backward graph draws nothing (it uses the forward's
    masks; a second draw would give gradients of other masks)."""
    import torchvision
    from functorch.compile import aot_function, make_boxed_func, min_cut_rematerialization_partition
    from torch._functorch import config as fconfig
    from tr_hydra.internals.recompute import partitioner_options
    graphs = {}

    def keep(name):
        def compiler(gm, _inputs):
            graphs[name] = gm
            return make_boxed_func(gm)
        return compiler

    def f(x, w):
        h = F.dropout((x @ w).relu(), 0.3, training=True)
        return torchvision.ops.stochastic_depth(h, 0.3, "row", training=True).relu() * 2.0

    def draws(gm):
        return [n for n in gm.graph.nodes if n.op == "call_function"
                and torch.Tag.nondeterministic_seeded in getattr(n.target, "tags", ())]
    with fconfig.patch(**partitioner_options(mode)):
        fn = aot_function(f, fw_compiler=keep("fw"), bw_compiler=keep("bw"),
                          partition_fn=min_cut_rematerialization_partition)
        x, w = torch.randn(8, 16), torch.randn(16, 16, requires_grad=True)
        fn(x, w).sum().backward()
    assert len(draws(graphs["fw"])) >= 2, graphs["fw"].code  # dropout's and stochastic depth's
    assert not draws(graphs["bw"]), graphs["bw"].code
