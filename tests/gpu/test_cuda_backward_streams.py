"""runtime.backward_streams=2 on CUDA: the two-stream op inside a CUDA graph capture, and the
captured training step (both joins), against the single-stream results."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.helpers import small_config
from tr_hydra.runtime import backward_streams as bs
from tr_hydra.runtime.runner import Trainer

pytestmark = pytest.mark.cuda


def test_the_op_under_a_cuda_graph_capture_gives_autograds_gradients():
    """Forked onto a second stream and joined, inside a capture: the replay's gradients are the
    eager autograd ones, for each of several layers run one after another (so blocks freed on
    one stream and reused on the other are exercised)."""
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    shapes = [(64, 64, 56, 3, 1), (64, 128, 28, 3, 2), (128, 256, 14, 1, 2), (256, 512, 7, 3, 1)]
    xs = [torch.randn(32, ci, s, s, device=dev, generator=g).to(memory_format=torch.channels_last).bfloat16()
          for ci, co, s, k, st in shapes]
    ws = [torch.randn(co, ci, k, k, device=dev, generator=g).to(memory_format=torch.channels_last).bfloat16()
          for ci, co, s, k, st in shapes]
    gys, refs = [], []
    for (ci, co, s, k, st), x, w in zip(shapes, xs, ws):
        xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = torch.nn.functional.conv2d(xr, wr, None, st, k // 2)
        gy = torch.randn(y.shape, device=dev, generator=g).bfloat16().contiguous(memory_format=torch.channels_last)
        y.backward(gy)
        gys.append(gy)
        refs.append((xr.grad, wr.grad))

    def step():
        return [torch.ops.tr_hydra.conv_backward_two_streams(gy, x, w, None, [st, st], [k // 2] * 2, [1, 1], False,
                                                            [0, 0], 1)
                for (ci, co, s, k, st), x, w, gy in zip(shapes, xs, ws, gys)]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # cuDNN's plans chosen outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    for gy in gys:
        gy.mul_(2.0)  # the replay reads the new values
    graph.replay()
    torch.cuda.synchronize()
    for (dx, dw), (rx, rw) in zip(outs, refs):
        torch.testing.assert_close(dx.float(), 2 * rx.float(), rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(dw.float(), 2 * rw.float(), rtol=2e-2, atol=2e-1)


@pytest.mark.parametrize("join", ["conv", "next"])
def test_captured_training_with_two_backward_streams_matches_one(tmp_path, join):
    import torch._functorch.config as fc
    import torch._inductor.config as ic
    out = {}
    for streams in (1, 2):
        torch._dynamo.reset()
        torch.manual_seed(0)
        pc = small_config(device="cuda", compile="inductor", amp=True, max_steps=8, epochs=2)
        pc = dataclasses.replace(pc, runtime=dataclasses.replace(pc.runtime, backward_streams=streams,
                                                                 backward_join=join, precompile=0))
        del bs.SPLIT_COUNTS[:]
        with ic.patch(fx_graph_cache=False), fc.patch(enable_autograd_cache=False):
            tr = Trainer(pc, tmp_path / str(streams), log=lambda *_: None)
            tr.fit()
        assert tr.graphs is not None
        assert (sum(bs.SPLIT_COUNTS) > 0) == (streams == 2), bs.SPLIT_COUNTS
        out[streams] = tr.final_state_dict()
    for k, ref in out[1].items():
        if ref.is_floating_point():
            torch.testing.assert_close(out[2][k], ref, rtol=1e-3, atol=1e-3, msg=k)
