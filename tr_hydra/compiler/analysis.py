"""Model analysis: which region each parameter/buffer belongs to, and shape propagation on the
meta device (no real compute) for every variant."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn as nn

from tr_hydra.errors import ModelMappingError
from tr_hydra.internals.dispatch import DispatchMode
from tr_hydra.ops.maxpool import GatherMaxPool2d


def _spec(v):
    if isinstance(v, torch.Tensor):
        return ("T", tuple(v.shape), tuple(v.stride()), v.dtype, v.storage_offset())
    if isinstance(v, (list, tuple)):
        return tuple(_spec(x) for x in v)
    return v


class MetaMemo(DispatchMode):
    """Meta-device runs of a model, faster: BatchNorm's meta kernels are Python decompositions
    (about 3 ms a call, most of a ResNet's meta forward), so each distinct call (its tensors'
    shapes, strides, dtypes and offsets, and its other arguments) is run once and later ones get
    fresh meta tensors of the same shapes, strides and dtypes. Only for ops that return new
    tensors (no view or alias of an input) and whose in-place effects (the running statistics)
    carry no data on the meta device."""

    OPS = ("native_batch_norm.default", "native_batch_norm_backward.default")

    def __init__(self):
        super().__init__()
        self._ops = {getattr(getattr(torch.ops.aten, o.split(".")[0]), o.split(".")[1]) for o in self.OPS}
        self._seen: dict = {}
        self.hits = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in self._ops or not all(a.device.type == "meta" for a in args if isinstance(a, torch.Tensor)):
            return func(*args, **kwargs)
        key = (func, _spec(args), _spec(tuple(sorted(kwargs.items()))))
        outs = self._seen.get(key)
        if outs is None:
            res = func(*args, **kwargs)
            self._seen[key] = tuple(_spec(r) if r is not None else None for r in res)
            return res
        self.hits += 1
        return tuple(None if o is None else torch.empty_strided(o[1], o[2], dtype=o[3], device="meta")
                     for o in outs)


@dataclass(frozen=True)
class ParamInfo:
    name: str                 # named_parameters() name, e.g. layer1.0.conv1.weight
    kind: str                 # BN_BIAS | BN_WEIGHT | FC_BIAS | FC_WEIGHT | FIRST_CONV | DEEP_CONV (param_role)
    shape: tuple[int, ...]    # PyTorch shape


@dataclass(frozen=True)
class BNInfo:
    module: str               # module name
    channels: int
    eps: float


@dataclass(frozen=True)
class ModelMap:
    params: tuple[ParamInfo, ...]
    bns: tuple[BNInfo, ...]   # in named_buffers() order
    first_convs: tuple[str, ...]


def find_first_convs(model: nn.Module, channels: int, res: int = 32) -> tuple[str, ...]:
    """Names of the convs that read the input image directly (found by a meta-device forward)."""
    hits: list[str] = []
    x = torch.empty(1, channels, res, res, device="meta")
    handles = []
    for name, m in model.named_modules():
        if isinstance(m, nn.Conv2d):
            def hook(mod, args, _name=name):
                if args and args[0] is x:
                    hits.append(_name)
            handles.append(m.register_forward_pre_hook(hook))
    try:
        was_training = model.training
        model.eval()
        with torch.no_grad():
            model(x)
        model.train(was_training)
    finally:
        for h in handles:
            h.remove()
    return tuple(hits)


# the normalisations whose affine parameters sit with BatchNorm's (BN_WEIGHT, BN_BIAS): per-channel
# vectors, in fp32, no weight decay where the optimizer excludes BN and biases
NORMS = (nn.BatchNorm2d, nn.LayerNorm)


def param_role(pname: str, p: torch.Tensor, m: nn.Module, first: tuple[str, ...]) -> str:
    """The kind of parameter ``pname`` (of module ``m``), which fixes its regions. Matrices
    (convolution and linear weights: FIRST_CONV, DEEP_CONV, FC_WEIGHT) take weight decay, the
    trust ratio and 16-bit copies; vectors (BN_WEIGHT, BN_BIAS, FC_BIAS) stay in fp32. A
    convolution's bias is a bias like a linear layer's (FC_BIAS); a normalisation's scale and
    shift are BatchNorm's (BN_WEIGHT, BN_BIAS), and so is a per-channel scale a block holds
    itself (ConvNeXt's layer scale). Anything else raises ``ModelMappingError`` naming it."""
    mod_name, _, leaf = pname.rpartition(".")
    where = f"parameter {pname} ({type(m).__name__}.{leaf}, shape {tuple(p.shape)})"
    if isinstance(m, nn.Conv2d):
        if leaf == "bias":
            return "FC_BIAS"
        if mod_name in first:
            if m.groups != 1:
                raise ModelMappingError(f"{where}: a grouped convolution over the image is not supported")
            return "FIRST_CONV"
        return "DEEP_CONV"
    if isinstance(m, nn.Linear):
        return "FC_WEIGHT" if leaf == "weight" else "FC_BIAS"
    if isinstance(m, NORMS) and leaf in ("weight", "bias"):
        if isinstance(m, nn.LayerNorm) and len(m.normalized_shape) != 1:
            raise ModelMappingError(f"{where}: LayerNorm over more than the channel dimension is not supported")
        return "BN_WEIGHT" if leaf == "weight" else "BN_BIAS"
    if isinstance(m, (nn.Conv1d, nn.Conv3d, nn.ConvTranspose2d, nn.BatchNorm1d, nn.BatchNorm3d,
                      nn.GroupNorm, nn.InstanceNorm2d, nn.Embedding)) or p.dim() == 0 or \
            sum(d != 1 for d in p.shape) > 1:
        raise ModelMappingError(f"{where} fits no region: supported are Conv2d weights and biases, Linear "
                                f"weights and biases, BatchNorm2d and LayerNorm scales and shifts, and "
                                f"per-channel scale vectors")
    return "BN_WEIGHT"


def map_model(model: nn.Module, channels: int = 3) -> ModelMap:
    """Map every parameter and buffer to a parameter kind (``param_role``); anything else is a
    compile error."""
    modules = dict(model.named_modules())
    first = find_first_convs(model, channels)
    if not first:
        raise ModelMappingError("no convolution reads the input image; tr_hydra needs a conv stem")
    params = [ParamInfo(pname, param_role(pname, p, modules[pname.rpartition(".")[0]], first), tuple(p.shape))
              for pname, p in model.named_parameters()]
    bns: list[BNInfo] = []
    for bname, _ in model.named_buffers():
        mod_name, _, leaf = bname.rpartition(".")
        m = modules[mod_name]
        if not isinstance(m, nn.BatchNorm2d):
            raise ModelMappingError(f"buffer {bname} fits no region (only BatchNorm2d statistics do)")
        if leaf == "running_mean":
            if m.momentum is None:
                raise ModelMappingError(f"buffer {bname}: BatchNorm with momentum=None (cumulative "
                                        f"average) is not supported")
            if not m.affine:
                raise ModelMappingError(f"module {mod_name}: BatchNorm2d without affine parameters "
                                        f"is not supported")
            bns.append(BNInfo(mod_name, m.num_features, float(m.eps)))
        elif leaf not in ("running_var", "num_batches_tracked"):
            raise ModelMappingError(f"buffer {bname} fits no region")
    for m_name, m in modules.items():
        if isinstance(m, nn.BatchNorm2d) and not m.track_running_stats:
            raise ModelMappingError(f"module {m_name}: BatchNorm2d without running statistics is not supported")
    return ModelMap(tuple(params), tuple(bns), first)


@dataclass(frozen=True)
class ShapeReport:
    logits: tuple[int, int]
    saved_activation_bytes: int   # what autograd keeps for backward (0 for validation)
    # runtime.recompute=pointwise: what the backward rematerialises on top of that at its peak. The
    # residual chain's block outputs are recomputed one from the other, so the two largest are
    # taken as alive together (for ResNet-50 the rule comes within about a tenth of the measured
    # excess over the saved set).
    recompute_transient_bytes: int = 0
    # how saved_activation_bytes was found: "eager" (what eager autograd saves: a bound where
    # Inductor compiles the step), "partitioner" (Inductor's partition, traced) or "scaled" (the
    # traced variant's ratio to its eager count, applied to this variant's)
    estimate: str = "eager"

    @property
    def activation_peak_bytes(self) -> int:
        return self.saved_activation_bytes + self.recompute_transient_bytes


# Modules whose outputs Inductor's partitioner never recomputes in the backward (convolutions,
# matrix products, pooling); with ``runtime.recompute=pointwise`` they are all it saves.
SAVED_UNDER_RECOMPUTE = (nn.Conv2d, nn.Linear, nn.MaxPool2d, nn.AvgPool2d, nn.AdaptiveAvgPool2d,
                         nn.AdaptiveMaxPool2d, GatherMaxPool2d)


def propagate(model: nn.Module, batch: int, channels: int, res: int, dtype: torch.dtype,
              train: bool, recompute: bool = False, memo: bool = True) -> ShapeReport:
    """Run the model on the meta device: output shape and bytes autograd saves for backward.
    ``recompute``: count only what is saved when pointwise results (BatchNorm, ReLU, adds) are
    recomputed in the backward: the outputs of ``SAVED_UNDER_RECOMPUTE`` modules, and the integer
    tensors ops save for their own backward."""
    x = torch.empty(batch, channels, res, res, device="meta", dtype=dtype)
    x = x.contiguous(memory_format=torch.channels_last)
    # parameters and the input live in the arena: not part of the activation pool
    arena_storages = {p.untyped_storage()._cdata for p in model.parameters()}
    arena_storages.add(x.untyped_storage()._cdata)
    storages: dict[int, int] = {}
    alive: list[torch.Tensor] = []  # keep saved tensors alive so storage keys are not reused

    kept: set[int] = set()  # storages of outputs that stay saved under recompute

    def keep(mod, args, out):
        if isinstance(out, torch.Tensor):
            kept.add(out.untyped_storage()._cdata)
            alive.append(out)
    hooks = ([m.register_forward_hook(keep) for m in model.modules() if isinstance(m, SAVED_UNDER_RECOMPUTE)]
             if recompute and train else [])

    recomputed: dict[int, int] = {}

    def pack(t: torch.Tensor):
        st = t.untyped_storage()
        # integer and bool tensors an op saves for its own backward (max pooling's offsets,
        # ReLU's packed mask) are not recomputed either
        if recompute and st._cdata not in kept and t.is_floating_point():
            if st._cdata not in arena_storages:
                recomputed[st._cdata] = max(recomputed.get(st._cdata, 0), st.nbytes())
                alive.append(t)
            return None
        if st._cdata not in arena_storages:
            storages[st._cdata] = max(storages.get(st._cdata, 0), st.nbytes())
            alive.append(t)
        return None

    was = model.training
    model.train(train)
    fast = MetaMemo() if memo else contextlib.nullcontext()
    try:
        if train:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda _: None), fast:
                out = model(x.requires_grad_(False))
        else:
            with torch.no_grad(), fast:
                out = model(x)
    finally:
        model.train(was)
        for h in hooks:
            h.remove()
    return ShapeReport(tuple(out.shape), sum(storages.values()), sum(sorted(recomputed.values())[-2:]))
