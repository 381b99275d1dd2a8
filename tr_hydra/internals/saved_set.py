"""What Inductor's compiled step keeps for the backward, found without a GPU.

AOTAutograd traces the forward and backward together, Inductor's joint-graph passes rewrite that
graph, and the min-cut partitioner then decides which forward values are saved and which the
backward recomputes. Eager autograd saves far more for blocks of depthwise convolutions,
BatchNorm and ReLU6 or SiLU, so its count is only a bound there. ``saved_bytes`` runs the same
trace, passes and partition on fake tensors (shapes only, on the CPU) and sums the bytes of the
forward's saved outputs that are not its inputs (parameters and the batch live in the arena).

Private APIs used, all within ``saved_bytes``: ``torch._subclasses.fake_tensor`` (FakeTensorMode,
FakeTensor), ``torch._functorch.aot_autograd.aot_function``,
``torch._functorch.partitioners.min_cut_rematerialization_partition``,
``torch._inductor.decomposition.select_decomp_table``,
``torch._inductor.fx_passes.joint_graph.joint_graph_passes`` and ``torch._inductor.virtualized.V``.
"""
from __future__ import annotations

import torch
from torch import nn


def saved_bytes(model: nn.Module, batch: int, channels: int, res: int, dtype: torch.dtype,
                options: dict | None = None) -> int:
    """Bytes the training forward of ``model`` (on the meta device, in ``dtype``, its step ops
    already swapped as the run swaps them) saves for its backward when Inductor compiles it, for
    a channels-last batch of ``batch`` images of ``res`` pixels. ``options``: the partitioner's
    options the run compiles with (``recompute.partitioner_options``). Raises whatever the trace
    raises: the caller keeps its own estimate then."""
    from torch._functorch import config as fconfig
    from torch._functorch.aot_autograd import aot_function
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch._inductor.decomposition import select_decomp_table
    from torch._inductor.fx_passes.joint_graph import joint_graph_passes
    from torch._inductor.virtualized import V
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    # fake CPU tensors: a fake CUDA tensor needs a CUDA context, which a plan must not need
    params = {k: FakeTensor(mode, p.detach(), torch.device("cpu")) for k, p in model.named_parameters()}
    buffers = {k: FakeTensor(mode, b, torch.device("cpu")) for k, b in model.named_buffers()}
    found: list[int] = []

    def forward_compiler(gm, _inputs):
        found.append(_saved_output_bytes(gm))
        return gm

    def partition(gm, joint_inputs, **kw):
        with V.set_fake_mode(mode):
            joint_graph_passes(gm)
        return min_cut_rematerialization_partition(gm, joint_inputs, compiler="inductor", **kw)

    def step(p, b, x):
        return torch.func.functional_call(model, (p, b), (x,))

    was = model.training
    model.train(True)
    try:
        with fconfig.patch(**(options or {})), mode:
            x = torch.empty(batch, channels, res, res, dtype=dtype).contiguous(memory_format=torch.channels_last)
            for p in params.values():
                p.requires_grad_(True)
            traced = aot_function(step, fw_compiler=forward_compiler, bw_compiler=lambda gm, _: gm,
                                  partition_fn=partition, decompositions=select_decomp_table())
            traced(params, buffers, x)
    finally:
        model.train(was)
    if not found:
        raise RuntimeError("the partitioner produced no forward graph")
    return found[0]


def _saved_output_bytes(gm) -> int:
    """Bytes of the forward graph's outputs that are not its inputs, each counted once by its
    extent (shape and strides): what the backward reads, plus the model's outputs and the new
    BatchNorm statistics, which are small beside it."""
    nodes = list(gm.graph.nodes)
    inputs = {n for n in nodes if n.op == "placeholder"}
    outputs = next(n for n in nodes if n.op == "output").args[0]
    seen, total = set(), 0
    for node in outputs:
        if not isinstance(node, torch.fx.Node) or node in inputs or node in seen:
            continue
        seen.add(node)
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor) and val.numel():
            extent = 1 + sum((s - 1) * st for s, st in zip(val.shape, val.stride()))
            total += extent * val.element_size()
    return total
