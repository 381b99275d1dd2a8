"""Kernels and modules the step takes in place of PyTorch's own."""
from __future__ import annotations

from torch import nn


def retype(model: nn.Module, base: type, cls: type, why_not=lambda name, m: None,
           skipped: dict | None = None) -> list[str]:
    """Turn each module of ``model`` whose type is exactly ``base`` into ``cls`` in place (the
    class changes, the module and its parameters stay), unless ``why_not(name, module)`` gives a
    reason; ``skipped`` (if given) gets those, with the reason. Returns the names turned."""
    swapped = []
    for name, m in model.named_modules():
        if type(m) is not base:
            continue
        reason = why_not(name, m)
        if reason is None:
            m.__class__ = cls
            swapped.append(name)
        elif skipped is not None:
            skipped[name] = reason
    return swapped


def call_shapes(model: nn.Module, types: tuple[type, ...], res: int = 64) -> dict[str, list] | None:
    """The input shapes of every call of each module of exactly one of ``types``, from one
    forward on the meta device in eval mode (the model's own tensors stay where they are): a
    2 x C x ``res`` x ``res`` image, C being the first convolution's input channels. A module
    the forward never calls is absent; None where there is no convolution or that forward fails
    (then nothing is known about the shapes)."""
    import itertools

    import torch
    conv = next((m for m in model.modules() if isinstance(m, nn.Conv2d)), None)
    if conv is None:
        return None
    shapes: dict[str, list] = {}

    def record(mod, args, _name):
        shapes.setdefault(_name, []).append(tuple(args[0].shape) if args and isinstance(args[0], torch.Tensor)
                                            else None)
    handles = [m.register_forward_pre_hook(lambda mod, args, _n=name: record(mod, args, _n))
               for name, m in model.named_modules() if type(m) in types]
    meta = {n: torch.empty_like(t, device="meta")
            for n, t in itertools.chain(model.named_parameters(), model.named_buffers())}
    x = torch.empty(2, conv.in_channels, res, res, device="meta", dtype=conv.weight.dtype)
    was_training = model.training
    try:
        model.eval()
        with torch.no_grad():
            torch.func.functional_call(model, meta, (x,))
    except Exception:  # a model this probe cannot run: nothing is known
        return None
    finally:
        model.train(was_training)
        for h in handles:
            h.remove()
    return shapes
