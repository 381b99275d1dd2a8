"""Plain-torch reference implementation of the range ops.

Every op takes flat views over a whole region span (resolved once by the executor) and device
scalars of shape [1]; none loops over parameters and none synchronises with the host, so all of
them run inside a captured CUDA graph. They are the CPU path and the reference the fast GPU
kernels are tested against.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK = 64  # fp32 elements per 256-byte block: no block straddles two tensors


def clear(buf: torch.Tensor) -> None:
    buf.zero_()


def d2d_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    dst.copy_(src)


def cast(dst: torch.Tensor, src: torch.Tensor, scale: torch.Tensor | None = None) -> None:
    """fp32 <-> 16-bit twin spans (element i of one is element i of the other); optional scale."""
    if scale is None:
        dst.copy_(src)
    else:
        dst.copy_(src.float() * scale)


def scale_inplace(buf: torch.Tensor, scale: torch.Tensor) -> None:
    buf.mul_(scale)


_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def swap(a: torch.Tensor, b: torch.Tensor) -> None:
    """Exchange the contents of two spans of one dtype and size, bit for bit, without a
    temporary (three XORs of their integer views): it runs after capture and allocates nothing."""
    x, y = (t.view(_SAME_SIZE_INT[t.element_size()]) for t in (a, b))
    x.bitwise_xor_(y)
    y.bitwise_xor_(x)
    x.bitwise_xor_(y)


def accum_metrics(acc: torch.Tensor, result: torch.Tensor) -> None:
    acc.add_(result)


def restore_if(dst: torch.Tensor, saved: torch.Tensor, flag: torch.Tensor) -> None:
    """dst = saved where ``flag`` (a [1] scalar) is set, else left: one pass over the span, no
    host sync (a skipped step's in-place changes undone). Give integer views for bit-exact
    copies whatever the values (NaN payloads, -0.0)."""
    torch.where(flag > 0, saved, dst, out=dst)


def nonfinite_limit(flag: torch.Tensor, count: torch.Tensor, state: torch.Tensor) -> None:
    """``trainer.max_nonfinite`` on the device, after the step's non-finite check. ``state`` =
    (limit, reached, steps since, spare): once a non-finite step brings ``count`` to the
    limit, every later step is skipped as well (``flag`` set) and counted in ``steps since``,
    not in ``count``, so the host, which reads them only at its next check, stops with the
    weights of the step the limit was reached at and knows which step that was."""
    limit, reached, since = state[0:1], state[1:2], state[2:3]
    count.addcmul_(flag, reached, value=-1.0)  # a step after the limit: not one of the counted ones
    torch.maximum(flag, reached, out=flag)
    since.add_(reached)
    torch.maximum(reached, (count >= limit).to(flag.dtype) * flag, out=reached)  # (flag: 0 or 1)


def ema_update(ema: torch.Tensor, live: torch.Tensor, decay: torch.Tensor,
               gate: torch.Tensor | None = None) -> None:
    """ema = decay * ema + (1 - decay) * live; not on a step whose ``gate`` is set (a skipped
    step: the weight of ``live`` is then 0, and ``ema`` keeps its values)."""
    weight = 1.0 - decay
    if gate is not None:
        weight = weight * (1.0 - gate)
    ema.lerp_(live, weight)


def ema_decay_at(decay: torch.Tensor, step: torch.Tensor, warmup: bool) -> torch.Tensor:
    """Decay with the usual warm-up min(decay, (1 + t) / (10 + t))."""
    if not warmup:
        return decay
    return torch.minimum(decay, (1.0 + step) / (10.0 + step))


def bn_fold(eq_bias: torch.Tensor, eq_scale: torch.Tensor, bn_bias: torch.Tensor,
            bn_weight: torch.Tensor, mean: torch.Tensor, var: torch.Tensor, eps: float) -> None:
    """Per-channel affine equivalent to eval-mode BN, over the whole BN span at once. Every
    intermediate is kept in the outputs: it runs after capture and allocates nothing."""
    torch.add(var, eps, out=eq_scale)
    eq_scale.rsqrt_().mul_(bn_weight)
    torch.mul(mean, eq_scale, out=eq_bias)
    eq_bias.neg_().add_(bn_bias)


def update_loss_scale(scale: torch.Tensor, inv_scale: torch.Tensor, tracker: torch.Tensor,
                      found_inf: torch.Tensor, growth_interval: int,
                      growth: float = 2.0, backoff: float = 0.5) -> None:
    """Dynamic loss scaling: halve on inf/NaN, double after ``growth_interval`` clean steps."""
    found = found_inf > 0
    nxt = tracker + 1
    grow = nxt >= growth_interval
    scale.copy_(torch.where(found, scale * backoff, torch.where(grow, scale * growth, scale)))
    tracker.copy_(torch.where(found | grow, torch.zeros_like(tracker), nxt))
    inv_scale.copy_(1.0 / scale)


@dataclass
class Segments:
    """Compile-time segment table of a span: the tensor index of every 64-element block."""
    block_ids: torch.Tensor  # int64 [n_blocks]
    ends: torch.Tensor       # int64 [count]: index of each tensor's last block
    count: int

    @classmethod
    def from_sizes(cls, slot_elems: list[int], device) -> "Segments":
        ids, ends, total = [], [], 0
        for i, n in enumerate(slot_elems):
            if n % BLOCK:
                raise ValueError(f"slot of {n} elements is not a multiple of {BLOCK}")
            ids += [i] * (n // BLOCK)
            total += n // BLOCK
            ends.append(total - 1)
        return cls(torch.tensor(ids, dtype=torch.int64, device=device),
                   torch.tensor(ends, dtype=torch.int64, device=device), len(slot_elems))

    def sum_sq(self, x: torch.Tensor) -> torch.Tensor:
        """Per-tensor sum of squares: block sums, then a float64 prefix sum read at segment ends
        (deterministic, unlike atomics)."""
        return self.reduce_blocks(x.float().view(-1, BLOCK).pow(2).sum(1, dtype=torch.float64))

    def reduce_blocks(self, blocks: torch.Tensor) -> torch.Tensor:
        """Per-tensor sums from float64 per-block sums (a prefix sum read at segment ends)."""
        at_end = blocks.cumsum(0).index_select(0, self.ends)
        return torch.diff(at_end, prepend=at_end.new_zeros(1)).float()

    def expand(self, per_tensor: torch.Tensor) -> torch.Tensor:
        """[count] -> [n_blocks, 1], to broadcast over a span viewed as [n_blocks, 64]."""
        return per_tensor.index_select(0, self.block_ids).unsqueeze(1)
