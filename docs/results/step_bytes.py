"""Bytes a training step's Inductor kernels move, from the Triton code Inductor generates for the
H200, without a GPU: every graph is lowered with ``cpu_backend="triton"`` (the fusion decisions
CUDA gets; 132 SMs and warp size 32 where Inductor's choices read the device) and nothing runs.
The model is prepared and bound as the trainer does on CUDA: channels-last, bf16 autocast, 16-bit
convolution and linear weights, ``inductor_map``'s options. User-written Triton kernels (max
pooling's gather) run their CPU fallbacks here and are not counted.

A kernel's bytes are Inductor's own ``kernel_num_gb`` less the in-place buffers it stores without
loading (Inductor counts those read and written). A model of the traffic, not a timing.

    python docs/results/step_bytes.py r50      # ResNet-50, batch 256
    python docs/results/step_bytes.py cifar    # CIFAR ResNet-18, batch 512
"""
import math
import pathlib
import re
import sys
from unittest import mock

import torch
import torch.nn.functional as F
from torch._inductor.runtime.hints import DeviceProperties

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
from tests.helpers import triton_code_on_cpu  # noqa: E402
from tr_hydra.compiler.analysis import find_first_convs  # noqa: E402
from tr_hydra.compiler.tuning import inductor_map  # noqa: E402
from tr_hydra.models.registry import build_model  # noqa: E402
from tr_hydra.runtime.model_prep import prepare  # noqa: E402

SIZE = {"bfloat16": 2, "float16": 2, "float32": 4, "float64": 8, "uint8": 1, "bool": 1, "int8": 1,
        "int16": 2, "int32": 4, "int64": 8}
_create = DeviceProperties.create.__func__


def _h200(cls, device):
    p = _create(cls, device)
    return p._replace(multi_processor_count=132, warp_size=32, max_threads_per_multi_processor=2048,
                      regs_per_multiprocessor=65536, cc=90, major=9) if device.type == "cpu" else p


def kernel_bytes(code):
    """{kernel: bytes} for every Triton kernel defined in ``code``."""
    out = {}
    for m in re.finditer(r"'kernel_num_gb': ([0-9.e-]+).*?\n@triton.jit\ndef (triton_\w+)\(([^)]*)\):(.*?)"
                         r"\ndef get_args\(\):\n(.*?)\n    return ", code, re.S):
        gb, name, params, body, args = m.groups()
        ptrs = [p.split(":")[0].strip() for p in params.split(",") if "ptr" in p]
        shapes = re.findall(r"rand_strided\(\(([^)]*)\), \([^)]*\), device='\w+', dtype=torch\.(\w+)\)", args)
        b = float(gb) * 1e9
        for p, (shape, dt) in zip(ptrs, shapes):
            if p.startswith("in_out_ptr") and not re.search(rf"tl\.load\({p}\b", body):
                b -= math.prod(int(s) for s in shape.split(",") if s.strip()) * SIZE.get(dt, 4)
        out[name] = b
    return out


def main(which):
    name, classes, batch, res = {"r50": ("resnet50", 1000, 256, 224), "cifar": ("resnet18_cifar", 10, 512, 32)}[which]
    model = build_model(name, classes)
    with torch.device("meta"):
        first = find_first_convs(build_model(name, classes), 3)
    prepare(model, first, torch.device("cuda"), True, "inductor", False, log=lambda s: print("prepare:", s))
    model = model.to(memory_format=torch.channels_last).train()
    for m in model.modules():  # as the arena binds them under AMP
        if isinstance(m, (torch.nn.Conv2d, torch.nn.Linear)):
            m.weight.data = m.weight.data.to(torch.bfloat16)
        if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
            m._buffers["num_batches_tracked"] = None
    runtime = type("Runtime", (), {"inductor_options": {}, "tuning": "none"})
    step = torch.compile(model, dynamic=False, options=inductor_map(runtime))
    x = torch.randn(batch, 3, res, res).to(torch.bfloat16).to(memory_format=torch.channels_last)
    y = torch.randint(0, classes, (batch,))
    outputs = []  # per graph: its outputs' metadata
    with triton_code_on_cpu(outputs, autotune_local_cache=False, benchmark_kernel=True) as codes, \
            mock.patch.object(DeviceProperties, "create", classmethod(_h200)):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = step(x)
        F.cross_entropy(logits.float(), y).backward()
    total = 0.0
    for part, code in zip(("forward", "backward"), codes):
        sizes = kernel_bytes(code)
        launched = re.findall(r"\b(triton_\w+)\.run\(", code[code.rfind("class Runner"):] if "class Runner" in code else code)
        gb = sum(sizes.get(k, 0) for k in launched) / 1e9
        total += gb
        print(f"{part}: {len(launched)} launches, {gb:.2f} GB")
    kept = [(v.numel(), str(v.dtype).replace("torch.", "")) for v in outputs[0] if isinstance(v, torch.Tensor)]
    print(f"step: {total:.2f} GB; the forward keeps {sum(n * SIZE.get(d, 4) for n, d in kept) / 2**20:,.1f} MiB "
          f"for the backward ({sum(n for n, d in kept if d == 'uint8') / 2**20:,.1f} MiB of uint8, "
          f"{sum(n for n, d in kept if d == 'bool') / 2**20:,.1f} of bool)")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "r50")
