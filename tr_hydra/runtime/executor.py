"""StepExecutor: runs the StepProgram over the arena.

Every node is resolved once, at construction, into a closure over fixed arena views; a step is
then a walk over those closures. On CPU it runs eagerly; on CUDA the same walk is what
``CudaGraphs`` captures, one graph per variant and input buffer.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from tr_hydra.compiler.compile import Compiled, fused_wanted
from tr_hydra.compiler.fusion import grads_read_16bit
from tr_hydra.compiler.program import Node, RangeOp
from tr_hydra.internals.compile import inductor_map
from tr_hydra.memory.arena import ArenaKeeper
from tr_hydra.memory.plan import FP32_SCALARS, INT32_SCALARS, RESULT_FIELDS
from tr_hydra.memory.regions import BIAS_KINDS, MATRIX_KINDS, PARAM_KINDS, Region, series_span
from tr_hydra.ops import range_ops as ops
from tr_hydra.ops.optimizers import HyperScalars
from tr_hydra import internals
from tr_hydra.runtime import range_nodes
from tr_hydra.runtime.forwards import Forwards

R = Region
BUFFERS = ("A", "B")


def loss_and_metrics(logits, labels, classes, loss_scale, feat, dist, gslot, pred_out, result,
                     eps: float, grad_div: float) -> None:
    """Loss, d(mean loss)/d logits (times the loss scale; only when ``gslot`` is given), top-1
    and top-5 hits, written into their arena views. Plain torch: the same code runs eagerly or
    compiled by Inductor (a few fused kernels instead of twenty small ones)."""
    b, k = logits.shape
    feat.copy_(logits)
    lf = feat.float()
    y = labels.long()
    # a broadcast comparison, not scatter_: deterministic on every device
    hit = (classes.unsqueeze(0) == y.unsqueeze(1)).to(dist.dtype)
    dist.copy_(hit * (1.0 - eps) + eps / k)
    logp = F.log_softmax(lf, dim=1)
    loss_sum = -(dist * logp).sum()
    if gslot is not None:
        gslot.copy_((logp.exp() - dist) * (loss_scale / grad_div))
    pred = lf.argmax(1)
    pred_out.copy_(pred)
    top = lf.topk(min(5, k), dim=1).indices
    correct1 = (pred == y).sum()
    correct5 = (top == y.unsqueeze(1)).any(1).sum()
    count = torch.full_like(loss_sum, b)
    result.copy_(torch.stack([loss_sum, correct1.float(), correct5.float(), count]))


def _dense_order(t: torch.Tensor) -> tuple | None:
    """Dimension order from outermost to innermost in memory, or None if ``t`` has gaps."""
    dims = sorted((d for d in range(t.dim()) if t.shape[d] != 1), key=lambda d: -t.stride(d))
    expect = 1
    for d in reversed(dims):  # innermost first: each stride is the product of the sizes inside
        if t.stride(d) != expect:
            return None
        expect *= t.shape[d]
    return tuple(dims)


def _same_dense_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape, dtype and element order in memory (so flat views of both line up)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    oa = _dense_order(a)
    return oa is not None and oa == _dense_order(b)


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.as_strided((t.numel(),), (1,), t.storage_offset())


@dataclass
class StepContext:
    variant: str
    buffer: str
    logits: torch.Tensor | None = None
    extra: dict = field(default_factory=dict)


def fused_kernels(kernels: str, device_type: str):
    """``runtime.kernels`` resolved: the Triton fast path (module), or None for the plain-torch
    reference. The plan depends on it (``compile_plan(fused=...)``)."""
    if not fused_wanted(kernels, device_type):
        return None
    try:
        from tr_hydra.ops import triton_ops
    except Exception as e:  # no Triton: the reference is always there
        if kernels == "triton":
            from tr_hydra.errors import ConfigError
            raise ConfigError(f"runtime.kernels=triton: Triton is not usable here ({type(e).__name__})") from None
        return None
    return triton_ops


def input_dtype(pc, half: torch.dtype) -> torch.dtype | None:
    """The dtype the input buffers hold when it is not the compute dtype, else None.

    DALI has no bfloat16 output. So under bf16 compute, a DALI source (every source but
    ``synthetic``) writes its fp16 straight into the input buffer: same size, no staging buffer,
    no cast pass. The step's first convolution runs under autocast, which converts its input to
    bf16; with Inductor that conversion is part of the stem's first kernel (the space-to-depth
    fold), not a pass of its own. The values are the ones a cast on the copy gave."""
    if pc.amp and half == torch.bfloat16 and pc.data.name != "synthetic":
        return torch.float16
    return None


class FoldedBatchNorm(nn.Module):
    """A BatchNorm folded into a per-channel affine for validation (``plan.bn_folded``): ``x *
    scale + bias`` over arena views (W_EQ_SCALE / W_EQ_BIAS). A module of its own, not a closure
    set as the BN module's forward, so that a saved compile's guards hold no default argument
    (PyTorch 2.11 cannot load one back)."""

    def __init__(self, scale: torch.Tensor, bias: torch.Tensor):
        super().__init__()
        self.register_buffer("scale", scale, persistent=False)
        self.register_buffer("bias", bias, persistent=False)

    def forward(self, x):
        return x * self.scale.view(1, -1, 1, 1).to(x.dtype) + self.bias.view(1, -1, 1, 1).to(x.dtype)


class StepExecutor:
    def __init__(self, compiled: Compiled, arena: ArenaKeeper, model: nn.Module,
                 forwards: Forwards | None = None, dist_ctx=None, compile_loss: bool = False):
        """``forwards``: which compiled forward serves each variant (default: the model itself)."""
        self.c, self.pc, self.plan, self.arena = compiled, compiled.config, compiled.plan, arena
        self.model = model
        # one compiled graph per (variant shape, train/val), made during the warm-up before capture
        # (with runtime.inductor_options and the tuning chosen, as the model's compile)
        options = inductor_map(compiled.config.runtime)
        self.forwards = forwards if forwards is not None else Forwards(model, options=options)
        self._loss_fn = loss_and_metrics if not compile_loss else \
            torch.compile(loss_and_metrics, dynamic=False, options=options)
        from tr_hydra.runtime.distributed import SINGLE
        self.dist = dist_ctx or SINGLE
        self.device = arena.device
        self.amp = self.pc.amp
        self.fp16 = self.pc.amp and self.pc.amp_dtype == "fp16"
        # what the input buffers hold: the compute dtype, or what the source delivers when that
        # differs (DALI's fp16 under bf16 compute: ``input_dtype``)
        self.input_dtype = input_dtype(self.pc, arena.half_dtype)
        pl = self.plan

        def scalar(name):
            return arena.view(pl["scalar." + name]).view(1)

        self.s = {n: scalar(n) for n in FP32_SCALARS + INT32_SCALARS}
        self.h = HyperScalars(lr=self.s["lr"], momentum=self.s["momentum"], beta1_complement=self.s["beta1_complement"],
                              beta2_complement=self.s["beta2_complement"], eps=self.s["eps"], step=self.s["step"],
                              trust_coefficient=self.s["trust_coefficient"])
        self.result = arena.view(pl["result.step"]).view(-1)
        self.acc = {n: arena.view(pl["result." + n]).view(-1) for n in ("train", "val", "val_ema")}
        self.nonfinite_mask = arena.view(pl["mask.nonfinite_regions"]).view(-1)
        # plan.bn_folded: per BN module's name, what validation runs in its place
        self._folded = {bn.module: FoldedBatchNorm(arena.torch_view(pl["eq_scale." + bn.module]),
                                                   arena.torch_view(pl["eq_bias." + bn.module]))
                        for bn in self.c.model_map.bns} if self.pc.bn_folded else None
        self._classes = torch.arange(self.pc.model.num_classes, device=self.device)  # constant
        # backward returns the gradients (autograd.grad) and one multi-tensor copy writes them
        # into their arena views: no per-parameter AccumulateGrad kernels, no clear beforehand
        self._params = [p for p in model.parameters() if p.requires_grad]
        self._grad_views = [p.grad for p in self._params]
        if any(g is None for g in self._grad_views):
            raise ValueError("bind the model to the arena before building its executor")
        self.fused = fused_kernels(self.pc.runtime.kernels, self.device.type)
        program = compiled.program  # as the fusion pass left it for the plan's kernel choice
        if not compiled.plan.conditions.matrix_grads_fp32:
            left = [n.op for n in program.train if n.op == RangeOp.RANGE_CAST_FP16_TO_FP32.value]
            if self.fused is None or left:
                raise RuntimeError("the plan leaves the fp32 matrix gradients out, but this executor "
                                   f"would write them ({'no fused kernels' if self.fused is None else left}); "
                                   "compile the plan with the executor's kernel choice")
        self._binding = range_nodes.Binding(
            arena=arena, plan=pl, pc=self.pc, s=self.s, h=self.h, result=self.result, acc=self.acc,
            nonfinite_mask=self.nonfinite_mask, fused=self.fused, dist=self.dist,
            segments=range_nodes.lars_segments(pl, self.device) if self.pc.optimizer.name == "lars" else None,
            bn_eps=self.c.model_map.bns[0].eps if self.c.model_map.bns else 1e-5)
        checks = [range_nodes.check_layout(self._binding, n) for n in program.train
                  if n.op == RangeOp.RANGE_CHECK_NAN.value]
        self.check_regions = checks[-1].regions if checks else []  # what nonfinite_report names
        # the sum of squares of the 16-bit gradients where the step overwrites them (plan.share_grad16)
        self.grad16_sumsq = checks[-1].grad16_sumsq if checks else None
        self.train_ops = [self._resolve(n) for n in program.train]
        self.val_ops = [self._resolve(n) for n in program.val]
        self.val_prologue_ops = [self._resolve(n) for n in program.val_prologue]
        self.init_scalars()

    @property
    def grads_read_16bit(self) -> list[tuple]:
        """(fp32 gradient span left unwritten, the 16-bit span the update reads instead)."""
        return grads_read_16bit(self.c.program)

    # ------------------------------------------------------------------ views
    def input_views(self, variant: str, buffer: str, padded: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(images NHWC, labels [b]) of one input buffer in a variant's shape."""
        img = self.arena.view(self.plan[f"input_{buffer}.data"], variant, padded)
        if self.input_dtype is not None:
            img = img.view(self.input_dtype)  # the same bytes, as the source wrote them
        lab = self.arena.view(self.plan[f"input_{buffer}.label"], variant).view(-1)
        return img, lab

    def _variant_view(self, name: str, variant: str) -> torch.Tensor:
        t = self.plan[name]
        v = self.arena.view(t, variant)
        return v.view(v.shape[0], v.shape[3])

    def init_scalars(self) -> None:
        o = self.pc.optimizer
        wd = o.weight_decay
        values = {"momentum": o.momentum, "beta1_complement": 1.0 - o.betas[0], "beta2_complement": 1.0 - o.betas[1], "eps": o.eps,
                  "weight_decay": wd, "bias_weight_decay": 0.0 if o.wd_exclude_bn_bias else wd,
                  "trust_coefficient": o.trust_coefficient, "step": 0.0,
                  "loss_scale": self.pc.trainer.loss_scale if self.fp16 else 1.0,
                  "inv_loss_scale": 1.0 / self.pc.trainer.loss_scale if self.fp16 else 1.0,
                  "found_inf": 0.0, "ema_decay": self.pc.ema_decay, "nonfinite": 0.0, "skipped": 0.0,
                  "nonfinite_step": 0.0,
                  "lr": o.lr, "growth_tracker": 0, "step_count": 0}
        with torch.no_grad():
            for k, v in values.items():
                self.s[k].fill_(v)
        self.set_nonfinite_limit(self.pc.trainer.max_nonfinite)

    def set_nonfinite_limit(self, limit: int) -> None:
        """``trainer.max_nonfinite`` (at least 1) on the device; not reached yet. Its state is a
        temporary, not in checkpoints: a resumed run starts with it unreached."""
        with torch.no_grad():
            state = self.arena.view(self.plan["temp.nonfinite_limit"]).view(-1)
            state.copy_(torch.tensor([float(max(int(limit), 1)), 0.0, 0.0, 0.0], device=self.device))

    def nonfinite_limit_state(self) -> tuple[bool, int]:
        """(whether ``trainer.max_nonfinite`` was reached on the device, the steps run since:
        skipped too), one host read."""
        _, reached, since, _ = self.arena.view(self.plan["temp.nonfinite_limit"]).view(-1).tolist()
        return reached > 0, int(since)

    def set_lr(self, lr: float) -> None:
        self.s["lr"].fill_(lr)  # between steps; the captured graphs read the scalar

    # ------------------------------------------------------------------ resolution
    def _resolve(self, n: Node) -> Callable[[StepContext], None]:
        op = n.op
        if op == "read_input":
            return lambda ctx: None  # the feeder wrote the buffer; forward reads it
        if op == "forward_loss":
            return self._forward_loss
        if op == "forward_eval":
            return self._forward_eval
        if op == "backward":
            return self._backward
        if op == "advance_step":
            gated = bool(n.arg("gate"))
            step, count, found = self.s["step"], self.s["step_count"], self.s["found_inf"]
            def advance(ctx):
                inc = (1.0 - found) if gated else 1.0
                step.add_(inc)
                count.add_(inc.to(torch.int32) if gated else 1)
            return advance
        return range_nodes.bind(self._binding, n)

    def nonfinite_report(self) -> str:
        """Where the first non-finite value was seen (read on demand, one host transfer)."""
        mask = self.nonfinite_mask[:len(self.check_regions)].tolist()
        names = [r.name for r, m in zip(self.check_regions, mask) if m]
        step = int(self.scalar("nonfinite_step"))
        where = ", ".join("loss" if n == "R_RESULT" else n for n in names) or "unknown"
        return f"first at step {step} in {where}"

    # ------------------------------------------------------------------ compute nodes
    def _model_input(self, ctx: StepContext):
        img, lab = self.input_views(ctx.variant, ctx.buffer)
        return img.permute(0, 3, 1, 2), lab

    def _autocast(self):
        if not self.amp:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.arena.half_dtype)

    def _loss_metrics(self, ctx: StepContext, logits: torch.Tensor, labels: torch.Tensor, train: bool):
        b, k = logits.shape
        eps = self.pc.trainer.label_smoothing if train else 0.0
        gslot = self._variant_view("grad_slot0", ctx.variant) if train else None
        with torch.no_grad():
            self._loss_fn(logits.detach(), labels, self._classes, self.s["loss_scale"],
                          self._variant_view("logits", ctx.variant),
                          self._variant_view("temp.label_dist", ctx.variant), gslot,
                          self.arena.view(self.plan["predicted_label"], ctx.variant).view(-1),
                          self.result, eps, float(b * self.dist.world_size))

    def _forward_loss(self, ctx: StepContext) -> None:
        x, y = self._model_input(ctx)
        with self._autocast():
            logits = self.forwards.for_variant(ctx.variant, x)(x)
        self._loss_metrics(ctx, logits, y, train=True)
        ctx.logits = logits

    def _backward(self, ctx: StepContext) -> None:
        logits, ctx.logits = ctx.logits, None
        grads = torch.autograd.grad(logits, self._params, self._variant_view("grad_slot0", ctx.variant),
                                    allow_unused=True)
        # flat views, one list per dtype: _foreach_copy_ takes its multi-tensor fast path only
        # when every tensor has the same dtype and layout (else it copies tensor by tensor)
        groups: dict[torch.dtype, tuple[list, list]] = {}
        for v, g in zip(self._grad_views, grads):
            if g is None:  # a parameter this variant does not use
                v.zero_()
            elif _same_dense_layout(v, g):
                dst, src = groups.setdefault(g.dtype, ([], []))
                dst.append(_flat(v))
                src.append(_flat(g))
            else:
                v.copy_(g)
        for dst, src in groups.values():
            torch._foreach_copy_(dst, src)

    def _forward_eval(self, ctx: StepContext) -> None:
        x, y = self._model_input(ctx)
        with torch.no_grad(), self._autocast():
            logits = self.forwards.for_variant(ctx.variant, x)(x)
            self._loss_metrics(ctx, logits, y, train=False)

    # ------------------------------------------------------------------ steps
    def train_step(self, variant: str, buffer: str = "A") -> None:
        ctx = StepContext(variant, buffer)
        # a first launch tunes its kernels or not, each where it pays over the run's steps
        with internals.variant_step(self.pc.tunes(variant), self.pc.steps_to_pay(variant)):
            for fn in self.train_ops:
                fn(ctx)

    def val_step(self, variant: str, buffer: str = "A", into: str = "val") -> None:
        ctx = StepContext(variant, buffer, extra={"into": into})
        with torch.no_grad(), internals.variant_step(self.pc.tunes(variant), self.pc.steps_to_pay(variant)):
            for fn in self.val_ops:
                fn(ctx)

    def before_validation(self) -> None:
        with torch.no_grad():
            for fn in self.val_prologue_ops:
                fn(StepContext("", "A"))

    @contextlib.contextmanager
    def folded(self):
        """Validation with each BN module replaced by the per-channel affine in W_EQ_SCALE /
        W_EQ_BIAS (:class:`FoldedBatchNorm`), put back on leaving."""
        if self._folded is None:
            yield
            return
        modules = dict(self.model.named_modules())
        saved = []  # (parent module, attribute, the BN module)
        for name, folded in self._folded.items():
            parent, _, child = name.rpartition(".")
            saved.append((modules[parent], child, modules[name]))
            setattr(modules[parent], child, folded)
        try:
            yield
        finally:
            for parent, child, bn in saved:
                setattr(parent, child, bn)

    # ------------------------------------------------------------------ EMA and metrics
    @contextlib.contextmanager
    def ema_weights(self):
        """Run the live model with the EMA weights (and EMA BN statistics), then swap back."""
        a = self.arena
        with torch.no_grad():
            pairs = [(a.span(R.B_PREV_MEAN, R.B_PREV_VAR), a.span(R.B_NEXT_MEAN, R.B_NEXT_VAR))]
            if self.amp:
                # 16-bit EMA twins (E16) stand in for the compute weights (A)
                ops.cast(a.span(*series_span("E16", MATRIX_KINDS)), a.span(*series_span("E", MATRIX_KINDS)))
                pairs.append((a.span(*series_span("A", MATRIX_KINDS)), a.span(*series_span("E16", MATRIX_KINDS))))
                pairs.append((a.span(*series_span("W", BIAS_KINDS)), a.span(*series_span("E", BIAS_KINDS))))
            else:
                pairs.append((a.span(*series_span("W", PARAM_KINDS)), a.span(*series_span("E", PARAM_KINDS))))
            for x, y in pairs:
                ops.swap(x, y)
        try:
            yield
        finally:
            with torch.no_grad():
                for x, y in pairs:
                    ops.swap(x, y)

    def sema_switch(self) -> None:
        """Switch to the EMA (SEMA): the EMA weights and statistics become the live ones."""
        a = self.arena
        with torch.no_grad():
            ops.d2d_copy(a.span(*series_span("W", PARAM_KINDS)), a.span(*series_span("E", PARAM_KINDS)))
            ops.d2d_copy(a.span(R.B_PREV_MEAN, R.B_PREV_VAR), a.span(R.B_NEXT_MEAN, R.B_NEXT_VAR))
            if self.amp:
                ops.cast(a.span(*series_span("A", MATRIX_KINDS)), a.span(*series_span("W", MATRIX_KINDS)))

    def sync_bn_stats(self) -> None:
        """The mean over ranks of the running statistics (and of their EMA twins), before
        validation and checkpoints."""
        if not self.dist.backend:
            return
        from tr_hydra.runtime.distributed import all_reduce_mean
        end = R.B_NEXT_VAR if self.pc.ema else R.B_PREV_VAR
        with torch.no_grad():
            all_reduce_mean(self.dist, self.arena.span(R.B_PREV_MEAN, end))

    def read_metrics(self, name: str, reset: bool = True) -> dict[str, float]:
        """One host read of an accumulator: mean loss, top1, top5 (percent), sample count."""
        acc = self.acc[name]
        from tr_hydra.runtime.distributed import all_reduce_sum
        all_reduce_sum(self.dist, acc)  # every rank's samples
        vals = acc.tolist()
        if reset:
            acc.zero_()
        d = dict(zip(RESULT_FIELDS, vals))
        n = max(d["count"], 1.0)
        return {"loss": d["loss_sum"] / n, "top1": 100.0 * d["correct1"] / n,
                "top5": 100.0 * d["correct5"] / n, "count": d["count"]}

    def move_metrics(self, src: str, dst: str) -> None:
        """Accumulator ``src``'s samples into ``dst`` (replacing what it held), ``src`` left
        empty: validation with the EMA weights runs the same steps as without, which
        accumulate into ``val``, and is read as ``val_ema``."""
        self.acc[dst].copy_(self.acc[src])
        self.acc[src].zero_()

    def scalar(self, name: str) -> float:
        return float(self.s[name].item())
