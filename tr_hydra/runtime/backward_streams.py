"""``runtime.backward_streams=2``: each convolution's two gradients side by side on two streams.

A convolution's backward computes two independent things from the same inputs: the input
gradient (which the layer below needs next) and the weight gradient (which only the update
needs). PyTorch runs the two one after the other on one stream. Where neither fills the GPU on
its own, as with CIFAR's small images or the deep layers' 7x7 maps at ImageNet sizes, running
them at the same time on two streams uses the idle SMs. MXNet offers the same
(``MXNET_GPU_WORKER_NSTREAMS=2``) for the same reason.

How: with Inductor, a pass over the compiled backward graph (after AOTAutograd's partition,
Inductor's ``post_grad_custom_post_pass``) replaces every ``aten.convolution_backward`` that
computes both gradients, and no bias gradient, by :func:`conv_backward_two_streams`, a custom op
with the same arguments. Inductor calls ``convolution_backward`` as an external kernel either
way, so nothing else in the compiled code changes. On CUDA the op starts the weight gradient
on a second stream (after the work already queued on the current one), computes the input
gradient on the current stream, then makes the current stream wait for the second before it
returns. Inside a CUDA graph capture that fork and join become two parallel branches of the
graph.

Memory: the second stream's results and cuDNN workspace come from the caching allocator's
blocks for that stream (in the capture's private pool during a capture). Freed blocks are not
shared between the two streams, so the peak can grow by up to the largest weight gradient and
workspace. Each launch on the second stream first waits for everything queued on the current
one, so a block the current stream has freed and the second stream reuses is never still in
use.

Same numbers: the two gradients come from the same cuDNN calls with one output each, which
is what ``convolution_backward`` does for each output it is asked for.
"""
# no ``from __future__ import annotations``: custom_op reads the signature's types as objects
from typing import List, Optional, Tuple

import torch

aten = torch.ops.aten

_AUX: dict = {}  # device index -> its second stream


def aux_stream(device: torch.device) -> "torch.cuda.Stream":
    """The second stream of ``device`` (one per device and process), made on first use."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    s = _AUX.get(idx)
    if s is None:
        s = _AUX[idx] = torch.cuda.Stream(device=idx)
    return s


@torch.library.custom_op("tr_hydra::conv_backward_two_streams", mutates_args=())
def conv_backward_two_streams(grad: torch.Tensor, inp: torch.Tensor, weight: torch.Tensor,
                              bias_sizes: Optional[List[int]], stride: List[int], padding: List[int],
                              dilation: List[int], transposed: bool, output_padding: List[int],
                              groups: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """``aten.convolution_backward(..., output_mask=[True, True, False])``: (input gradient,
    weight gradient), the weight gradient on a second CUDA stream."""
    args = (grad, inp, weight, bias_sizes, stride, padding, dilation, transposed, output_padding, groups)
    if not grad.is_cuda:  # nothing to overlap: the same two calls, one after the other
        dw = aten.convolution_backward(*args, [False, True, False])[1]
        dx = aten.convolution_backward(*args, [True, False, False])[0]
        return dx, dw
    main = torch.cuda.current_stream(grad.device)
    aux = aux_stream(grad.device)
    aux.wait_stream(main)  # the inputs are ready, and every block the main stream freed is done with
    with torch.cuda.stream(aux):
        dw = aten.convolution_backward(*args, [False, True, False])[1]
    dx = aten.convolution_backward(*args, [True, False, False])[0]
    main.wait_stream(aux)  # the join: nothing after this op sees the second stream still running
    return dx, dw


@conv_backward_two_streams.register_fake
def _(grad, inp, weight, bias_sizes, stride, padding, dilation, transposed, output_padding, groups):
    dx, dw, _ = aten.convolution_backward(grad, inp, weight, bias_sizes, stride, padding, dilation, transposed,
                                          output_padding, groups, [True, True, False])
    return dx, dw


def split_conv_backwards(graph: torch.fx.Graph) -> int:
    """Replace, in place, each ``convolution_backward`` of ``graph`` that computes the input and
    weight gradients (and no bias gradient) by :func:`conv_backward_two_streams`. Returns how
    many were replaced."""
    n = 0
    target = aten.convolution_backward.default
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not target:
            continue
        mask = node.args[10] if len(node.args) > 10 else node.kwargs.get("output_mask")
        if mask is None or [bool(m) for m in mask] != [True, True, False] or node.kwargs:
            continue
        with graph.inserting_before(node):
            new = graph.call_function(torch.ops.tr_hydra.conv_backward_two_streams.default, tuple(node.args[:10]))
        new.meta.update(node.meta)
        val = node.meta.get("val")
        if val is not None:
            new.meta["val"] = (val[0], val[1])
        node.replace_all_uses_with(new)
        graph.erase_node(node)
        n += 1
    SPLIT_COUNTS.append(n)
    return n


SPLIT_COUNTS: list = []  # per graph the pass saw, in this process (for the log and the tests)


def _pass_class():
    try:
        from torch._inductor.custom_graph_pass import CustomGraphPass
    except ImportError:  # an older PyTorch: a plain callable (Inductor then bypasses its FX cache)
        CustomGraphPass = object

    class SplitConvBackward(CustomGraphPass):
        """Inductor's post-grad pass for ``runtime.backward_streams=2``. ``uuid`` is part of
        Inductor's cache key, so a cached graph made without the pass is not reused with it."""

        def __call__(self, graph: torch.fx.Graph) -> None:
            split_conv_backwards(graph)

        def uuid(self):
            return "tr_hydra.split_conv_backward.v1"

        def __eq__(self, other):
            return type(other).__name__ == type(self).__name__

        def __hash__(self):
            return hash(self.uuid())

    return SplitConvBackward


_PASS = None


def inductor_pass():
    """The one pass object of this process (equal options compare equal across trainers)."""
    global _PASS
    if _PASS is None:
        _PASS = _pass_class()()
    return _PASS


def inductor_options_for(streams: int, options: dict) -> dict:
    """``options`` with the pass added when ``streams`` is 2 (``runtime.inductor_options``
    cannot set the pass: plan_config refuses the name)."""
    if streams == 1:
        return options
    return dict(options, post_grad_custom_post_pass=inductor_pass())
