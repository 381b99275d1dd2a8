"""ArenaKeeper: one byte arena per device; DTensors become typed views into it."""
from __future__ import annotations

import torch
import torch.nn as nn

from tr_hydra.errors import PlanError
from tr_hydra.memory.dtensor import DTensor, DType
from tr_hydra.memory.plan import MemoryPlan
from tr_hydra.memory.regions import MATRIX_KINDS, Region


class ArenaKeeper:
    def __init__(self, plan: MemoryPlan, device: str | torch.device = "cpu",
                 half_dtype: torch.dtype = torch.bfloat16):
        if not plan.locked:
            raise PlanError("finalize() the plan before allocating its arena")
        self.plan = plan
        self.device = torch.device(device)
        self.half_dtype = half_dtype
        # allocated once, zeroed once: padding stays zero, which every range op relies on
        self.arena = torch.zeros(plan.total_bytes, dtype=torch.uint8, device=self.device)

    # ------------------------------------------------------------------ addressing
    def torch_dtype(self, dt: DType) -> torch.dtype:
        return {DType.FP32: torch.float32, DType.FP16: self.half_dtype,
                DType.INT32: torch.int32, DType.INT8: torch.int8}[dt]

    def _flat(self, offset: int, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
        # set_() rather than slicing: a slice shares the arena's autograd version counter, so an
        # in-place write anywhere in the arena (BN statistics, results) would invalidate every
        # tensor autograd saved. Each view made here has a counter of its own.
        item = torch.empty((), dtype=dtype).element_size()
        t = torch.empty(0, dtype=dtype, device=self.device)
        t.set_(self.arena.untyped_storage(), offset // item, (nbytes // item,), (1,))
        return t

    def view(self, t: DTensor, variant: str | None = None, padded: bool = False) -> torch.Tensor:
        """NHWC view of a DTensor (the variant's shape for variant-dependent tensors); with
        ``padded`` the channel padding of the slot rule is part of the view (contiguous)."""
        n, h, w, c = self.plan.shape_in(t, variant)
        cp = t.strides[2]  # padded channels
        dtype = self.torch_dtype(t.dtype)
        flat = self._flat(t.offset, n * h * w * cp * t.dtype.itemsize, dtype)
        if padded:
            return flat.view(n, h, w, cp)
        return flat.as_strided((n, h, w, c), (h * w * cp, w * cp, cp, 1))

    def torch_view(self, t: DTensor) -> torch.Tensor:
        """View in the PyTorch layout of the parameter it describes: conv weights (O,I,kh,kw) with
        channels_last strides, fc weight (O,I), vectors (C,)."""
        if t.torch_shape is None:
            raise PlanError(f"{t.name} has no PyTorch shape")
        v = self.view(t)
        if len(t.torch_shape) == 4:
            v = v.permute(0, 3, 1, 2)  # (O,kh,kw,I) -> (O,I,kh,kw), channels_last
        else:
            v = v.reshape(t.torch_shape)
        return self._standalone(v)

    def _standalone(self, v: torch.Tensor) -> torch.Tensor:
        """``v``'s bytes, sizes and strides as a tensor that is not a view (no ``_base``). A
        parameter's ``.grad`` that is a view makes Dynamo give the gradient a symbolic shape
        context of its own (PyTorch's ``_grad_context_compatible``: a view's base does not match
        the parameter's): every size, stride and offset becomes a symbol, later specialised by
        guards, which made tracing ResNet-50 3-4x slower. Bound this way, the parameter, its
        gradient and the BN statistics trace as static tensors, as a plain model's do."""
        t = torch.empty(0, dtype=v.dtype, device=self.device)
        t.set_(self.arena.untyped_storage(), v.storage_offset(), v.size(), v.stride())
        return t

    def span(self, start: Region, end: Region | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Flat view over regions start..end, blind to tensor boundaries."""
        off, nbytes = self.plan.region_range(start, end)
        if dtype is None:
            dtype = self.region_dtype(start)
        return self._flat(off, nbytes, dtype)

    def region_dtype(self, r: Region) -> torch.dtype:
        n = r.name
        if n.endswith("_FP16") or n.startswith("A_"):
            return self.half_dtype
        if n.endswith("INT32") or n.endswith("_LABEL") or n == "R_PREDICTED_LABEL":
            return torch.int32
        if n.endswith("INT8") or n == "S_MASK":
            return torch.int8
        return torch.float32

    # ------------------------------------------------------------------ binding
    def bind(self, model: nn.Module, amp: bool, ema: bool) -> None:
        """Copy the model's values into the arena and make every parameter, gradient and BN
        statistic a view of it. With AMP, conv/fc weights become 16-bit A-region leaves whose
        .grad is a G16 view; the fp32 masters stay in W."""
        plan = self.plan
        modules = dict(model.named_modules())
        with torch.no_grad():
            for name, p in model.named_parameters():
                master = plan[name]
                w = self.torch_view(master)
                w.copy_(p.detach())
                if amp and master.kind in MATRIX_KINDS:
                    a = self.torch_view(plan["amp." + name])
                    a.copy_(w)
                    p.data = a
                    p.grad = self.torch_view(plan["grad16." + name])
                else:
                    p.data = w
                    p.grad = self.torch_view(plan["grad." + name])
                if ema:
                    self.torch_view(plan["ema." + name]).copy_(w)
            for bname, buf in list(model.named_buffers()):
                mod_name, _, leaf = bname.rpartition(".")
                m = modules[mod_name]
                if leaf == "num_batches_tracked":
                    # Only used by momentum=None BN (rejected at compile); exported from the step count.
                    m._buffers[leaf] = None
                    continue
                v = self.torch_view(plan[bname])
                v.copy_(buf)
                m._buffers[leaf] = v
                if ema:
                    self.torch_view(plan["ema." + bname]).copy_(v)

    def state_dict_from_arena(self, model: nn.Module, step_count: int = 0) -> dict[str, torch.Tensor]:
        """A plain state_dict (fp32 masters, BN statistics) that the torchvision model loads."""
        plan = self.plan
        out: dict[str, torch.Tensor] = {}
        for name, _ in model.named_parameters():
            out[name] = self.torch_view(plan[name]).detach().to("cpu", copy=True).contiguous()
        for mod_name, m in model.named_modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                prefix = f"{mod_name}." if mod_name else ""
                out[prefix + "running_mean"] = self.torch_view(plan[prefix + "running_mean"]).cpu().clone()
                out[prefix + "running_var"] = self.torch_view(plan[prefix + "running_var"]).cpu().clone()
                out[prefix + "num_batches_tracked"] = torch.tensor(step_count, dtype=torch.long)
        # keep the module's own key order
        ref = [k for k in _state_keys(model)]
        return {k: out[k] for k in ref}


def _state_keys(model: nn.Module) -> list[str]:
    keys = []
    for mod_name, m in model.named_modules():
        prefix = f"{mod_name}." if mod_name else ""
        for k in m._parameters:
            if m._parameters[k] is not None:
                keys.append(prefix + k)
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            keys += [prefix + "running_mean", prefix + "running_var", prefix + "num_batches_tracked"]
    return keys

