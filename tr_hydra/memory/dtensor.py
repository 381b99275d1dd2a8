"""DTensor: a pure descriptor of bytes in the arena (no memory, no pointer)."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from tr_hydra.memory.regions import Region

ALIGN = 256
TAIL_BYTES = 16  # head-room for vectorised CPU kernels


class DType(enum.Enum):
    FP32 = "fp32"
    FP16 = "fp16"  # either 16-bit type: fp16 or bf16, decided by the PlanConfig
    INT32 = "int32"
    INT8 = "int8"

    @property
    def itemsize(self) -> int:
        return {"fp32": 4, "fp16": 2, "int32": 4, "int8": 1}[self.value]


def align256(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def padded_channels(c: int, dtype: DType, region: Region) -> int:
    """Channel padding of the slot rule (DESIGN.md)."""
    if dtype is DType.FP16 and region in (Region.I_A_DATA, Region.I_B_DATA):
        mult = 4
    elif dtype is DType.FP16 and Region.F_FEATURE_FP32 <= region <= Region.F_GRAD_SLOT_FP16:
        mult = 8
    elif dtype is DType.INT8 and region is Region.S_MASK:
        mult = 8
    else:
        mult = 1
    return (c + mult - 1) // mult * mult


def slot_bytes_for(shape: tuple[int, int, int, int], dtype: DType, region: Region) -> int:
    """Bytes a tensor of logical shape (N,H,W,C) occupies in its region."""
    n, h, w, c = shape
    elems = n * h * w * padded_channels(c, dtype, region)
    if dtype is DType.FP16:
        return align256(elems * 2 + TAIL_BYTES)
    if dtype is DType.INT8:
        return align256(elems + TAIL_BYTES)
    # fp32 / int32: exactly twice the 16-bit slot, so 16-bit twins line up element for element
    return 2 * align256(elems * 2 + TAIL_BYTES)


def nhwc_strides(shape: tuple[int, int, int, int], dtype: DType, region: Region) -> tuple[int, ...]:
    n, h, w, c = shape
    cp = padded_channels(c, dtype, region)
    return (h * w * cp, w * cp, cp, 1)


@dataclass
class DTensor:
    id: int
    name: str
    shape: tuple[int, int, int, int]  # logical N,H,W,C
    dtype: DType
    region: Region
    offset: int = -1  # set by MemoryPlan.finalize()
    strides: tuple[int, ...] = field(default=())
    slot_bytes: int = 0
    # The PyTorch-side shape of the tensor this describes (e.g. O,I,kh,kw for a conv weight);
    # None for buffers that are used in their NHWC form.
    torch_shape: tuple[int, ...] | None = None
    kind: str | None = None  # parameter kind (BN_BIAS, DEEP_CONV, ...) for weight-like series

    def __post_init__(self) -> None:
        if len(self.shape) != 4 or any(int(s) < 0 for s in self.shape):
            raise ValueError(f"DTensor {self.name}: shape must be 4 non-negative ints, got {self.shape}")
        self.shape = tuple(int(s) for s in self.shape)
        if not self.strides:
            self.strides = nhwc_strides(self.shape, self.dtype, self.region)
        if not self.slot_bytes:
            self.slot_bytes = slot_bytes_for(self.shape, self.dtype, self.region)

    @property
    def numel(self) -> int:
        n, h, w, c = self.shape
        return n * h * w * c

    @property
    def nbytes(self) -> int:
        """Bytes of the (padded) elements themselves, without the tail head-room."""
        n, h, w, c = self.shape
        return n * h * w * padded_channels(c, self.dtype, self.region) * self.dtype.itemsize
