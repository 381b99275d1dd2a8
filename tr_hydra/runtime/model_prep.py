"""Getting a model ready to run from the arena: initial weights, the stem's and max pooling's
fast forms on CUDA, CPU compute format, deterministic pooling."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from tr_hydra.errors import ConfigError


def load_init(model: torch.nn.Module, path: str) -> None:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"model.init_from: {path} is not a file")
    try:
        sd = torch.load(p, map_location="cpu", weights_only=True)
    except Exception as e:  # a corrupt or non-tensor file
        raise ConfigError(f"model.init_from: {path} is not a loadable state_dict ({type(e).__name__})") from None
    if isinstance(sd, dict) and "state_dict" in sd and isinstance(sd["state_dict"], dict):
        sd = sd["state_dict"]
    try:
        model.load_state_dict(sd, strict=True)
    except RuntimeError as e:
        first = str(e).strip().splitlines()
        raise ConfigError(f"model.init_from: {path} does not fit the model: {first[1].strip() if len(first) > 1 else first[0]}") from None


class NCHWConv2d(torch.nn.Conv2d):
    """A convolution that reads a contiguous (NCHW) copy of its input and weight
    (:func:`nchw_compute_on_cpu`)."""

    def forward(self, x):
        return self._conv_forward(x.contiguous(), self.weight.contiguous(), self.bias)


def nchw_compute_on_cpu(model: torch.nn.Module) -> list[str]:
    """On CPU, convolutions and BatchNorm compute in NCHW.

    The arena keeps conv weights in channels_last (the planned layout, what cuDNN wants), but
    PyTorch's CPU channels_last kernels lose precision: on resnet18_cifar the fp32 gradients of one
    batch were 2.2e-3 (relative norm) away from float64 in channels_last and 2.3e-6 in NCHW, and
    BatchNorm on a batch with near-cancelling bias gradients 0.7% against 1e-6. So each
    ``nn.Conv2d`` becomes an :class:`NCHWConv2d` (the gradient flows back into the arena view in
    place); the stem's convolutions already compute so. CUDA keeps channels_last end to end.
    A class, not a closure set as the module's forward: a saved compile's guards would hold the
    closure's default argument, which PyTorch 2.11 cannot load back. Returns the names swapped.
    """
    from tr_hydra.ops import retype
    return retype(model, torch.nn.Conv2d, NCHWConv2d)


class GlobalAvgPool(torch.nn.Module):
    """AdaptiveAvgPool2d(1) as a mean over H and W: the same numbers, and a backward that is
    deterministic on CUDA (adaptive_avg_pool2d's is not)."""

    def forward(self, x):
        return x.mean(dim=(2, 3), keepdim=True)


def deterministic_pools(model: torch.nn.Module) -> None:
    for name, m in list(model.named_modules()):
        for child_name, child in list(m.named_children()):
            if isinstance(child, torch.nn.AdaptiveAvgPool2d) and child.output_size in (1, (1, 1)):
                setattr(m, child_name, GlobalAvgPool())


@dataclass
class Prepared:
    """What ``prepare`` changed in a model (its parameters and ``state_dict`` are untouched)."""
    stem_s2d: list[str] = field(default_factory=list)  # convolutions over the image in space-to-depth form
    stem_channels: int | None = None  # their input read zero-padded to a multiple of this many channels
    maxpools: list[str] = field(default_factory=list)  # max poolings whose backward gathers in one kernel
    relus: list[str] = field(default_factory=list)  # ReLUs whose backward reads a one-bit mask
    linears: list[str] = field(default_factory=list)  # linear layers computed as reductions, not cuBLAS
    # modules of a path's type it left alone, with the reason: "maxpool", "relu", "linear"
    skipped: dict[str, dict[str, str]] = field(default_factory=dict)
    # one line per path the device has (the stem on CUDA; the ops with Inductor there too):
    # (whether it is on, what it does or why it is off)
    notes: list[tuple[bool, str]] = field(default_factory=list)


def stem_folded(device_type: str) -> bool:
    """Whether the convolution over the image runs in space-to-depth form: on CUDA, where it was
    measured faster (on the CPU there is nothing to gain)."""
    return device_type == "cuda"


def _left(skipped: dict[str, str]) -> str:
    """Modules a path left alone, short: one by name, several counted by reason."""
    if len(skipped) == 1:
        (name, why), = skipped.items()
        return f"{name} ({why})"
    counts: dict[str, int] = {}
    for why in skipped.values():
        counts[why] = counts.get(why, 0) + 1
    return f"{len(skipped)} ({', '.join(w if len(counts) == 1 else f'{w}: {c}' for w, c in counts.items())})"


def _op_notes(out: Prepared, model: torch.nn.Module) -> list[tuple[bool, str]]:
    notes = []
    pools, relus, linears = out.skipped["maxpool"], out.skipped["relu"], out.skipped["linear"]
    def keep(left):
        return "keeps" if len(left) == 1 else "keep"
    if out.maxpools:
        notes.append((True, f"max pooling: {', '.join(out.maxpools)}'s backward gathers each input element's "
                            f"gradient in one kernel" + (f"; {_left(pools)} {keep(pools)} PyTorch's" if pools else "")))
    else:
        notes.append((False, "max pooling: off, " + (f"{_left(pools)}: PyTorch's backward" if pools
                                                      else "no nn.MaxPool2d in the model")))
    if out.relus:
        notes.append((True, f"ReLU: {len(out.relus)} modules' backward reads a one-bit mask"
                            + (f"; {_left(relus)} {keep(relus)} torch.relu" if relus else "")))
    else:
        notes.append((False, "ReLU: off, " + (f"{_left(relus)}: torch.relu" if relus else "no nn.ReLU in the model")))
    if out.linears:
        from tr_hydra.ops.reduced_linear import uses_blas
        stay = "stays a cuBLAS product" if len(linears) == 1 else "stay cuBLAS products"
        rest = (f"; {_left(linears)} {stay}" if linears
                else "" if uses_blas(model) else ": the step calls no cuBLAS product and holds no cuBLAS workspace")
        notes.append((True, f"linear: {', '.join(out.linears)} computed as a reduction Inductor compiles{rest}"))
    else:
        notes.append((False, "linear: off, " + (f"{_left(linears)}: cuBLAS" if linears else "no nn.Linear in the model")))
    return notes


def prepare(model: torch.nn.Module, first_convs, device: torch.device, amp: bool, inductor: bool,
            deterministic: bool, log=print) -> Prepared:
    """The model's computation set up for ``device``, in place; same weights, same numbers up to
    rounding. On CUDA: a stride-2 convolution over the image as a stride-1 convolution over
    2x2 blocks (``models.stem``), its input padded to 8 channels under 16-bit autocast, and,
    with Inductor, max pooling's backward as one gathering kernel (``ops.maxpool``), ReLU's
    backward reading a one-bit mask (``ops.relu_mask``) and a linear layer of few outputs as a
    reduction (``ops.reduced_linear``). Each applies only to the modules that have its pattern
    (``ops.swaps``); the log says which, and names a path that finds none "off", with why. On
    the CPU: NCHW compute. Deterministic runs get a deterministic global average pool."""
    from tr_hydra.models.stem import (image_input_recomputed, space_to_depth_stem, stem_channel_multiple,
                                      stem_off_reason)
    from tr_hydra.ops.swaps import swap_step_ops, swaps_step_ops
    out = Prepared(stem_channels=stem_channel_multiple(device.type, amp))
    if stem_folded(device.type):
        out.stem_s2d = space_to_depth_stem(model, first_convs, out.stem_channels)
        pad = (f", its input zero-padded to a multiple of {out.stem_channels} channels (16-bit autocast)"
               if out.stem_channels else "")
        out.notes.append((True, f"stem: {', '.join(out.stem_s2d)} computed as a space-to-depth convolution{pad}")
                         if out.stem_s2d else
                         (False, f"stem: off, {stem_off_reason(model, first_convs)}: plain convolution{pad}"))
    image_input_recomputed(model, first_convs, out.stem_channels)
    if swaps_step_ops(device.type, inductor):
        out.maxpools, out.relus, out.linears = swap_step_ops(model, out.skipped)
        out.notes += _op_notes(out, model)
    for _, line in out.notes:
        log(line)
    if device.type == "cpu":
        nchw_compute_on_cpu(model)
    if deterministic:
        deterministic_pools(model)
    return out
