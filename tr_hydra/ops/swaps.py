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


def swap_step_ops(model: nn.Module, skipped: dict | None = None) -> tuple[list[str], list[str], list[str]]:
    """The modules whose computation a step that Inductor compiles on CUDA takes from
    ``tr_hydra.ops``, turned in place: max pooling with the gathering backward (``maxpool``), ReLU with the
    one-bit mask (``relu_mask``), a linear layer of few outputs over (N, features) as a reduction
    (``reduced_linear``); each only where its conditions hold (each module's ``why_not``), every
    other module left as it is. The input shapes come from one meta-device forward
    (``ops.call_shapes``), taken before any swap. The run (``runtime.model_prep.prepare``) and the
    plan's estimate (``compiler.compile.compile_plan``) both call this, so the plan counts what the
    run keeps. Returns the names of each kind; ``skipped`` (if given) gets, under "maxpool",
    "relu" and "linear", each module of that type left alone, with the reason."""
    from tr_hydra.ops import call_shapes
    skipped = {} if skipped is None else skipped
    for kind in ("maxpool", "relu", "linear"):
        skipped.setdefault(kind, {})
    shapes = call_shapes(model, (nn.ReLU, nn.Linear))
    relus = relu_mask.bitmask_relus(model, shapes=shapes, skipped=skipped["relu"])
    if shapes is None:  # a linear layer's input is not known to be (N, features)
        linears = []
        skipped["linear"].update({n: "input shapes unknown" for n, m in model.named_modules() if type(m) is nn.Linear})
    else:
        linears = reduced_linear.reduced_linears(model, shapes=shapes, skipped=skipped["linear"])
    return maxpool.gather_maxpools(model, skipped=skipped["maxpool"]), relus, linears
