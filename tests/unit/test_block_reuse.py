"""runtime.reuse_blocks: residual blocks as nested compile regions, one per distinct block, with
BatchNorm's running statistics updated outside the region. Checked against the unmarked model
(nn.BatchNorm2d's own in-place update) in eager and under torch.compile, and through the trainer."""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torchvision

from tests.helpers import small_config
from tr_hydra.errors import ConfigError
from tr_hydra.models.registry import build_model
from tr_hydra.runtime.block_reuse import mark_block_regions
from tr_hydra.runtime.runner import Trainer

pytestmark = pytest.mark.skipif(not hasattr(torch.compiler, "nested_compile_region"),
                                reason="needs torch.compiler.nested_compile_region")


def _pair(name: str, num_classes: int = 10):
    torch.manual_seed(0)
    ref = build_model(name, num_classes)
    marked = build_model(name, num_classes)
    marked.load_state_dict(ref.state_dict())
    return ref, marked


@pytest.mark.parametrize("name,blocks,distinct", [
    # the first block of each stage changes the width or the stride; the others of a stage are alike
    ("resnet50", 2 + 3 + 5 + 2, 4),
    ("resnet18", 2, 1),  # layer1's two blocks are alike; each later stage has one block after its first
    ("resnet_mini", 0, 0),  # two blocks, not alike
])
def test_blocks_marked_once_per_distinct_block(name, blocks, distinct):
    _, m = _pair(name)
    assert mark_block_regions(m) == (blocks, distinct)


def test_a_model_without_known_blocks_is_left_alone():
    m = build_model("convnet_mini", 10)
    assert mark_block_regions(m) == (0, 0)


def test_blocks_with_cumulative_bn_are_left_alone():
    _, m = _pair("resnet18")
    m.layer1[1].bn2.momentum = None  # a cumulative average: not updated outside the region
    assert mark_block_regions(m) == (0, 0)  # layer1[0] is then without a twin


@pytest.mark.parametrize("name", ["resnet18", "resnet50"])
def test_eager_training_and_eval_match_the_unmarked_model(name):
    """Outside torch.compile a region is a plain call: the outputs, the gradients and the
    running statistics (nn.BatchNorm2d's own update as the reference) are the unmarked model's."""
    ref, m = _pair(name)
    mark_block_regions(m)
    x = torch.randn(6, 3, 32, 32, dtype=torch.float64)
    ref, m = ref.double(), m.double()
    for step in range(2):
        for model in (ref, m):
            model.zero_grad()
            model(x * (step + 1)).square().mean().backward()
    for (k, a), (_, b) in zip(ref.state_dict().items(), m.state_dict().items()):
        torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12, msg=k)
    for (k, a), (_, b) in zip(ref.named_parameters(), m.named_parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-10, atol=1e-12, msg=k)
    ref.eval(), m.eval()
    torch.testing.assert_close(m(x), ref(x), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", ["resnet18", "resnet50"])
def test_compiled_model_calls_one_subgraph_per_group_of_alike_blocks(name):
    """Under torch.compile the graph calls each group's subgraph (invoke_subgraph) at every
    block of the group, and a training step matches the unmarked model's eager step."""
    ref, m = _pair(name)
    marked, distinct = mark_block_regions(m)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        from torch._dynamo.backends.common import aot_autograd
        return aot_autograd(fw_compiler=lambda g, _: g, bw_compiler=lambda g, _: g)(gm, example_inputs)

    torch._dynamo.reset()
    f = torch.compile(m, backend=backend, dynamic=False)
    x = torch.randn(4, 3, 32, 32)
    f(x).square().mean().backward()
    ref(x).square().mean().backward()
    (gm,) = graphs
    calls = [n for n in gm.graph.nodes if n.op == "call_function" and "invoke_subgraph" in str(n.target)]
    subgraphs = {n.args[0].target for n in calls}
    assert len(calls) == marked and len(subgraphs) == distinct, (len(calls), subgraphs)
    for (k, a), (_, b) in zip(ref.state_dict().items(), m.state_dict().items()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5, msg=k)
    for (k, a), (_, b) in zip(ref.named_parameters(), m.named_parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-5, msg=k)
    torch._dynamo.reset()


def test_inductor_compiles_the_regions_without_touching_the_weights():
    """With runtime.reuse_blocks' Inductor options, one compiled training step leaves every
    weight as it was and gives the gradients of the unmarked model's compiled step. (Inductor's
    buffer reuse wrote into the first block's weights inside the region's code.)"""
    from tr_hydra.runtime.block_reuse import INDUCTOR_OPTIONS
    ref, m = _pair("resnet18")
    ref, m = ref.double(), m.double()  # so that the two compiles' rounding stays far below any error
    mark_block_regions(m)
    before = {k: v.clone() for k, v in m.state_dict().items() if not k.endswith(("running_mean", "running_var",
                                                                             "num_batches_tracked"))}
    torch._dynamo.reset()
    x = torch.randn(4, 3, 16, 16, dtype=torch.float64)
    torch.compile(m, dynamic=False, options=INDUCTOR_OPTIONS)(x).square().mean().backward()
    torch.compile(ref, dynamic=False)(x).square().mean().backward()
    after = m.state_dict()
    changed = [(k, (after[k] - v).abs().max().item()) for k, v in before.items() if not torch.equal(after[k], v)]
    assert not changed, changed
    for (k, a), (_, b) in zip(ref.named_parameters(), m.named_parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-9, atol=1e-12, msg=k)
    torch._dynamo.reset()


def test_trainer_with_reused_blocks_trains_as_the_eager_step(tmp_path, monkeypatch):
    """runtime.reuse_blocks through the whole trainer: the regions read the arena-bound weights
    (as copies), the running statistics are updated in the arena outside the regions, and three
    steps end where the eager steps do. The model's compile gets the regions' Inductor options;
    it runs AOTAutograd without Inductor here (``aot_eager``), so that the comparison is exact
    to rounding: Inductor's own compile of the regions is checked above, in float64."""
    from tr_hydra.runtime.block_reuse import INDUCTOR_OPTIONS
    real_compile, seen = torch.compile, []

    def compile_aot_eager(fn, **kw):
        seen.append(kw.pop("options", None))
        return real_compile(fn, backend="aot_eager", **kw)

    out, logs = {}, []
    for mode, reuse in (("none", False), ("inductor", True)):
        torch._dynamo.reset()
        torch.manual_seed(0)
        pc = small_config(compile=mode, max_steps=3, model="resnet18_cifar", res=16)
        pc = dataclasses.replace(pc, runtime=dataclasses.replace(pc.runtime, reuse_blocks=reuse, precompile=0))
        with monkeypatch.context() as mp:
            mp.setattr(torch, "compile", compile_aot_eager)
            tr = Trainer(pc, tmp_path / mode, log=logs.append)
            tr.fit()
        out[mode] = tr.final_state_dict()
    assert "runtime.reuse_blocks: 2 residual blocks share the compiled code of 1" in logs
    assert seen and seen[0] == INDUCTOR_OPTIONS, seen  # the model's compile
    for k, ref in out["none"].items():
        torch.testing.assert_close(out["inductor"][k], ref, rtol=1e-5, atol=1e-6, msg=k)
    assert any(k.endswith("running_mean") and v.abs().max() > 0 for k, v in out["inductor"].items())
    torch._dynamo.reset()


def test_without_inductor_it_is_said_to_do_nothing(tmp_path):
    logs = []
    pc = small_config(compile="none", max_steps=1)
    pc = dataclasses.replace(pc, runtime=dataclasses.replace(pc.runtime, reuse_blocks=True))
    Trainer(pc, tmp_path, log=logs.append)
    assert any("runtime.reuse_blocks has no effect without Inductor" in str(ln) for ln in logs), logs


def test_with_two_backward_streams_is_a_one_line_error():
    from tr_hydra.config.plan_config import plan_config_from
    from tr_hydra.cli._common import compose
    plan_config_from(compose(["runtime.reuse_blocks=true"]))
    with pytest.raises(ConfigError, match=r"^runtime\.reuse_blocks: does not combine with runtime\.backward_streams=2"):
        plan_config_from(compose(["runtime.reuse_blocks=true", "runtime.backward_streams=2"]))


def test_torchvision_blocks_are_the_ones_marked():
    m = torchvision.models.resnet34(num_classes=10)
    assert mark_block_regions(m) == (3 + 3 + 5 + 2, 4)
