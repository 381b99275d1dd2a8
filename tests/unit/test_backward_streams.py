"""runtime.backward_streams=2: the custom op gives convolution_backward's two gradients, and the
post-grad pass puts it in place of every convolution backward that computes both."""
from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.nn as nn

from tests.helpers import small_config
from tr_hydra.runtime import backward_streams as bs
from tr_hydra.runtime.runner import Trainer

aten = torch.ops.aten


@pytest.fixture
def no_compile_caches():
    """The pass runs only when Inductor compiles; a graph from the on-disk caches skips it."""
    import torch._functorch.config as fc
    import torch._inductor.config as ic
    with ic.patch(fx_graph_cache=False), fc.patch(enable_autograd_cache=False):
        yield


@pytest.mark.parametrize("stride,padding,dilation,groups,cl", [
    (1, 1, 1, 1, False), (2, 1, 1, 1, True), (1, 0, 1, 1, True), (2, 3, 1, 1, False),
    (1, 2, 2, 1, False), (1, 1, 1, 4, True)])
def test_the_op_gives_convolution_backwards_input_and_weight_gradients(stride, padding, dilation, groups, cl):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 8, 13, 11, generator=g)
    w = torch.randn(16, 8 // groups, 3 if padding != 3 else 7, 3 if padding != 3 else 7, generator=g)
    if cl:
        x, w = x.to(memory_format=torch.channels_last), w.to(memory_format=torch.channels_last)
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = torch.nn.functional.conv2d(xr, wr, None, stride, padding, dilation, groups)
    gy = torch.randn(y.shape, generator=g)
    y.backward(gy)  # autograd's own convolution backward is the reference
    args = (gy, x, w, None, [stride] * 2, [padding] * 2, [dilation] * 2, False, [0, 0], groups)
    dx, dw = torch.ops.tr_hydra.conv_backward_two_streams(*args)
    torch.testing.assert_close(dx, xr.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dw, wr.grad, rtol=1e-5, atol=1e-5)
    # the fake (meta) outputs have the real ones' shapes and strides, which Inductor relies on
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
        fargs = tuple(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args)
        fdx, fdw = torch.ops.tr_hydra.conv_backward_two_streams(*fargs)
    assert (fdx.shape, fdx.stride()) == (dx.shape, dx.stride())
    assert (fdw.shape, fdw.stride()) == (dw.shape, dw.stride())


def _net():
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.Conv2d(8, 8, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.Conv2d(8, 8, 1, bias=True), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4))


def test_the_pass_replaces_the_convolution_backwards_that_compute_both_gradients(no_compile_caches):
    """In the compiled backward: the second convolution (input and weight gradients) is
    replaced; the first (no input gradient: its input is the image) and the third (a bias
    gradient too) keep aten's. The gradients are those of the same compile without the pass."""
    from torch._inductor.utils import run_and_get_code
    torch.manual_seed(0)
    nets = {k: _net() for k in ("plain", "split")}
    nets["split"].load_state_dict(nets["plain"].state_dict())
    x = torch.randn(4, 3, 16, 16)
    grads, code = {}, {}
    for k, net in nets.items():
        torch._dynamo.reset()
        opts = bs.inductor_options_for(2 if k == "split" else 1, {})
        c = torch.compile(net, dynamic=False, options=opts) if opts else torch.compile(net, dynamic=False)
        del bs.SPLIT_COUNTS[:]
        _, src = run_and_get_code(lambda: c(x).square().sum().backward())
        code[k], counts = "\n".join(src), list(bs.SPLIT_COUNTS)
        if k == "split":
            assert counts and sum(counts) == 1, counts
        grads[k] = {n: p.grad.clone() for n, p in net.named_parameters()}
    calls = {k: (c.count("aten.convolution_backward.default("), c.count("tr_hydra.conv_backward_two_streams.default("))
             for k, c in code.items()}
    assert calls == {"plain": (3, 0), "split": (2, 1)}, calls
    for n, ref in grads["plain"].items():
        torch.testing.assert_close(grads["split"][n], ref, rtol=1e-5, atol=1e-6, msg=n)


def test_with_join_next_each_weight_gradient_joins_after_the_next_input_gradient(no_compile_caches):
    """backward_join=next: in graph order, each convolution's weight gradient starts before its
    input gradient and joins after the next split convolution's input gradient (the last one
    before the output); the join keeps the weight gradient's inputs alive; same gradients."""
    import operator
    torch.manual_seed(0)
    net = nn.Sequential(*[m for _ in range(3) for m in (nn.Conv2d(8, 8, 3, padding=1, bias=False),
                                                          nn.BatchNorm2d(8), nn.ReLU())],
                        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4))
    graphs = []
    orig = bs.split_conv_backwards

    def spy(graph, join="conv"):
        n = orig(graph, join)
        graphs.append(graph)
        return n
    x = torch.randn(4, 8, 12, 12)
    ref = copy.deepcopy(net)
    ref(x).square().sum().backward()
    torch._dynamo.reset()
    bs.split_conv_backwards = spy
    try:
        c = torch.compile(net, dynamic=False, options=bs.inductor_options_for(2, {}, "next"))
        c(x).square().sum().backward()
    finally:
        bs.split_conv_backwards = orig
    order = [n for n in graphs[-1].nodes
             if n.target in (torch.ops.tr_hydra.conv_weight_grad_start.default,
                             torch.ops.tr_hydra.conv_weight_grad_join.default,
                             aten.convolution_backward.default) or n.op == "output"]
    kinds = ["start" if n.target is torch.ops.tr_hydra.conv_weight_grad_start.default else
             "join" if n.target is torch.ops.tr_hydra.conv_weight_grad_join.default else
             "output" if n.op == "output" else
             "dgrad" if list(n.args[10]) == [True, False, False] else "aten" for n in order]
    # three convolutions, the last first: the first one (over the input: no input gradient)
    # keeps aten's call
    assert kinds == ["start", "dgrad", "start", "dgrad", "join", "aten", "join", "output"], kinds
    joins = [n for n in order if n.target is torch.ops.tr_hydra.conv_weight_grad_join.default]
    starts = [n for n in order if n.target is torch.ops.tr_hydra.conv_weight_grad_start.default]
    g = graphs[-1]
    pos = {n: i for i, n in enumerate(g.nodes)}
    dgrads = [n for n in order if n.target is aten.convolution_backward.default and list(n.args[10]) == [True, False, False]]
    # the first join comes after the second input gradient; its keep list holds the first's inputs
    assert pos[joins[0]] > pos[dgrads[1]] and joins[0].args[0] is starts[0]
    keep = joins[0].args[1]
    assert starts[0].args[0] in keep and starts[0].args[1] in keep
    assert pos[joins[1]] < pos[next(n for n in g.nodes if n.op == "output")]
    assert not any(n.target is operator.getitem and n.args[0] in starts for n in g.nodes)
    for (name, p), q in zip(net.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=name)


def test_a_trainer_with_two_backward_streams_trains_as_with_one(tmp_path, no_compile_caches):
    """The whole step through the trainer (Inductor on CPU): the same weights after a few steps
    with the pass as without it, and as the eager step."""
    out, logs = {}, {}
    for name, mode, streams, join in (("eager", "none", 1, "conv"), ("one", "inductor", 1, "conv"),
                                      ("two", "inductor", 2, "conv"), ("next", "inductor", 2, "next")):
        torch._dynamo.reset()
        torch.manual_seed(0)
        pc = small_config(compile=mode, train_size=72, batch=32, val_size=40, val_batch=32, epochs=1)
        pc = dataclasses.replace(pc, runtime=dataclasses.replace(pc.runtime, backward_streams=streams,
                                                                 backward_join=join, precompile=0))
        logs[name] = []
        del bs.SPLIT_COUNTS[:]
        tr = Trainer(pc, tmp_path / name, log=logs[name].append)
        tr.fit()
        out[name] = tr.final_state_dict()
        if name in ("two", "next"):
            assert sum(bs.SPLIT_COUNTS) > 0, "no convolution backward was split"
            said = [str(ln) for ln in logs[name] if "runtime.backward_streams=2" in str(ln)]
            assert said and (("backward_join=next" in said[0]) == (name == "next")), said
        elif name == "one":
            assert not bs.SPLIT_COUNTS
    for k, ref in out["one"].items():
        for name in ("two", "next"):
            torch.testing.assert_close(out[name][k], ref, rtol=1e-5, atol=1e-5, msg=k)
            torch.testing.assert_close(out[name][k], out["eager"][k], rtol=1e-4, atol=1e-4, msg=k)


def test_backward_streams_is_checked_and_said_to_do_nothing_without_inductor(tmp_path):
    from tr_hydra.config.plan_config import plan_config_from
    from tr_hydra.errors import ConfigError
    from tr_hydra.cli._common import compose
    with pytest.raises(ConfigError, match=r"runtime.backward_streams: must be 1 or 2, got 3"):
        plan_config_from(compose(["runtime.backward_streams=3"]))
    with pytest.raises(ConfigError, match=r"post_grad_custom_post_pass: not allowed"):
        plan_config_from(compose(["+runtime.inductor_options.post_grad_custom_post_pass=x"]))
    assert plan_config_from(compose(["runtime.backward_streams=2"])).runtime.backward_streams == 2
    pc = small_config()  # CPU, runtime.compile=none
    pc = dataclasses.replace(pc, runtime=dataclasses.replace(pc.runtime, backward_streams=2))
    logs = []
    Trainer(pc, tmp_path, log=logs.append, telemetry=False, source=False)
    assert "runtime.backward_streams=2 has no effect without Inductor (runtime.compile)" in [str(x) for x in logs]


def test_tr_bench_has_a_two_stream_mode_beside_the_default():
    from tr_hydra.cli.bench import _modes, tr_runtime
    from tr_hydra.config.plan_config import RuntimeSpec
    rt = RuntimeSpec(stem="conv")
    assert tr_runtime("tr-streams", rt) == dataclasses.replace(rt, compile="inductor", backward_streams=2)
    assert tr_runtime("tr-streams-next", rt) == dataclasses.replace(rt, compile="inductor", backward_streams=2,
                                                                    backward_join="next")
    assert tr_runtime("tr-inductor", rt).backward_streams == 1
    assert _modes(["reduce-overhead", "tr-inductor", "tr-streams"], torch.device("cpu")) == \
        ["reduce-overhead", "tr-inductor", "tr-streams"]
    with pytest.raises(Exception, match="tr-stream"):
        _modes(["tr-stream"], torch.device("cpu"))


def test_changing_backward_streams_clears_dynamos_compiled_code(monkeypatch):
    """A second trainer in one process with the other setting must compile again: Dynamo's
    guards do not see Inductor's passes."""
    from tr_hydra.runtime import recompute
    monkeypatch.setattr(recompute, "_compiled_with", [])
    calls = []
    monkeypatch.setattr(torch._dynamo, "reset", lambda: calls.append(1))
    assert not recompute.fresh_compile_for("none", bs.inductor_options_for(1, {}))
    assert recompute.fresh_compile_for("none", bs.inductor_options_for(2, {}))
    assert not recompute.fresh_compile_for("none", bs.inductor_options_for(2, {}))  # the same pass: equal
    assert recompute.fresh_compile_for("none", bs.inductor_options_for(2, {}, "next"))
    assert recompute.fresh_compile_for("none", bs.inductor_options_for(1, {}))
    assert len(calls) == 3
