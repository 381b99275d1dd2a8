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


JOINS = ("conv", "next")


@torch.library.custom_op("tr_hydra::conv_weight_grad_start", mutates_args=())
def conv_weight_grad_start(grad: torch.Tensor, inp: torch.Tensor, weight: torch.Tensor,
                           bias_sizes: Optional[List[int]], stride: List[int], padding: List[int],
                           dilation: List[int], transposed: bool, output_padding: List[int],
                           groups: int) -> torch.Tensor:
    """``backward_join=next``: the weight gradient, started on the second stream (after the work
    queued on the current one) and not joined; :func:`conv_weight_grad_join` joins it."""
    args = (grad, inp, weight, bias_sizes, stride, padding, dilation, transposed, output_padding, groups)
    if not grad.is_cuda:
        return aten.convolution_backward(*args, [False, True, False])[1]
    aux = aux_stream(grad.device)
    aux.wait_stream(torch.cuda.current_stream(grad.device))
    with torch.cuda.stream(aux):
        return aten.convolution_backward(*args, [False, True, False])[1]


@conv_weight_grad_start.register_fake
def _(grad, inp, weight, bias_sizes, stride, padding, dilation, transposed, output_padding, groups):
    return aten.convolution_backward(grad, inp, weight, bias_sizes, stride, padding, dilation, transposed,
                                     output_padding, groups, [False, True, False])[1]


@torch.library.custom_op("tr_hydra::conv_weight_grad_join", mutates_args=())
def conv_weight_grad_join(dw: torch.Tensor, keep: List[torch.Tensor]) -> torch.Tensor:
    """The current stream waits for the second; returns a copy of ``dw`` made after the wait (a
    custom op may not return its input). ``keep``: the weight gradient's own inputs, so that
    Inductor keeps their buffers until here, and the tensors this join must come after."""
    if dw.is_cuda:
        torch.cuda.current_stream(dw.device).wait_stream(aux_stream(dw.device))
    return dw.clone()


@conv_weight_grad_join.register_fake
def _(dw, keep):
    return torch.empty_like(dw)


def _match(node) -> bool:
    if node.op != "call_function" or node.target is not aten.convolution_backward.default or node.kwargs:
        return False
    mask = node.args[10] if len(node.args) > 10 else None
    return mask is not None and [bool(m) for m in mask] == [True, True, False]


def split_conv_backwards(graph: torch.fx.Graph, join: str = "conv") -> int:
    """Replace, in place, each ``convolution_backward`` of ``graph`` that computes the input and
    weight gradients (and no bias gradient). ``join="conv"``: by :func:`conv_backward_two_streams`.
    ``join="next"``: by :func:`conv_weight_grad_start` and the input gradient alone, with
    :func:`conv_weight_grad_join` placed after the next such convolution's input gradient (or
    before the first use of the weight gradient, or before the graph's output, whichever
    comes first). Returns how many were replaced."""
    import operator
    if join not in JOINS:
        raise ValueError(f"runtime.backward_join: {join!r}; choose from {', '.join(JOINS)}")
    n = 0
    pending = None  # join=next: (start, [tensors to keep], the weight gradient's getitem, its value)

    def flush(before, extra=()):
        start, keep, dw_item, val = pending
        with graph.inserting_before(before):
            joined = graph.call_function(torch.ops.tr_hydra.conv_weight_grad_join.default, (start, keep + list(extra)))
        if val is not None:
            joined.meta["val"] = val
        if dw_item is not None:
            dw_item.replace_all_uses_with(joined)
            graph.erase_node(dw_item)

    for node in list(graph.nodes):
        if pending is not None and (node.op == "output" or (pending[2] is not None and node in pending[2].users)):
            flush(node)
            pending = None
        if not _match(node):
            continue
        val = node.meta.get("val")
        args = tuple(node.args[:10])
        if join == "conv":
            with graph.inserting_before(node):
                new = graph.call_function(torch.ops.tr_hydra.conv_backward_two_streams.default, args)
            new.meta.update(node.meta)
            if val is not None:
                new.meta["val"] = (val[0], val[1])
            node.replace_all_uses_with(new)
            graph.erase_node(node)
            n += 1
            continue
        items = {u.args[1]: u for u in node.users if u.target is operator.getitem}
        with graph.inserting_before(node):
            start = graph.call_function(torch.ops.tr_hydra.conv_weight_grad_start.default, args)
            dgrad = graph.call_function(aten.convolution_backward.default, args + ([True, False, False],))
            dx = graph.call_function(operator.getitem, (dgrad, 0))
        if val is not None:
            start.meta["val"], dgrad.meta["val"], dx.meta["val"] = val[1], (val[0], None, None), val[0]
        if pending is not None:  # the previous weight gradient joins after this input gradient
            flush(node, [dx])
        if 0 in items:
            items[0].replace_all_uses_with(dx)
            graph.erase_node(items[0])
        dw_item = items.get(1)
        if dw_item is not None:  # detached from the node until its join replaces it
            dw_item.args = (start, 1)
        pending = (start, [args[0], args[1], dx], dw_item, val[1] if val is not None else None)
        graph.erase_node(node)
        n += 1
    if pending is not None:  # a graph without an output node: not expected from Inductor
        raise RuntimeError("runtime.backward_join=next: a weight gradient was left without its join")
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
        Inductor's cache key, so a cached graph made without the pass, or with the other join,
        is not reused with it."""

        def __init__(self, join: str):
            self.join = join

        def __call__(self, graph: torch.fx.Graph) -> None:
            split_conv_backwards(graph, self.join)

        def uuid(self):
            return f"tr_hydra.split_conv_backward.v1.{self.join}"

        def __eq__(self, other):
            return type(other).__name__ == type(self).__name__ and other.uuid() == self.uuid()

        def __hash__(self):
            return hash(self.uuid())

    return SplitConvBackward


_PASSES: dict = {}


def inductor_pass(join: str = "conv"):
    """The pass object for ``join`` (one per process: equal settings compare equal)."""
    if join not in JOINS:
        raise ValueError(f"runtime.backward_join: {join!r}; choose from {', '.join(JOINS)}")
    if join not in _PASSES:
        _PASSES[join] = _pass_class()(join)
    return _PASSES[join]


def inductor_options_for(streams: int, options: dict, join: str = "conv") -> dict:
    """``options`` with the pass added when ``streams`` is 2 (``runtime.inductor_options``
    cannot set the pass: plan_config refuses the name)."""
    if streams == 1:
        return options
    return dict(options, post_grad_custom_post_pass=inductor_pass(join))
