"""Optimizer updates over whole spans, table-driven: one rule per optimizer, shared by the bias
span and the weight span (they differ only in which weight-decay scalar they read).

Each rule computes new values out of place; ``apply_update`` writes them back, or keeps the old
values where the gate (fp16 found_inf) is set, so a skipped step leaves weights and optimizer
state untouched.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from tr_hydra.ops.range_ops import BLOCK, Segments


@dataclass
class HyperScalars:
    """Device scalars of shape [1] (views into S_SCALAR_FP32)."""
    lr: torch.Tensor
    momentum: torch.Tensor
    beta1_complement: torch.Tensor  # 1 - beta1, rounded to fp32 from the exact value
    beta2_complement: torch.Tensor
    eps: torch.Tensor
    step: torch.Tensor
    trust_coefficient: torch.Tensor


Rule = Callable[..., tuple[torch.Tensor, tuple[torch.Tensor, ...]]]


def _sgd(w, g, st, h, wd, **_):
    return w - h.lr * (g + wd * w), ()


def _momentum(w, g, st, h, wd, **_):
    m = st[0] * h.momentum + (g + wd * w)
    return w - h.lr * m, (m,)


def _nesterov(w, g, st, h, wd, **_):
    d = g + wd * w
    m = st[0] * h.momentum + d
    return w - h.lr * (d + h.momentum * m), (m,)


def _adam(w, g, st, h, wd, decoupled=False, **_):
    m, v = st
    if decoupled:
        w = w * (1.0 - h.lr * wd)
    else:
        g = g + wd * w
    # 1 - beta from its own scalar and 1 - beta**step as -expm1(step * log1p(-(1 - beta))):
    # in fp32, 1 - 0.999 is 5e-5 off and 1 - 0.999**step cancels, which costs Adam ten times
    # torch.optim's rounding (it computes them in double on the host)
    m = torch.lerp(m, g, h.beta1_complement)
    v = v * (1.0 - h.beta2_complement) + h.beta2_complement * g * g
    bc1 = -torch.expm1(h.step * torch.log1p(-h.beta1_complement))
    bc2 = -torch.expm1(h.step * torch.log1p(-h.beta2_complement))
    denom = v.sqrt() / bc2.sqrt() + h.eps
    return w - (h.lr / bc1) * (m / denom), (m, v)


def _adamw(w, g, st, h, wd, **kw):
    return _adam(w, g, st, h, wd, decoupled=True)


def _lars(w, g, st, h, wd, segments: Segments, norms: torch.Tensor, **_):
    """Per-tensor trust ratio tc*|w| / (|g| + wd*|w| + eps) (1 where a norm is 0), then momentum."""
    w_norm = segments.sum_sq(w).sqrt()
    g_norm = segments.sum_sq(g).sqrt()
    trust = h.trust_coefficient * w_norm / (g_norm + wd * w_norm + h.eps)
    trust = torch.where((w_norm > 0) & (g_norm > 0), trust, torch.ones_like(trust))
    rec = norms.view(segments.count, -1)
    rec[:, 0].copy_(w_norm)
    rec[:, 1].copy_(g_norm)
    rec[:, 2].copy_(trust)
    d = ((g + wd * w).view(-1, BLOCK) * segments.expand(trust)).view(-1)
    m = st[0] * h.momentum + d
    return w - h.lr * m, (m,)


RULES: dict[str, tuple[Rule, int]] = {  # op suffix -> (rule, number of state spans)
    "SGD": (_sgd, 0), "MOMENTUM": (_momentum, 1), "NESTEROV": (_nesterov, 1),
    "ADAM": (_adam, 2), "ADAMW": (_adamw, 2), "LARS": (_lars, 1),
}


def rule_for(op: str) -> tuple[Rule, int]:
    return RULES[op.rsplit("_", 1)[1]]


def apply_update(op: str, w: torch.Tensor, g: torch.Tensor, states: Sequence[torch.Tensor],
                 h: HyperScalars, wd: torch.Tensor, gate: torch.Tensor | None = None, **extra) -> None:
    rule, n_state = rule_for(op)
    if len(states) != n_state:
        raise ValueError(f"{op} needs {n_state} state spans, got {len(states)}")
    new_w, new_states = rule(w, g, tuple(states), h, wd, **extra)
    if gate is None:
        w.copy_(new_w)
        for s, ns in zip(states, new_states):
            s.copy_(ns)
    else:
        skip = gate > 0
        w.copy_(torch.where(skip, w, new_w))
        for s, ns in zip(states, new_states):
            s.copy_(torch.where(skip, s, ns))
