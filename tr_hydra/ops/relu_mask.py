"""ReLU whose backward reads a one-bit mask instead of a 16-bit activation.

ReLU's backward needs to know where its input was positive. Inductor's step gets that from the
ReLU's output, which the next convolution keeps for its weight gradient anyway: no memory is
added, but every kernel of the backward that applies the mask reads that 16-bit activation
again, two bytes per element, often in two kernels (BatchNorm's sums, then its input gradient).
In ResNet-50 at batch 256 that is 11 GB of the 67.5 GB its kernels move in a step, by
Inductor's count of its generated code (``docs/results/step_bytes.py``).

``BitmaskReLU`` packs the mask into bits, eight channels to a byte, in the same kernel that
computes the ReLU, and its backward reads that byte: 1/16 of the bytes. The packed mask is kept
for the backward beside what was kept before (1/16 of the activation: 293 MiB for ResNet-50 at
batch 256; its effect on peak and speed: ``docs/performance.md``).
The output is ``x`` where the mask is set and 0 elsewhere, read back through the packed mask, so
Inductor must compute the mask in the forward and keep it (a reduction it may not recompute),
where a mask used only by the backward would be recomputed there from the output. The output is
computed in the packing's loop, so the BatchNorm before it, the packing and the output are one
kernel, as BatchNorm and ``torch.relu`` are. NaN passes as ``torch.relu`` passes it (the mask is
``not x <= 0``), and the gradients are the same values, summed in another order.

Only where it applies: a 4-D input with a multiple of 8 channels that needs a gradient; anything
else takes ``torch.relu``. The swap (``bitmask_relus``) takes an ``nn.ReLU`` (exactly that type:
ReLU6 and the other activations are not) only where every call's input is such, and an in-place one
only where computing it out of place changes nothing another op reads (``inplace_unobserved``).
The bytes are laid out for channels-last activations, where eight channels are eight neighbours
in memory (tr_hydra's layout on CUDA); other layouts get the same numbers.
"""
# no ``from __future__ import annotations``: triton_op reads the signature's types as objects
import torch
from torch import nn

from tr_hydra.ops import retype


def _shifts(device) -> torch.Tensor:
    return torch.arange(8, device=device, dtype=torch.uint8)


def pack(mask: torch.Tensor) -> torch.Tensor:
    """A bool (N, C, H, W) mask as uint8 (N, H, W, C/8): bit j of byte k holds channel 8k + j."""
    n, c, h, w = mask.shape
    bits = mask.permute(0, 2, 3, 1).reshape(n, h, w, c // 8, 8).to(torch.uint8)
    return torch.bitwise_left_shift(bits, _shifts(mask.device)).sum(-1, dtype=torch.uint8)


def unpack(packed: torch.Tensor, shape) -> torch.Tensor:
    """``pack``'s inverse: the bool (N, C, H, W) mask, in channels-last strides.

    Its operations differ from the forward's (``relu_bitmask``), on purpose: shared ones would
    be merged into one node that the forward computes, and AOTAutograd's partitioner would then
    save the unpacked mask, a byte per element, rather than recompute it from the packed one."""
    n, c, h, w = shape
    values = torch.bitwise_left_shift(torch.ones((), dtype=torch.uint8, device=packed.device), _shifts(packed.device))
    bits = torch.bitwise_and(packed.unsqueeze(-1), values) != 0
    return bits.reshape(n, h, w, c).permute(0, 3, 1, 2)


@torch.library.triton_op("tr_hydra::relu_bitmask", mutates_args=())
def relu_bitmask(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ReLU of ``x``, and its mask packed (``pack``). An operator of PyTorch's own kind rather
    than an ``autograd.Function``, as ``ops.maxpool``'s: AOTAutograd's cache refuses graphs with
    the latter, and Inductor still sees the body, so it fuses it with the BatchNorm before it."""
    n, c, h, w = x.shape
    # the output is computed over the packed bytes' (N, H, W, C/8) positions times their 8 bits,
    # as the packing is: one loop, so Inductor computes both in one kernel
    x5 = x.permute(0, 2, 3, 1).reshape(n, h, w, c // 8, 8)
    packed = pack(torch.logical_not(x <= 0))
    bits = torch.bitwise_and(torch.bitwise_right_shift(packed.unsqueeze(-1), _shifts(x.device)), 1).bool()
    y = torch.where(bits, x5, torch.zeros((), dtype=x.dtype, device=x.device))
    return y.reshape(n, h, w, c).permute(0, 3, 1, 2), packed


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(output[1])
    ctx.shape = inputs[0].shape
    ctx.mark_non_differentiable(output[1])


def _backward(ctx, grad, _gpacked):
    (packed,) = ctx.saved_tensors
    return torch.where(unpack(packed, ctx.shape), grad, torch.zeros((), dtype=grad.dtype, device=grad.device))


relu_bitmask.register_autograd(_backward, setup_context=_setup_context)


def applies(x: torch.Tensor) -> bool:
    """Whether ``BitmaskReLU`` packs the mask of ``x``."""
    return x.dim() == 4 and x.shape[1] % 8 == 0 and x.requires_grad and torch.is_grad_enabled()


class BitmaskReLU(nn.ReLU):
    """``nn.ReLU`` whose backward reads a one-bit mask (see the module's docstring)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return relu_bitmask(x)[0] if applies(x) else torch.relu(x)


class _Tracer(torch.fx.Tracer):
    """torch.fx's tracer, with the modules tr_hydra swaps in (convolutions, pooling, ReLU, linear
    layers) as leaves, as the torch.nn modules they replace are."""

    OWN = ("tr_hydra.ops.", "tr_hydra.models.stem", "tr_hydra.runtime.model_prep")

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return super().is_leaf_module(m, qualname) or type(m).__module__.startswith(self.OWN)


# leaf modules whose output is a tensor of its own (never a view of, or a write into, an input)
_FRESH = (nn.modules.conv._ConvNd, nn.modules.batchnorm._BatchNorm, nn.Linear, nn.LayerNorm, nn.GroupNorm,
          nn.modules.pooling._MaxPoolNd, nn.modules.pooling._AvgPoolNd, nn.modules.pooling._AdaptiveAvgPoolNd)


def _fresh(node, modules) -> bool:
    if node.op == "call_module":
        m = modules.get(node.target)
        return isinstance(m, _FRESH) and not getattr(m, "inplace", False)
    return node.op == "call_function" and node.target in (torch.cat, torch.stack)


def _unobserved(relu, modules, order) -> bool:
    """Whether no op after the in-place ReLU call ``relu`` reads or writes its input's memory
    other than through the ReLU's output: then computing the ReLU out of place gives the same
    numbers. Every node that may share that memory (through views, in-place ops and ``+=``, which
    torch.fx records as ``+``; any op not known to return a tensor of its own) must have all its
    other users before the ReLU."""
    if len(relu.args) != 1 or relu.kwargs or not isinstance(relu.args[0], torch.fx.Node):
        return False
    seen, stack = set(), [relu.args[0]]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        for user in node.users:
            if user is relu:
                continue
            if order[user] > order[relu]:
                return False
            if not _fresh(user, modules):
                stack.append(user)  # may alias ``node``
        if not _fresh(node, modules):
            stack.extend(node.all_input_nodes)  # may alias its inputs
    return True


def inplace_unobserved(model: nn.Module) -> set[str] | None:
    """The names of the in-place ``nn.ReLU`` modules whose every call can be computed out of
    place with the same numbers (``_unobserved``), from the model's torch.fx graph; None where
    the model's code cannot be traced."""
    try:
        graph = _Tracer().trace(model)
    except Exception:  # code torch.fx cannot follow: nothing is known
        return None
    modules = dict(model.named_modules())
    order = {n: i for i, n in enumerate(graph.nodes)}
    calls: dict[str, list] = {}
    for node in graph.nodes:
        if node.op == "call_module" and type(modules.get(node.target)) is nn.ReLU and modules[node.target].inplace:
            calls.setdefault(node.target, []).append(node)
    return {name for name, nodes in calls.items() if all(_unobserved(n, modules, order) for n in nodes)}


def why_not(name: str, m: nn.ReLU, safe: set[str] | None, shapes: dict | None) -> str | None:
    """Why the ``nn.ReLU`` ``name`` keeps ``torch.relu`` (None: it is swapped). In place, the
    swap (out of place) must not change what any other op reads (``inplace_unobserved``);
    with ``shapes`` (``ops.call_shapes``) every call's input must be one ``applies`` packs."""
    if m.inplace and (safe is None or name not in safe):
        return "in place, its code not traceable" if safe is None else "in place, its input read elsewhere"
    if shapes is not None:
        calls = shapes.get(name)
        if not calls:
            return "never called"
        if not all(s is not None and len(s) == 4 and s[1] % 8 == 0 for s in calls):
            return "input not 4-D of a multiple of 8 channels"
    return None


def bitmask_relus(model: nn.Module, shapes: dict | None = None, skipped: dict | None = None) -> list[str]:
    """Turn each ``nn.ReLU`` of ``model`` that ``why_not`` accepts into ``BitmaskReLU`` in
    place. Returns their names; ``skipped`` (if given) gets the others, with the reason."""
    safe = inplace_unobserved(model) if any(type(m) is nn.ReLU and m.inplace for m in model.modules()) else set()
    return retype(model, nn.ReLU, BitmaskReLU, lambda name, m: why_not(name, m, safe, shapes), skipped)
