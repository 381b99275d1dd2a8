"""Which of PyTorch's ops the step takes from ``tr_hydra.ops``, and the swap itself: one place
for the run and the plan alike."""
from __future__ import annotations

from torch import nn

from tr_hydra.ops import maxpool, reduced_linear, relu_mask


def swaps_step_ops(device_type: str, inductor: bool) -> bool:
    """Whether a run's step takes the ops of ``tr_hydra.ops``: on CUDA when Inductor compiles the
    step (``inductor``: ``compiler.compile.inductor_wanted``). Max pooling's backward then gathers
    (``maxpool``), ReLU's reads a one-bit mask (``relu_mask``) and a linear layer of few outputs
    is a reduction (``reduced_linear``); eager, each would cost kernels of its own."""
    return device_type == "cuda" and inductor


def swap_step_ops(model: nn.Module) -> tuple[list[str], list[str], list[str]]:
    """The modules whose computation a step that Inductor compiles on CUDA takes from
    ``tr_hydra.ops``, turned in place: max pooling with the gathering backward (``maxpool``), ReLU with the
    one-bit mask (``relu_mask``), a linear layer of few outputs as a reduction
    (``reduced_linear``). The run (``runtime.model_prep.prepare``) and the plan's estimate
    (``compiler.compile.compile_plan``) both call this, so the plan counts what the run keeps.
    Returns the names of each kind."""
    return maxpool.gather_maxpools(model), relu_mask.bitmask_relus(model), reduced_linear.reduced_linears(model)
