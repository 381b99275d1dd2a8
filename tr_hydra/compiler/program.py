"""StepProgram: the ComputationGraph of one training step and one validation step.

Built once per compile and shared by every variant: COMPUTE nodes run the model, RANGE nodes run
one range op over a byte span of regions. The executor resolves spans to views once.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from tr_hydra.memory.regions import BIAS_KINDS, MATRIX_KINDS, PARAM_KINDS, Region, series_span

R = Region


class GraphId(enum.Enum):
    ZERO_GRAD = "ZERO_GRAD"
    INPUT = "INPUT"
    FORWARD = "FORWARD"
    BACKWARD = "BACKWARD"
    GRAD_ALLREDUCE = "GRAD_ALLREDUCE"
    UNSCALE_CAST = "UNSCALE_CAST"
    CHECK_NAN = "CHECK_NAN"
    OPTIMIZER = "OPTIMIZER"
    CAST_W_TO_A = "CAST_W_TO_A"
    EMA = "EMA"
    METRICS = "METRICS"


class RangeOp(enum.Enum):
    RANGE_UPDATE_BIAS_SGD = "RANGE_UPDATE_BIAS_SGD"
    RANGE_UPDATE_BIAS_MOMENTUM = "RANGE_UPDATE_BIAS_MOMENTUM"
    RANGE_UPDATE_BIAS_NESTEROV = "RANGE_UPDATE_BIAS_NESTEROV"
    RANGE_UPDATE_BIAS_ADAM = "RANGE_UPDATE_BIAS_ADAM"
    RANGE_UPDATE_WEIGHT_SGD = "RANGE_UPDATE_WEIGHT_SGD"
    RANGE_UPDATE_WEIGHT_MOMENTUM = "RANGE_UPDATE_WEIGHT_MOMENTUM"
    RANGE_UPDATE_WEIGHT_NESTEROV = "RANGE_UPDATE_WEIGHT_NESTEROV"
    RANGE_UPDATE_WEIGHT_ADAM = "RANGE_UPDATE_WEIGHT_ADAM"
    RANGE_UPDATE_WEIGHT_ADAMW = "RANGE_UPDATE_WEIGHT_ADAMW"
    RANGE_UPDATE_WEIGHT_LARS = "RANGE_UPDATE_WEIGHT_LARS"
    RANGE_EMA_PARAM_UPDATE = "RANGE_EMA_PARAM_UPDATE"
    RANGE_CLEAR = "RANGE_CLEAR"
    RANGE_D2D_COPY = "RANGE_D2D_COPY"
    RANGE_CAST_FP32_TO_FP16 = "RANGE_CAST_FP32_TO_FP16"
    RANGE_CAST_FP16_TO_FP32 = "RANGE_CAST_FP16_TO_FP32"
    RANGE_MEAN_ALLREDUCE = "RANGE_MEAN_ALLREDUCE"
    RANGE_CHECK_NAN = "RANGE_CHECK_NAN"
    RANGE_GRAD_SCALING = "RANGE_GRAD_SCALING"
    RANGE_ACCUM_METRICS = "RANGE_ACCUM_METRICS"
    RANGE_BN_FOLD = "RANGE_BN_FOLD"
    RANGE_RESTORE_IF_SKIPPED = "RANGE_RESTORE_IF_SKIPPED"
    RANGE_NONFINITE_LIMIT = "RANGE_NONFINITE_LIMIT"


Span = tuple[Region, Region]


def span_name(span: Span) -> str:
    a, b = span
    return f"{a.name}..{b.name}" if a != b else a.name


@dataclass(frozen=True)
class Node:
    graph_id: GraphId
    op: str                          # a RangeOp name, or a compute name
    spans: tuple[Span, ...] = ()     # RANGE: the spans it reads/writes, dst first
    args: tuple[tuple[str, str], ...] = ()  # scalar names / flags the op takes
    note: str = ""
    # what a fusion pass (``compiler.fusion``) merged into the node: (key, span) each
    fused: tuple[tuple[str, Span], ...] = ()

    @property
    def is_range(self) -> bool:
        return self.op.startswith("RANGE_")

    def arg(self, key: str, default: str | None = None) -> str | None:
        return dict(self.args).get(key, default)

    def fused_spans(self, key: str) -> list[Span]:
        return [s for k, s in self.fused if k == key]

    def describe(self) -> str:
        spans = "  ".join([span_name(s) for s in self.spans] + [f"{k}={span_name(s)}" for k, s in self.fused])
        kind = "RANGE  " if self.is_range else "COMPUTE"
        extra = f"  ({self.note})" if self.note else ""
        return f"{self.graph_id.value:<15} {kind} {self.op:<30} {spans}{extra}"


# optimizer -> (bias-span op, weight-span op)
UPDATE_OPS = {
    "sgd": (RangeOp.RANGE_UPDATE_BIAS_SGD, RangeOp.RANGE_UPDATE_WEIGHT_SGD),
    "momentum": (RangeOp.RANGE_UPDATE_BIAS_MOMENTUM, RangeOp.RANGE_UPDATE_WEIGHT_MOMENTUM),
    "nesterov": (RangeOp.RANGE_UPDATE_BIAS_NESTEROV, RangeOp.RANGE_UPDATE_WEIGHT_NESTEROV),
    "adam": (RangeOp.RANGE_UPDATE_BIAS_ADAM, RangeOp.RANGE_UPDATE_WEIGHT_ADAM),
    "adamw": (RangeOp.RANGE_UPDATE_BIAS_ADAM, RangeOp.RANGE_UPDATE_WEIGHT_ADAMW),
    "lars": (RangeOp.RANGE_UPDATE_BIAS_MOMENTUM, RangeOp.RANGE_UPDATE_WEIGHT_LARS),
}


@dataclass
class StepProgram:
    train: tuple[Node, ...]
    val: tuple[Node, ...]
    val_prologue: tuple[Node, ...] = field(default=())

    def describe(self) -> str:
        lines = ["train step (every train variant):"]
        lines += ["  " + n.describe() for n in self.train]
        if self.val_prologue:
            lines.append("before validation:")
            lines += ["  " + n.describe() for n in self.val_prologue]
        lines.append("validation step (every val variant):")
        lines += ["  " + n.describe() for n in self.val]
        return "\n".join(lines)


def build_program(compiled) -> StepProgram:
    """The step program of ``compiled``, one range op per node (``fusion.fuse_updates`` merges
    some for the fused kernels)."""
    pc = compiled.config
    amp, fp16 = pc.amp, pc.amp and pc.amp_dtype == "fp16"
    opt = pc.optimizer.name
    g_bias, g_mat = series_span("G", BIAS_KINDS), series_span("G", MATRIX_KINDS)
    w_bias, w_mat = series_span("W", BIAS_KINDS), series_span("W", MATRIX_KINDS)
    state = pc.conditions.state_series

    # training-mode BatchNorm updates its running statistics in place in the forward, before
    # the step knows whether it will be skipped: they are copied aside first and put back when
    # it is (the copy lives in the plan's T_TEMP_FP32, so the captured graph allocates nothing)
    bn_stats = "temp.bn_stats" in compiled.plan
    t: list[Node] = [
        Node(GraphId.ZERO_GRAD, RangeOp.RANGE_CLEAR.value, ((R.R_RESULT, R.R_RESULT),),
             note="the step's results (backward writes every gradient whole)"),
        Node(GraphId.INPUT, "read_input", ((R.I_A_LABEL, R.I_B_DATA),),
             note="I_A or I_B, filled by the feeder while the other buffer's step runs"),
    ]
    if bn_stats:
        t.append(Node(GraphId.FORWARD, RangeOp.RANGE_D2D_COPY.value,
                      ((R.T_TEMP_FP32, R.T_TEMP_FP32), (R.B_PREV_MEAN, R.B_PREV_VAR)),
                      args=(("dst", "temp.bn_stats"),),
                      note="BN running statistics kept in temp.bn_stats, for a skipped step"))
    t += [
        Node(GraphId.FORWARD, "forward_loss", ((R.F_FEATURE_FP16 if amp else R.F_FEATURE_FP32,) * 2,),
             note="model forward, logits, loss, d loss/d logits into F_GRAD_SLOT"),
        Node(GraphId.BACKWARD, "backward", (series_span("G16", MATRIX_KINDS) if amp else g_mat,),
             note="autograd.grad, then one multi-tensor copy into the .grad views"),
    ]
    # bucket 1: the deep convs; bucket 2: BN, fc and first conv (16-bit spans under AMP, whose
    # BN / bias gradients stay fp32). The loss gradient carries 1/world_size, so SUM is the mean.
    if amp:
        buckets = ((R.G_DEEP_CONV_FP16, R.G_DEEP_CONV_FP16), (R.G_FC_WEIGHT_FP16, R.G_FIRST_CONV_FP16),
                   (R.G_BN_BIAS, R.G_FC_BIAS))
    else:
        buckets = ((R.G_DEEP_CONV, R.G_DEEP_CONV), (R.G_BN_BIAS, R.G_FIRST_CONV))
    t.append(Node(GraphId.GRAD_ALLREDUCE, RangeOp.RANGE_MEAN_ALLREDUCE.value, buckets,
                  note="no-op with one process" if pc.world_size == 1 else f"{pc.world_size} ranks"))
    if amp:
        t.append(Node(GraphId.UNSCALE_CAST, RangeOp.RANGE_CAST_FP16_TO_FP32.value,
                      (g_mat, series_span("G16", MATRIX_KINDS)),
                      args=(("scale", "inv_loss_scale" if fp16 else ""),)))
    if fp16:
        t.append(Node(GraphId.UNSCALE_CAST, RangeOp.RANGE_GRAD_SCALING.value,
                      ((R.G_BN_BIAS, R.G_FC_BIAS),), args=(("scale", "inv_loss_scale"),),
                      note="unscale the fp32 BN / bias gradients"))
    # a step whose forward made the BN statistics non-finite (huge activations: their variance
    # overflows while the normalised output, loss and gradients stay finite) is skipped too.
    # With several processes each rank's statistics are its own (only the gradients are
    # reduced), so each rank's flag could differ: there, the gradients and losses alone decide
    check_b = bn_stats and pc.world_size == 1
    t.append(Node(GraphId.CHECK_NAN, RangeOp.RANGE_CHECK_NAN.value,
                  ((R.G_BN_BIAS, R.R_RESULT),) + (((R.B_PREV_MEAN, R.B_PREV_VAR),) if check_b else ()),
                  args=(("flag", "found_inf"), ("fp16", "1" if fp16 else "")),
                  note="a non-finite step is skipped: weights and state untouched"))
    if not fp16:  # (fp16 overflow is the loss-scale search, not counted against the limit)
        t.append(Node(GraphId.CHECK_NAN, RangeOp.RANGE_NONFINITE_LIMIT.value, (),
                      args=(("flag", "found_inf"), ("count", "nonfinite"), ("state", "temp.nonfinite_limit")),
                      note="once trainer.max_nonfinite is reached, every later step is skipped too "
                           "(the host stops at its next check)"))
    if bn_stats:
        t.append(Node(GraphId.CHECK_NAN, RangeOp.RANGE_RESTORE_IF_SKIPPED.value,
                      ((R.B_PREV_MEAN, R.B_PREV_VAR), (R.T_TEMP_FP32, R.T_TEMP_FP32)),
                      args=(("src", "temp.bn_stats"), ("gate", "found_inf")),
                      note="a skipped step's forward moved the BN statistics: put back"))
    bias_op, weight_op = UPDATE_OPS[opt]
    if opt == "adamw" and not pc.optimizer.wd_exclude_bn_bias:
        bias_op = RangeOp.RANGE_UPDATE_WEIGHT_ADAMW  # decoupled decay on biases too
    def opt_spans(w, g, kinds):
        spans = [w, g] + [series_span(s, kinds) for s in state if s != "N"]
        return tuple(spans)
    gate = (("gate", "found_inf"),)
    t.append(Node(GraphId.OPTIMIZER, "advance_step", (), args=(("gate", "found_inf"),),
                  note="step += 1 (not on a skipped step)"))
    t.append(Node(GraphId.OPTIMIZER, bias_op.value, opt_spans(w_bias, g_bias, BIAS_KINDS),
                  args=(("wd", "bias_weight_decay"),) + gate, note="BN weight/bias, fc bias"))
    wspans = opt_spans(w_mat, g_mat, MATRIX_KINDS)
    if opt == "lars":
        wspans += (series_span("N", MATRIX_KINDS),)
    t.append(Node(GraphId.OPTIMIZER, weight_op.value, wspans, args=(("wd", "weight_decay"),) + gate,
                  note="fc weight, first conv, deep convs"))
    if fp16:
        t.append(Node(GraphId.OPTIMIZER, RangeOp.RANGE_GRAD_SCALING.value, (),
                      args=(("update", "loss_scale"),), note="back off on inf, grow after clean steps"))
    if amp:
        t.append(Node(GraphId.CAST_W_TO_A, RangeOp.RANGE_CAST_FP32_TO_FP16.value,
                      (series_span("A", MATRIX_KINDS), w_mat)))
    if pc.ema:
        t.append(Node(GraphId.EMA, RangeOp.RANGE_EMA_PARAM_UPDATE.value,
                      (series_span("E", PARAM_KINDS), series_span("W", PARAM_KINDS)),
                      args=(("decay", "ema_decay"),) + gate, note="not on a skipped step"))
        t.append(Node(GraphId.EMA, RangeOp.RANGE_EMA_PARAM_UPDATE.value,
                      ((R.B_NEXT_MEAN, R.B_NEXT_VAR), (R.B_PREV_MEAN, R.B_PREV_VAR)),
                      args=(("decay", "ema_decay"),) + gate, note="BN statistics, not on a skipped step"))
    t.append(Node(GraphId.METRICS, RangeOp.RANGE_ACCUM_METRICS.value,
                  ((R.R_RESULT_ACCUMULATED, R.R_RESULT_ACCUMULATED), (R.R_RESULT, R.R_RESULT)),
                  args=(("into", "train"),)))

    prologue: list[Node] = []
    if pc.bn_folded:
        prologue.append(Node(GraphId.FORWARD, RangeOp.RANGE_BN_FOLD.value,
                             ((R.W_EQ_BIAS, R.W_EQ_SCALE), (R.W_BN_BIAS, R.W_BN_WEIGHT),
                              (R.B_PREV_MEAN, R.B_PREV_VAR)),
                             note="eq_scale = gamma/sqrt(var+eps), eq_bias = beta - mean*eq_scale"))
    v = [
        Node(GraphId.ZERO_GRAD, RangeOp.RANGE_CLEAR.value, ((R.R_RESULT, R.R_RESULT),)),
        Node(GraphId.INPUT, "read_input", ((R.I_A_LABEL, R.I_B_DATA),)),
        Node(GraphId.FORWARD, "forward_eval", ((R.F_FEATURE_FP16 if amp else R.F_FEATURE_FP32,) * 2,),
             note="BN folded into W_EQ_*" if pc.bn_folded else "eval-mode BN"),
        Node(GraphId.METRICS, RangeOp.RANGE_ACCUM_METRICS.value,
             ((R.R_RESULT_ACCUMULATED, R.R_RESULT_ACCUMULATED), (R.R_RESULT, R.R_RESULT)),
             args=(("into", "val"),)),
    ]
    return StepProgram(tuple(t), tuple(v), tuple(prologue))
