"""Step benchmark: PyTorch (eager, torch.compile default / reduce-overhead) against tr_hydra
(whole-step CUDA graph with the eager model, or with Inductor) in one process, same model, batch
and precision, synthetic data already on the device.

    python -m tr_hydra.bench --model resnet50 --batch 256 --modes eager,tr --out bench.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
import torch.nn.functional as F


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _time_steps(step, n: int, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        _sync()
        t0 = time.perf_counter()
        for _ in range(n):
            step()
        _sync()
        out.append(time.perf_counter() - t0)
    return out


def pytorch_runner(model_name: str, batch: int, res: int, classes: int, mode: str, device, amp: bool):
    """The usual best-practice PyTorch step: channels_last, bf16 autocast, fused SGD with momentum,
    zero_grad(set_to_none=True), cudnn.benchmark."""
    from tr_hydra.models.registry import build_model
    torch.backends.cudnn.benchmark = True
    torch.manual_seed(0)
    model = build_model(model_name, classes).to(device).to(memory_format=torch.channels_last)
    fused = device.type == "cuda"
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-5, fused=fused)
    x = torch.randn(batch, 3, res, res, device=device).to(memory_format=torch.channels_last)
    y = torch.randint(0, classes, (batch,), device=device)
    if amp:
        x = x.to(torch.bfloat16)

    def fwd_bwd(x, y):
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
            loss = F.cross_entropy(model(x), y)
        loss.backward()
        return loss

    if mode == "eager":
        f = fwd_bwd
    elif mode == "compile":
        f = torch.compile(fwd_bwd)
    elif mode == "reduce-overhead":
        f = torch.compile(fwd_bwd, mode="reduce-overhead")
    else:
        raise ValueError(mode)

    def step():
        f(x, y)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def tr_runner(model_name: str, batch: int, res: int, classes: int, compile_mode: str, device, amp: bool):
    from tr_hydra.config.plan_config import (DataSpec, ModelSpec, OptimizerSpec, PlanConfig,
                                             RuntimeSpec, TrainerSpec, make_variants)
    from tr_hydra.runtime.runner import Trainer
    n_train = batch * 64
    pc = PlanConfig(model=ModelSpec(name=model_name, num_classes=classes),
                    optimizer=OptimizerSpec(name="momentum", lr=0.1, weight_decay=5e-5, schedule="constant"),
                    data=DataSpec(num_classes=classes, image_size=res),
                    trainer=TrainerSpec(epochs=1),
                    runtime=RuntimeSpec(device=device.type, compile=compile_mode),
                    variants=make_variants(train_size=n_train, val_size=batch, batch_size=batch,
                                           val_batch_size=batch, base_res=res, lowres_res=res,
                                           lowres_epochs=0, val_res=res, drop_last=False),
                    batch_size=batch, val_batch_size=batch, train_size=n_train, val_size=batch,
                    amp=amp)
    tr = Trainer(pc, "/tmp/tr_bench", log=lambda *_: None)
    tr.capture()
    sched = [("train_base", i, batch) for i in range(8)]

    def step8():
        tr.run_steps(sched, "train")
    return step8, tr


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="resnet50")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--res", type=int, default=224)
    ap.add_argument("--classes", type=int, default=1000)
    ap.add_argument("--modes", default="eager,compile,reduce-overhead,tr,tr-inductor")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--fp32", action="store_true")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    amp = not a.fp32
    results = []
    for mode in a.modes.split(","):
        t0 = time.perf_counter()
        torch.cuda.reset_peak_memory_stats() if device.type == "cuda" else None
        if mode.startswith("tr"):
            step, tr = tr_runner(a.model, a.batch, a.res, a.classes,
                                 "inductor" if mode == "tr-inductor" else "none", device, amp)
            per_call = 8
        else:
            step, tr = pytorch_runner(a.model, a.batch, a.res, a.classes, mode, device, amp), None
            per_call = 1
        for _ in range(max(1, 16 // per_call)):  # warm-up (compiles, autotuning)
            step()
        _sync()
        first = time.perf_counter() - t0
        times = _time_steps(step, max(1, a.steps // per_call), a.repeats)
        n_img = a.batch * per_call * max(1, a.steps // per_call)
        rates = [n_img / t for t in times]
        rec = {"mode": mode, "model": a.model, "batch": a.batch, "res": a.res, "amp": amp,
               "img_per_sec_median": statistics.median(rates), "img_per_sec_all": rates,
               "step_ms": 1000 * a.batch / statistics.median(rates),
               "warmup_seconds": first,
               "peak_bytes": torch.cuda.max_memory_allocated() if device.type == "cuda" else 0}
        if tr is not None:
            rec["arena_bytes"] = tr.compiled.plan.total_bytes
            rec["predicted_bytes"] = tr.compiled.plan.total_bytes + tr.compiled.activation_estimate
        results.append(rec)
        print(json.dumps(rec), flush=True)
        del step, tr
        torch.cuda.empty_cache() if device.type == "cuda" else None
    best = max((r for r in results if not r["mode"].startswith("tr")), key=lambda r: r["img_per_sec_median"], default=None)
    for r in results:
        ratio = r["img_per_sec_median"] / best["img_per_sec_median"] if best else float("nan")
        print(f"{r['mode']:<16} {r['img_per_sec_median']:>10.1f} img/s  {r['step_ms']:7.2f} ms/step  "
              f"x{ratio:.3f} vs best PyTorch  peak {r['peak_bytes'] / 2**30:.2f} GiB  first {r['warmup_seconds']:.1f}s")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
