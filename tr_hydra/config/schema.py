"""Dataclass schemas behind every config group, registered in Hydra's ConfigStore: the one
declaration of every option (``specs`` derives their frozen twins from these).

The primary config lists ``tr_hydra_schema`` first in its defaults, so every group file is merged
into a typed node: a wrong type, an unknown key or an unknown enum value fails at compose time.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, List, Optional


class ModelName(enum.Enum):
    resnet18 = "resnet18"
    resnet34 = "resnet34"
    resnet50 = "resnet50"
    resnet18_cifar = "resnet18_cifar"
    resnet101 = "resnet101"
    resnet152 = "resnet152"
    resnext50_32x4d = "resnext50_32x4d"
    wide_resnet50_2 = "wide_resnet50_2"
    regnet_y_1_6gf = "regnet_y_1_6gf"
    mobilenet_v2 = "mobilenet_v2"
    mobilenet_v3_large = "mobilenet_v3_large"
    efficientnet_b0 = "efficientnet_b0"
    efficientnet_v2_s = "efficientnet_v2_s"
    densenet121 = "densenet121"
    convnext_tiny = "convnext_tiny"
    resnet_mini = "resnet_mini"
    convnet_mini = "convnet_mini"


class OptimizerName(enum.Enum):
    sgd = "sgd"
    momentum = "momentum"
    nesterov = "nesterov"
    adam = "adam"
    adamw = "adamw"
    lars = "lars"


class Schedule(enum.Enum):
    constant = "constant"
    step = "step"
    cosine = "cosine"
    poly = "poly"


class DataName(enum.Enum):
    synthetic = "synthetic"
    imagefolder = "imagefolder"
    arrays = "arrays"
    digits = "digits"
    shards = "shards"


class AmpDtype(enum.Enum):
    bf16 = "bf16"
    fp16 = "fp16"


class Device(enum.Enum):
    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


class CompileMode(enum.Enum):
    auto = "auto"          # inductor on CUDA, none on CPU
    none = "none"
    inductor = "inductor"


class DistMode(enum.Enum):
    none = "none"
    ddp = "ddp"


class LrScaling(enum.Enum):
    none = "none"
    linear = "linear"


class Kernels(enum.Enum):
    auto = "auto"      # Triton on CUDA, the plain-torch reference elsewhere
    torch = "torch"
    triton = "triton"




class Decode(enum.Enum):
    auto = "auto"   # shards (tr-prepare's small JPEGs) on the host given 12 threads per rank; else the GPU
    host = "host"   # DALI's CPU decoder on data.num_threads threads; the GPU only normalises
    gpu = "gpu"     # nvJPEG (DALI's mixed decoder: the host's threads and the GPU)


class Tuning(enum.Enum):
    auto = "auto"   # coordinate descent when the run is long enough to pay for it (compiler/tuning.py)
    none = "none"
    full = "full"


class Recompute(enum.Enum):
    none = "none"            # the partitioner's default: BatchNorm+ReLU outputs saved for the backward
    pointwise = "pointwise"  # pointwise results recomputed in the backward (less activation memory)







class PlanFormat(enum.Enum):
    table = "table"
    json = "json"


@dataclass
class ModelConfig:
    name: ModelName = ModelName.resnet_mini
    num_classes: int = 10
    init_from: Optional[str] = None  # path to a state_dict
    zero_init_residual: bool = False
    width: int = 16  # resnet_mini only: channels of the first stage


@dataclass
class OptimizerConfig:
    name: OptimizerName = OptimizerName.momentum
    lr: float = 0.1
    momentum: float = 0.9
    weight_decay: float = 5e-4
    betas: List[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    trust_coefficient: float = 0.001  # lars
    wd_exclude_bn_bias: bool = True
    schedule: Schedule = Schedule.cosine
    warmup_epochs: float = 0.0
    min_lr: float = 0.0          # floor of cosine / poly
    poly_power: float = 2.0      # poly
    milestones: List[float] = field(default_factory=lambda: [30.0, 60.0, 80.0])  # step, in epochs
    gamma: float = 0.1           # step


@dataclass
class DataConfig:
    name: DataName = DataName.synthetic
    root: Optional[str] = None   # imagefolder: holds train/ and val/
    path: Optional[str] = None   # arrays: .npz file
    num_classes: int = 10
    channels: int = 3
    train_size: Optional[int] = None  # None: counted from the source
    val_size: Optional[int] = None
    mean: List[float] = field(default_factory=lambda: [123.675, 116.28, 103.53])  # 0-255 scale
    std: List[float] = field(default_factory=lambda: [58.395, 57.12, 57.375])
    shuffle: bool = True
    augment: bool = True
    drop_last: bool = False
    crop_scale: List[float] = field(default_factory=lambda: [0.08, 1.0])
    crop_ratio: List[float] = field(default_factory=lambda: [0.75, 4.0 / 3.0])
    val_crop: float = 1.0        # validation: resize the shorter side to res / val_crop, center crop
    flip: bool = True            # random horizontal flip when augmenting
    cache_dir: Optional[str] = None
    skip_corrupt: bool = False
    num_threads: Any = "auto"     # DALI threads: auto (this process's share of the cores) or a count
    hw_decoder_load: Optional[float] = None  # share of JPEGs sent to the GPU's hardware decoder; null: DALI's default
    decode: Decode = Decode.auto  # where a CUDA run decodes JPEGs: auto (shards on the host given 12 threads), host or gpu


@dataclass
class VariantsConfig:
    batch_size: int = 64
    val_batch_size: int = 128
    base_res: int = 32
    lowres_res: int = 24
    lowres_epochs: int = 0
    val_res: int = 32
    train_size: Optional[int] = None  # overrides data.train_size (decides the last-batch variants)
    val_size: Optional[int] = None


@dataclass
class TrainerConfig:
    epochs: int = 2
    max_steps: Optional[int] = None
    log_every: int = 20
    label_smoothing: float = 0.0
    val_every: int = 1
    checkpoint_every: int = 1
    keep_checkpoints: int = 2
    sema_every: int = 0              # copy EMA into the live weights every N epochs (0: never)
    loss_scale: float = 65536.0      # fp16 only: initial dynamic loss scale
    loss_scale_growth_interval: int = 2000
    max_nonfinite: int = 3
    progress: bool = True
    objective: str = "val/top1"      # what tr-train returns to a sweeper: config/objective.py


@dataclass
class RuntimeConfig:
    """How the step runs; none of it changes what the step computes, up to rounding. Each field
    is documented on its line in conf/runtime/default.yaml (a test keeps the two alike)."""
    device: Device = Device.auto
    cuda_graph: bool = True
    compile: CompileMode = CompileMode.auto
    deterministic: bool = False
    warmup_steps: int = 3
    kernels: Kernels = Kernels.auto
    precompile: Any = "auto"         # auto | a count | 0
    saved_store_gb: float = 4.0      # 0: no store
    recompute: Recompute = Recompute.none
    tuning: Tuning = Tuning.auto
    inductor_options: Any = None     # a map, as torch.compile(options=...)


@dataclass
class PlanSection:
    bn_folded: bool = False
    share_grad16: bool = True  # AMP: the 16-bit gradients share the 16-bit weights' bytes (A)
    format: PlanFormat = PlanFormat.table


@dataclass
class DistConfig:
    mode: DistMode = DistMode.none
    lr_scaling: LrScaling = LrScaling.none
    base_batch: int = 256
    timeout_s: int = 600


@dataclass
class BenchConfig:
    modes: Any = "auto"   # "auto", or a list: bench.modes=[eager,reduce-overhead,tr]
    steps: int = 20
    repeats: int = 3
    warmup: int = 5
    epoch_mix: bool = False
    epoch_mix_modes: Any = "auto"
    cold: bool = False           # epoch mix: each mode in a fresh process with empty Inductor/Triton caches
    profile: bool = False
    single_buffer: bool = False  # diagnostic: tr_hydra steps one at a time on input buffer A
    data: Optional[str] = None   # a JPEG folder (train/<class>/*.jpg): measure end to end instead
    generate: int = 0            # first write this many ImageNet-sized JPEGs into bench.data
    out: Optional[str] = None


@dataclass
class PrepareConfig:
    """tr-prepare: the source is ``data``; documented in conf/prepare/default.yaml."""
    out: Optional[str] = None
    max_side: int = 320
    quality: int = 90
    shard_samples: int = 5000
    workers: Any = "auto"
    skip_corrupt: bool = False


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    variants: VariantsConfig = field(default_factory=VariantsConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    plan: PlanSection = field(default_factory=PlanSection)
    dist: DistConfig = field(default_factory=DistConfig)
    bench: BenchConfig = field(default_factory=BenchConfig)
    prepare: PrepareConfig = field(default_factory=PrepareConfig)
    recipe: Optional[Any] = None
    amp: bool = False
    amp_dtype: AmpDtype = AmpDtype.bf16
    ema: bool = False
    ema_decay: float = 0.9999
    ema_warmup: bool = True
    seed: int = 0
    resume: Optional[str] = None


def register_configs() -> None:
    """The schema, and a ``model=`` option for each of torchvision's classifiers in the model
    registry (the other models have their files in ``conf/model/``)."""
    from hydra.core.config_store import ConfigStore
    from tr_hydra.models.registry import RESIDUAL_INIT, TORCHVISION
    cs = ConfigStore.instance()
    cs.store(name="tr_hydra_schema", node=Config)
    for name in TORCHVISION:
        node = {"name": name, "num_classes": "${data.num_classes}", "init_from": None}
        if name in RESIDUAL_INIT:
            node["zero_init_residual"] = False
        cs.store(group="model", name=name, node=node)
