"""An Inductor graph pass: a 16-bit value that several kernels read in float32 is stored in 16 bits.

Under bf16 or fp16 autocast, Inductor's decomposition of BatchNorm's backward first converts the
incoming gradient to float32 and then reads that float32 value three times (its sum, its sum
against the normalized input, and the input gradient); where a gradient feeds two BatchNorms (a
residual block's output, which reaches both the last BatchNorm of the block and the shortcut's),
one conversion has six readers. Inductor stores a value that several kernels read, and the value
it stores is the conversion's: a float32 copy of a 16-bit gradient, written once and read two or
three times, twice the bytes the gradient itself takes. ResNet-50's training backward at batch 256
kept four such activation-sized copies, 2.3 GB written and read a step (``docs/performance.md``).

This pass gives each reader a conversion of its own. The value Inductor then stores for them is
the 16-bit one, and each kernel converts as it loads, which costs nothing: float32 holds every
bf16 and fp16 value exactly, so the kernels compute on the same numbers. Inductor's choice of
what to store is unchanged, only its width; where it kept an unrounded 16-bit result in float32
(a sum of two 16-bit gradients, say), the stored value is now rounded to 16 bits, as PyTorch's
eager step rounds it.

It runs after Inductor's own passes on the post-gradient graph (``post_grad_custom_post_pass``),
so nothing merges the conversions again, and as a ``CustomGraphPass`` with a ``uuid`` so that
Inductor's caches keep working.
"""
from __future__ import annotations

import hashlib
import inspect
import sys

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

NARROW = (torch.bfloat16, torch.float16)


def _dtype(node):
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return getattr(val, "dtype", None)


def upcast_per_use(graph: torch.fx.Graph) -> int:
    """Give every reader of a 16-bit-to-float32 conversion read by more than one node a
    conversion of its own. Returns how many conversions were added."""
    convert = torch.ops.prims.convert_element_type.default
    added = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not convert or len(node.users) < 2:
            continue
        src, dtype = node.args[0], node.args[1]
        if dtype is not torch.float32 or _dtype(src) not in NARROW:
            continue
        for user in list(node.users)[1:]:
            with graph.inserting_before(user):
                own = graph.call_function(convert, (src, dtype), dict(node.kwargs))
            own.meta = dict(node.meta)
            user.replace_input_with(node, own)
            added += 1
    return added


class UpcastPerUse(CustomGraphPass):
    """:func:`upcast_per_use` as Inductor's ``post_grad_custom_post_pass``."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        upcast_per_use(graph)

    def uuid(self) -> str:
        return _SOURCE_DIGEST

    def __repr__(self) -> str:  # stable: the saved store's key holds the options' repr
        return f"UpcastPerUse({self.uuid()[:12]})"

    def __eq__(self, other) -> bool:
        return isinstance(other, UpcastPerUse)

    def __hash__(self) -> int:
        return hash(UpcastPerUse)


# the whole module's source: what the pass does (its dtypes too) keys Inductor's caches
_SOURCE_DIGEST = hashlib.sha256(inspect.getsource(sys.modules[__name__]).encode()).hexdigest()
PASS = UpcastPerUse()
