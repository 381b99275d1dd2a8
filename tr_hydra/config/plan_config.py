"""PlanConfig: the composed config, checked and frozen, holding all the compiler needs.

Building one only freezes and checks: what it needs from outside the config (the datasets'
sizes, the world size, this PyTorch's Inductor options) it is given as plain values
(``tr_hydra.resolve`` finds them). Nothing in here refers to Hydra; tests and tools may build a
PlanConfig by hand.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from tr_hydra.config import objective, schema
from tr_hydra.config.epochs import VariantSpec, make_variants
from tr_hydra.config.source import SourceSpec
from tr_hydra.config.specs import (DataSpec, DistSpec, ModelSpec, OptimizerSpec, RuntimeSpec, TrainerSpec,
                                   frozen, plain)
from tr_hydra.errors import ConfigError
from tr_hydra.memory.conditions import PlanConditions


@dataclass(frozen=True)
class PlanConfig:
    model: ModelSpec = field(default_factory=ModelSpec)
    optimizer: OptimizerSpec = field(default_factory=OptimizerSpec)
    data: DataSpec = field(default_factory=DataSpec)
    trainer: TrainerSpec = field(default_factory=TrainerSpec)
    runtime: RuntimeSpec = field(default_factory=RuntimeSpec)
    dist: DistSpec = field(default_factory=DistSpec)
    world_size: int = 1          # ranks; train_size / val_size are per rank
    variants: tuple[VariantSpec, ...] = ()
    batch_size: int = 64
    val_batch_size: int = 128
    lowres_epochs: int = 0
    train_size: int = 0
    val_size: int = 0
    amp: bool = False
    amp_dtype: str = "bf16"
    ema: bool = False
    ema_decay: float = 0.9999
    ema_warmup: bool = True
    bn_folded: bool = False
    share_grad16: bool = True   # AMP: the 16-bit gradient regions lie on the A regions' bytes
    seed: int = 0
    resume: str | None = None   # a checkpoint path, or "auto": the newest valid one in the run dir
    # the variants coordinate descent tunes, as runtime.tuning resolved them (compiler/tuning.py);
    # None: every variant, where runtime.tuning=full
    tuned_variants: tuple[str, ...] | None = None
    # runtime.tuning=auto: the run's steps of each tuned variant, over which each of its kernels'
    # tuning must pay (internals/tuned_kernels.py); None: every kernel large enough is tuned
    tuned_steps: tuple[int, ...] | None = None

    def describe(self) -> dict:
        """What a person recognises a plan by (named when a checkpoint does not fit)."""
        return {"model": self.model.name, "num_classes": self.model.num_classes,
                "optimizer": self.optimizer.name,
                "precision": self.amp_dtype if self.amp else "fp32", "ema": self.ema,
                "bn_folded": self.bn_folded,
                "variants": " ".join(f"{v.name}:{v.batch}x{v.res}" for v in self.variants)}

    @property
    def conditions(self) -> PlanConditions:
        return PlanConditions(optimizer=self.optimizer.name, amp=self.amp, ema=self.ema,
                              bn_folded=self.bn_folded, grad16_on_a=self.amp and self.share_grad16)

    def variant(self, name: str) -> VariantSpec:
        for v in self.variants:
            if v.name == name:
                return v
        raise KeyError(name)

    def tunes(self, variant: str) -> bool:
        """Whether coordinate descent tunes ``variant``'s kernels (``runtime.tuning`` resolved)."""
        return self.runtime.tuning == "full" and (self.tuned_variants is None or variant in self.tuned_variants)

    def steps_to_pay(self, variant: str) -> int | None:
        """The run's steps of ``variant`` over which each kernel's tuning must pay, or None (every
        kernel large enough is tuned, or the variant is not tuned)."""
        if not self.tunes(variant) or self.tuned_steps is None or self.tuned_variants is None:
            return None
        return dict(zip(self.tuned_variants, self.tuned_steps)).get(variant)

    def has_variant(self, name: str) -> bool:
        return any(v.name == name for v in self.variants)

    def source_spec(self) -> SourceSpec:
        """What a data source reads of this plan."""
        return SourceSpec(data=self.data, num_classes=self.model.num_classes, seed=self.seed,
                          epochs=self.trainer.epochs, lowres_epochs=self.lowres_epochs,
                          batch_size=self.batch_size, train_size=self.train_size, val_size=self.val_size,
                          variants=self.variants)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def fingerprint(self) -> str:
        """Hash of everything that decides the arena layout (model, precision, optimizer state,
        EMA, folding, variant shapes)."""
        key = {
            "model": dataclasses.asdict(self.model) | {"init_from": None},
            "optimizer": self.optimizer.name, "amp": self.amp, "amp_dtype": self.amp_dtype,
            "ema": self.ema, "bn_folded": self.bn_folded, "channels": self.data.channels,
            "variants": [dataclasses.asdict(v) for v in self.variants],
            "world_size": self.world_size,
        }
        return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def _check(cond: bool, key: str, msg: str) -> None:
    if not cond:
        raise ConfigError(f"{key}: {msg}")


# options that would undo what the runtime does itself: it captures the whole step as a CUDA
# graph (Inductor's own graphs inside it would be captured twice)
_OWNED_OPTIONS = {"coordinate_descent_tuning": "runtime.tuning decides it (auto, none or full)",
                  "triton.cudagraphs": "tr_hydra captures the whole step as a CUDA graph itself (runtime.cuda_graph)",
                  "triton.cudagraph_trees": "tr_hydra captures the whole step as a CUDA graph itself (runtime.cuda_graph)"}

# values that PyTorch accepts but that break a run here: (refused when, why)
_BROKEN_VALUES = {"triton.multi_kernel": (
    lambda v: v != 0,
    "with it, loading compiled kernels from Inductor's cache fails (a TypeError inside Triton's "
    "JITFunction.cache_key, PyTorch 2.11), and the parallel compiles and every later run "
    "load from that cache; leave it at 0")}


def flat_options(opts: Any, prefix: str = "") -> dict:
    """``runtime.inductor_options`` as dotted names (``{triton: {persistent_reductions: false}}``
    is ``triton.persistent_reductions``) and their values."""
    if opts is None:
        return {}
    if not isinstance(opts, Mapping):
        raise ConfigError("runtime.inductor_options: expects a map such as "
                          f"{{coordinate_descent_tuning: true}}, got {opts!r}")
    out = {}
    for k, v in opts.items():
        if isinstance(v, Mapping):
            out.update(flat_options(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def inductor_options(flat: dict, known: dict | None) -> tuple:
    """``runtime.inductor_options`` (``flat_options``) checked against ``known``, this PyTorch's
    Inductor options and their defaults: known names, values of the option's own type, none that
    would undo the runtime's own capture. Sorted pairs. ``known`` None: this PyTorch cannot list
    them, and Inductor checks them itself."""
    if not flat:
        return ()
    if known is None:
        return tuple(sorted(flat.items()))
    out = []
    for name, value in sorted(flat.items()):
        key = f"runtime.inductor_options.{name}"
        if name in _OWNED_OPTIONS:
            raise ConfigError(f"{key}: not allowed: {_OWNED_OPTIONS[name]}")
        if name not in known:
            near = [k for k in known if k.split(".")[-1] == name.split(".")[-1]]
            hint = f" (did you mean {near[0]}?)" if near else " (Inductor's list_options() lists them)"
            raise ConfigError(f"{key}: not an Inductor option of this PyTorch{hint}")
        default = known[name]
        if isinstance(default, bool):
            ok = isinstance(value, bool)
        elif isinstance(default, int):
            ok = isinstance(value, int) and not isinstance(value, bool)
        elif isinstance(default, float):
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
            value = float(value) if ok else value
        elif isinstance(default, str):
            ok = isinstance(value, str)
        elif default is None:
            ok = isinstance(value, (bool, int, float, str))
        else:
            ok = False
        if not ok:
            kind = type(default).__name__ if default is not None and isinstance(default, (bool, int, float, str)) \
                else "a value this config can express"
            raise ConfigError(f"{key}: expects {kind}, got {value!r}")
        if name in _BROKEN_VALUES and _BROKEN_VALUES[name][0](value):
            raise ConfigError(f"{key}: {value!r} not supported: {_BROKEN_VALUES[name][1]}")
        out.append((name, value))
    return tuple(out)


NO_RESUME = ("", "none", "null", "false", "no", "off")


def resume_choice(value) -> str | None:
    """``resume`` as one value: None for every spelling of "no resume" (null, false, none, off,
    ...), else ``auto`` or a checkpoint path. ``resume=true`` says neither, and is refused."""
    if value is None or value is False or str(value).strip().lower() in NO_RESUME:
        return None
    if value is True or str(value).strip().lower() == "true":
        raise ConfigError("resume: auto (the newest valid checkpoint of the run dir), a checkpoint path, "
                          "or null, got true")
    return str(value)


def refuse_added_keys(node, schema_cls, prefix: str = "") -> None:
    """Keys added with ``+`` (Hydra adds them past the schema's struct check) that no option
    of ``schema_cls`` declares. A field of a dataclass type is a section, checked key by key;
    any other field (a free-form map typed ``Any`` such as ``runtime.inductor_options``, a
    list) takes what it is given."""
    from omegaconf import DictConfig
    names = {f.name: f for f in fields(schema_cls)}
    for key in node:
        f = names.get(key)
        if f is None and not (key == "hydra" and not prefix):
            section = f"{prefix.rstrip('.')}'s" if prefix else "top-level"
            raise ConfigError(f"{prefix}{key}: not an option (+ adds only keys the schema declares; "
                              f"{section} options: {', '.join(names)})")
        if f is None:
            continue
        sub = f.default_factory() if f.default_factory is not dataclasses.MISSING else None
        if dataclasses.is_dataclass(sub):
            child = node._get_node(key)
            if isinstance(child, DictConfig) and not child._is_none() and not child._is_missing():
                refuse_added_keys(child, type(sub), f"{prefix}{key}.")


def config_object(cfg):
    """The composed config as the schema's dataclass: a DictConfig (keys added with ``+`` that no
    option declares refused) converted, the dataclass as it is."""
    from omegaconf import DictConfig, OmegaConf
    if isinstance(cfg, DictConfig):
        refuse_added_keys(cfg, schema.Config)
        cfg = OmegaConf.to_object(cfg)
    return cfg


def check_values(cfg) -> None:
    """Every option's value within what the run can take, in one line each (``cfg``: the
    schema's dataclass, ``config_object``)."""
    model, opt, data = frozen(ModelSpec, cfg.model), frozen(OptimizerSpec, cfg.optimizer), frozen(DataSpec, cfg.data)
    trainer, runtime = frozen(TrainerSpec, cfg.trainer), frozen(RuntimeSpec, cfg.runtime)
    dspec = frozen(DistSpec, cfg.dist)
    _check(dspec.base_batch >= 1, "dist.base_batch", "must be >= 1")
    v = cfg.variants
    _check(opt.lr > 0, "optimizer.lr", f"must be > 0, got {opt.lr}")
    _check(0 <= opt.momentum < 1, "optimizer.momentum", f"must be in [0, 1), got {opt.momentum}")
    _check(opt.weight_decay >= 0, "optimizer.weight_decay", f"must be >= 0, got {opt.weight_decay}")
    _check(len(opt.betas) == 2 and all(0 <= b < 1 for b in opt.betas), "optimizer.betas",
           f"must be two numbers in [0, 1), got {list(opt.betas)}")
    _check(opt.eps >= 0, "optimizer.eps", f"must be >= 0, got {opt.eps}")
    _check(opt.trust_coefficient > 0, "optimizer.trust_coefficient", "must be > 0")
    _check(opt.warmup_epochs >= 0, "optimizer.warmup_epochs", "must be >= 0")
    if opt.name == "sgd" and opt.momentum:
        raise ConfigError("optimizer.momentum: optimizer=sgd has no momentum; use optimizer=momentum")
    if opt.name in ("momentum", "nesterov", "lars"):
        _check(opt.momentum > 0, "optimizer.momentum", f"optimizer={opt.name} needs momentum > 0")
    _check(model.num_classes >= 2, "model.num_classes", f"must be >= 2, got {model.num_classes}")
    _check(model.width >= 1, "model.width", "must be >= 1")
    _check(data.channels == 3, "data.channels", f"only 3-channel images are supported, got {data.channels}")
    _check(len(data.mean) == data.channels and len(data.std) == data.channels, "data.mean/data.std",
           f"need {data.channels} values each")
    _check(all(s > 0 for s in data.std), "data.std", "must be > 0")
    _check(0 < data.val_crop <= 1, "data.val_crop", f"must be in (0, 1], got {data.val_crop}")
    _check(len(data.crop_scale) == 2 and 0 < data.crop_scale[0] <= data.crop_scale[1] <= 1,
           "data.crop_scale", f"must be [min, max] within (0, 1], got {list(data.crop_scale)}")
    _check(len(data.crop_ratio) == 2 and 0 < data.crop_ratio[0] <= data.crop_ratio[1],
           "data.crop_ratio", f"must be [min, max] > 0, got {list(data.crop_ratio)}")
    _check(model.num_classes == data.num_classes, "model.num_classes",
           f"{model.num_classes} differs from data.num_classes={data.num_classes}")
    for key in ("batch_size", "val_batch_size"):
        _check(getattr(v, key) >= 1, f"variants.{key}", f"must be >= 1, got {getattr(v, key)}")
    for key in ("base_res", "lowres_res", "val_res"):
        _check(getattr(v, key) >= 8, f"variants.{key}", f"must be >= 8 pixels, got {getattr(v, key)}")
    _check(v.lowres_epochs >= 0, "variants.lowres_epochs", "must be >= 0")
    if v.lowres_epochs > 0:
        _check(v.lowres_res <= v.base_res, "variants.lowres_res",
               f"{v.lowres_res} must not exceed variants.base_res={v.base_res}")
    _check(trainer.epochs >= 1, "trainer.epochs", f"must be >= 1, got {trainer.epochs}")
    _check(v.lowres_epochs <= trainer.epochs, "variants.lowres_epochs",
           f"{v.lowres_epochs} exceeds trainer.epochs={trainer.epochs}")
    _check(trainer.val_every >= 1, "trainer.val_every", "must be >= 1")
    _check(trainer.checkpoint_every >= 0, "trainer.checkpoint_every", "must be >= 0 (0: only at the end)")
    _check(trainer.keep_checkpoints >= 1, "trainer.keep_checkpoints", "must be >= 1")
    _check(trainer.max_nonfinite >= 1, "trainer.max_nonfinite", "must be >= 1")
    _check(trainer.loss_scale_growth_interval >= 1, "trainer.loss_scale_growth_interval", "must be >= 1")
    _check(trainer.sema_every >= 0, "trainer.sema_every", "must be >= 0")
    _check(runtime.warmup_steps >= 0, "runtime.warmup_steps", "must be >= 0")
    _check(runtime.saved_store_gb >= 0, "runtime.saved_store_gb",
           f"must be a size in GB >= 0 (0: no store), got {runtime.saved_store_gb!r}")
    _check(runtime.precompile == "auto" or (isinstance(runtime.precompile, int)
                                            and not isinstance(runtime.precompile, bool)
                                            and runtime.precompile >= 0),
           "runtime.precompile", f"must be auto or a number of processes >= 0 (0: off), got {runtime.precompile!r}")
    _check(data.num_threads == "auto" or (isinstance(data.num_threads, int) and not isinstance(data.num_threads, bool)
                                          and data.num_threads >= 1),
           "data.num_threads", f"must be auto or >= 1, got {data.num_threads!r}")
    _check(data.hw_decoder_load is None or 0.0 <= data.hw_decoder_load <= 1.0,
           "data.hw_decoder_load", f"must be null or in [0, 1], got {data.hw_decoder_load!r}")
    if opt.name in ("adam", "adamw"):
        _check(opt.eps > 0, "optimizer.eps", f"optimizer={opt.name} needs eps > 0")
    _check(trainer.max_steps is None or trainer.max_steps >= 1, "trainer.max_steps", "must be >= 1 or null")
    _check(trainer.log_every >= 1, "trainer.log_every", "must be >= 1")
    _check(0 <= trainer.label_smoothing < 1, "trainer.label_smoothing", "must be in [0, 1)")
    _check(trainer.loss_scale > 0, "trainer.loss_scale", "must be > 0")
    objective.check(trainer.objective, bool(cfg.ema))
    _check(0 < cfg.ema_decay < 1, "ema_decay", f"must be in (0, 1), got {cfg.ema_decay}")


def plan_config_from(cfg, *, train_size: int, val_size: int, world_size: int = 1,
                     inductor_options: tuple | None = None) -> PlanConfig:
    """Build a PlanConfig from a composed config (DictConfig or the schema dataclass) and what
    it needs from outside the config, as plain values: the datasets' sizes (``train_size``,
    ``val_size``: whole splits), the ranks (``world_size``) and ``runtime.inductor_options``
    checked against Inductor (``inductor_options``; None: the config's own, unchecked). Reads no
    file and no environment. Every rank sees floor(N / world_size) samples per epoch, so all
    ranks compile the same plan."""
    cfg = config_object(cfg)
    check_values(cfg)
    if inductor_options is None:
        inductor_options = tuple(sorted(flat_options(cfg.runtime.inductor_options).items()))
    model, opt, data = frozen(ModelSpec, cfg.model), frozen(OptimizerSpec, cfg.optimizer), frozen(DataSpec, cfg.data)
    trainer, dspec = frozen(TrainerSpec, cfg.trainer), frozen(DistSpec, cfg.dist)
    runtime = dataclasses.replace(frozen(RuntimeSpec, cfg.runtime), inductor_options=tuple(inductor_options))
    v = cfg.variants
    if world_size > 1:
        if train_size < world_size or val_size < world_size:
            raise ConfigError(f"dist: {train_size} train / {val_size} val samples cannot be shared by "
                              f"{world_size} ranks")
        train_size, val_size = train_size // world_size, val_size // world_size
    variants = make_variants(train_size=train_size, val_size=val_size, batch_size=v.batch_size,
                             val_batch_size=v.val_batch_size, base_res=v.base_res,
                             lowres_res=v.lowres_res, lowres_epochs=v.lowres_epochs,
                             val_res=v.val_res, drop_last=data.drop_last)
    return PlanConfig(model=model, optimizer=opt, data=data, trainer=trainer, runtime=runtime,
                      dist=dspec, world_size=world_size,
                      variants=variants, batch_size=v.batch_size, val_batch_size=v.val_batch_size,
                      lowres_epochs=v.lowres_epochs, train_size=train_size, val_size=val_size,
                      amp=bool(cfg.amp), amp_dtype=plain(cfg.amp_dtype), ema=bool(cfg.ema),
                      ema_decay=float(cfg.ema_decay), ema_warmup=bool(cfg.ema_warmup),
                      bn_folded=bool(cfg.plan.bn_folded),
                      share_grad16=bool(cfg.plan.share_grad16), seed=int(cfg.seed),
                      resume=resume_choice(cfg.resume))
