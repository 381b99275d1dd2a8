"""What Inductor's compiled ResNet-50 step saves for the backward on the GPU, against the plan's
estimate, for runtime.recompute=none and =pointwise: the saved tensors (by a saved-tensor hook
on the compiled forward), what is allocated after the forward, and the peak of forward plus
backward above the model (all MiB).

    python3 tools/saved_activations.py --batch 32
"""
from __future__ import annotations

import argparse

import torch
import torchvision

from tr_hydra.compiler.analysis import propagate
from tr_hydra.runtime.recompute import with_recompute


def measure(batch: int, res: int, mode: str) -> dict:
    torch._dynamo.reset()
    m = torchvision.models.resnet50().cuda().to(memory_format=torch.channels_last).to(torch.bfloat16)
    x = torch.randn(batch, 3, res, res, device="cuda", dtype=torch.bfloat16).to(memory_format=torch.channels_last)
    f = with_recompute(torch.compile(m, dynamic=False), mode)
    f(x).float().sum().backward()  # compile and autotune first
    for p in m.parameters():
        p.grad = None
    torch.cuda.synchronize()
    outside = {p.untyped_storage()._cdata for p in m.parameters()} | {x.untyped_storage()._cdata}
    sizes: dict[int, int] = {}
    keep = []

    def pack(t):
        s = t.untyped_storage()
        if s._cdata not in outside:
            sizes[s._cdata] = s.nbytes()
            keep.append(t)
        return t
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = f(x)
    after_fwd = torch.cuda.memory_allocated() - base
    del keep
    y.float().sum().backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    with torch.device("meta"):
        meta = torchvision.models.resnet50().to(torch.bfloat16)
    rep = propagate(meta, batch, 3, res, torch.bfloat16, True, recompute=mode == "pointwise")
    mib = 2 ** 20
    return {"saved": sum(sizes.values()) / mib, "after_forward": after_fwd / mib, "peak": peak / mib,
            "estimate_saved": rep.saved_activation_bytes / mib, "estimate_peak": rep.activation_peak_bytes / mib}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--res", type=int, default=224)
    a = ap.parse_args()
    torch.backends.cudnn.benchmark = True
    for mode in ("none", "pointwise"):
        r = measure(a.batch, a.res, mode)
        print(mode, a.batch, {k: round(v, 1) for k, v in r.items()}, flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
