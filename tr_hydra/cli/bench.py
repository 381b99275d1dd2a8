"""tr-bench: PyTorch's best practice and tr_hydra side by side, one process, same model, batch
and precision (tr-train overrides). Every mode is built first (time to first step, peak
memory), then timed interleaved: each repeat runs every mode once, so drift affects all alike.

    tr-bench model=resnet50 amp=true variants.batch_size=256 variants.base_res=224
"""
from __future__ import annotations

import dataclasses
import json
import statistics
import sys
import time

import torch

from tr_hydra.cli._common import compose, user_errors

PYTORCH_MODES = ("eager", "compile", "reduce-overhead")
TR_MODES = ("tr", "tr-inductor")


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _modes(spec: str, device) -> list[str]:
    if spec == "auto":
        return ["eager", "compile", "reduce-overhead", "tr", "tr-inductor"] if device.type == "cuda" else ["eager", "tr"]
    modes = [m.strip() for m in spec.split(",") if m.strip()]
    bad = [m for m in modes if m not in PYTORCH_MODES + TR_MODES]
    if bad:
        from tr_hydra.errors import ConfigError
        raise ConfigError(f"bench.modes: unknown {bad}; choose from {', '.join(PYTORCH_MODES + TR_MODES)}")
    return modes


class Mode:
    """One way of running the training step, built and warmed up, ready to be timed."""

    def __init__(self, name: str, pc, device, warmup: int):
        from tr_hydra.bench import pytorch_runner
        self.name, self.pc, self.device = name, pc, device
        t0 = time.perf_counter()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
        v = pc.variant("train_base")
        self.batch = v.batch
        if name in PYTORCH_MODES:
            self.trainer = None
            step = pytorch_runner(pc.model.name, v.batch, v.res, pc.model.num_classes, name, device, pc.amp)
            self.step = step
        else:
            from tr_hydra.runtime.runner import Trainer, epoch_schedule
            tpc = dataclasses.replace(pc, runtime=dataclasses.replace(
                pc.runtime, compile="inductor" if name == "tr-inductor" else "none"))
            self.trainer = Trainer(tpc, "/tmp/tr_bench_run", log=lambda *_: None, telemetry=False)
            self.trainer.capture()
            full = [s for s in epoch_schedule(tpc, tpc.lowres_epochs) if s[0] == "train_base"]
            self.sched = full[:1]
            self.step = lambda: self.trainer.run_steps(self.sched, "train")
        for _ in range(max(warmup, 1)):
            self.step()
        _sync(device)
        self.first_seconds = time.perf_counter() - t0
        self.peak_bytes = (torch.cuda.max_memory_allocated(device) - base) if device.type == "cuda" else 0
        self.times: list[float] = []

    def time(self, steps: int) -> None:
        _sync(self.device)
        t0 = time.perf_counter()
        for _ in range(steps):
            self.step()
        _sync(self.device)
        self.times.append(steps * self.batch / (time.perf_counter() - t0))

    def record(self) -> dict:
        r = self.times
        return {"mode": self.name, "img_per_sec_median": statistics.median(r), "img_per_sec_all": r,
                "spread": (max(r) - min(r)) / statistics.median(r) if r else 0.0,
                "peak_bytes": self.peak_bytes, "first_step_seconds": self.first_seconds}


def epoch_mix(pc, device) -> dict:
    """tr_hydra over a whole schedule of variants (low-res and base epochs with their last
    batches, validation): img/s over the schedule and the time to the first step of every
    variant (capture of all graphs included)."""
    from tr_hydra.runtime.runner import Trainer, epoch_schedule, val_schedule
    t0 = time.perf_counter()
    tr = Trainer(pc, "/tmp/tr_bench_mix", log=lambda *_: None, telemetry=False)
    tr.capture()
    ready = time.perf_counter() - t0
    epochs = max(pc.lowres_epochs + 1, 2)
    n, t1 = 0, time.perf_counter()
    for e in range(epochs):
        sched = epoch_schedule(pc, e)
        tr.run_steps(sched, "train", epoch=e)
        n += sum(s[2] for s in sched)
        tr.model.eval()
        with tr.ex.folded():
            tr.run_steps(val_schedule(pc), "val")
        tr.model.train()
    _sync(device)
    return {"mode": "tr epoch mix", "variants": [v.name for v in pc.variants],
            "train_img_per_sec_with_val": n / (time.perf_counter() - t1),
            "first_step_of_all_variants_seconds": ready, "epochs": epochs}


def table(records: list[dict]) -> str:
    pt = [r for r in records if r["mode"] in PYTORCH_MODES]
    best = max(pt, key=lambda r: r["img_per_sec_median"]) if pt else None
    lines = [f"{'mode':<16} {'img/s':>10} {'spread':>7} {'x best PyTorch':>15} {'peak MiB':>9} {'first step s':>13}"]
    for r in records:
        ratio = r["img_per_sec_median"] / best["img_per_sec_median"] if best else float("nan")
        lines.append(f"{r['mode']:<16} {r['img_per_sec_median']:>10,.1f} {100 * r['spread']:>6.1f}% "
                     f"{ratio:>15.3f} {r['peak_bytes'] / 2**20:>9,.0f} {r['first_step_seconds']:>13.1f}")
    if best:
        lines.append(f"best PyTorch mode: {best['mode']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        return 0
    from tr_hydra.config.plan_config import plan_config_from
    from tr_hydra.runtime.runner import pick_device
    with user_errors("tr-bench"):
        cfg = compose(argv)
        pc = plan_config_from(cfg)
        b = cfg.bench
        device = pick_device(pc)
        modes = _modes(b.modes, device)
        if pc.data.name != "synthetic":  # the step is what is measured; data comes from the device
            pc = dataclasses.replace(pc, data=dataclasses.replace(pc.data, name="synthetic"))
        built = [Mode(m, pc, device, b.warmup) for m in modes]
        for _ in range(b.repeats):
            for m in built:  # interleaved repeats
                m.time(b.steps)
        records = [m.record() for m in built]
        out = {"config": pc.describe(), "device": str(device), "batch": pc.batch_size,
               "res": pc.variant("train_base").res, "steps": b.steps, "repeats": b.repeats, "modes": records}
        if b.epoch_mix:
            out["epoch_mix"] = epoch_mix(pc, device)
    print(table(records))
    if "epoch_mix" in out:
        em = out["epoch_mix"]
        print(f"epoch mix ({', '.join(em['variants'])}): {em['train_img_per_sec_with_val']:,.1f} img/s, "
              f"first step of all variants after {em['first_step_of_all_variants_seconds']:.1f}s")
    path = b.out or "bench.json"
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    print(f"results in {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
