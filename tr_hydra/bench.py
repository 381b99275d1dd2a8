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


class _Marks:
    """Points in a timed run, as CUDA events on the current stream (no synchronisation between
    them, so marking does not drain the queue) or host clock readings on the CPU."""

    def __init__(self):
        self.cuda = torch.cuda.is_available()
        self.points = []

    def mark(self) -> None:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self.points.append(ev)
        else:
            self.points.append(time.perf_counter())

    def seconds(self) -> list[float]:
        """Seconds between consecutive marks (call after a synchronisation)."""
        p = self.points
        if self.cuda:
            return [a.elapsed_time(b) / 1e3 for a, b in zip(p, p[1:])]
        return [b - a for a, b in zip(p, p[1:])]


def _epoch_rates(marks: _Marks, images: list[int]) -> list[float]:
    """img/s of each timed part: the rest of the first epoch, then the second epoch."""
    return [n / s if s > 0 else 0.0 for n, s in zip(images, marks.seconds())]


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


def compile_as(fn, mode: str | None = None, options: dict | None = None, **kw):
    """``torch.compile(fn, mode=mode)``, with Inductor ``options`` (``runtime.inductor_options``)
    on top of the mode's own: torch.compile takes a mode or options, not both. The same fix of
    Inductor's cache check as tr_hydra's is applied (``tr_hydra.runtime.inductor_compat``), so
    both load tuned kernels alike."""
    from tr_hydra.runtime import inductor_compat
    inductor_compat.apply()
    if not options:
        return torch.compile(fn, mode=mode, **kw) if mode else torch.compile(fn, **kw)
    from torch._inductor import list_mode_options
    return torch.compile(fn, options={**(list_mode_options(mode) if mode else {}), **options}, **kw)


def pytorch_runner(model_name: str, batch: int, res: int, classes: int, mode: str, device, amp: bool,
                   options: dict | None = None):
    """The usual best-practice PyTorch step: channels_last, bf16 autocast, fused SGD with momentum,
    zero_grad(set_to_none=True), cudnn.benchmark. ``options``: Inductor options for the compiled
    modes (tr-bench passes tr_hydra's ``runtime.inductor_options``, so both compile alike)."""
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
        f = compile_as(fwd_bwd, None, options)
    elif mode == "reduce-overhead":
        f = compile_as(fwd_bwd, "reduce-overhead", options)
    else:
        raise ValueError(mode)

    def step():
        f(x, y)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def tr_runner(model_name: str, batch: int, res: int, classes: int, compile_mode: str, device, amp: bool,
              n_train: int | None = None, deterministic: bool = False):
    from tr_hydra.config.plan_config import (DataSpec, ModelSpec, OptimizerSpec, PlanConfig,
                                             RuntimeSpec, TrainerSpec, make_variants)
    from tr_hydra.runtime.runner import Trainer
    n_train = n_train or batch * 64
    pc = PlanConfig(model=ModelSpec(name=model_name, num_classes=classes),
                    optimizer=OptimizerSpec(name="momentum", lr=0.1, weight_decay=5e-5, schedule="constant"),
                    data=DataSpec(num_classes=classes, image_size=res),
                    trainer=TrainerSpec(epochs=1),
                    runtime=RuntimeSpec(device=device.type, compile=compile_mode,
                                        deterministic=deterministic),
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


def make_jpegs(root: str, n: int, classes: int = 100, width: int = 500, height: int = 375) -> str:
    """n ImageNet-sized JPEGs (smooth random content, ~60-120 KB each) in root/{train,val}/<class>."""
    import os
    from concurrent.futures import ProcessPoolExecutor
    from pathlib import Path
    done = Path(root) / f".complete_{n}"
    if done.is_file():
        return root
    jobs = [(root, i, classes, width, height) for i in range(n)]
    with ProcessPoolExecutor(max(1, (os.cpu_count() or 2))) as ex:
        list(ex.map(_write_jpeg, jobs, chunksize=64))
    done.write_text("ok\n")
    return root


def _write_jpeg(job):
    import numpy as np
    from pathlib import Path
    from PIL import Image, ImageFilter
    root, i, classes, w, h = job
    rng = np.random.default_rng(i)
    small = rng.integers(0, 256, (h // 8, w // 8, 3), dtype=np.uint8)
    img = Image.fromarray(small).resize((w, h), Image.BICUBIC).filter(ImageFilter.GaussianBlur(1))
    noise = rng.integers(-12, 12, (h, w, 3))
    img = Image.fromarray(np.clip(np.asarray(img, np.int16) + noise, 0, 255).astype(np.uint8))
    for split in ("train", "val"):
        if split == "val" and (i // classes) % 8:  # every 8th image of each class
            continue
        d = Path(root) / split / f"c{i % classes:03d}"
        d.mkdir(parents=True, exist_ok=True)
        img.save(d / f"{i:06d}.jpg", quality=90)


def folder_config(pc, root: str, compile_mode: str):
    """``pc`` (model, optimizer, precision, batch, resolution) on a JPEG folder: every train
    image once per epoch (the last partial batch included), DALI with every core."""
    import dataclasses
    import os
    from pathlib import Path
    from tr_hydra.config.plan_config import DataSpec, make_variants
    from tr_hydra.data.index import scan_imagefolder
    from tr_hydra.data.sizes import count_images
    n_train, n_val = count_images(Path(root) / "train"), count_images(Path(root) / "val")
    classes = len(scan_imagefolder(root, "train")[1])
    v = pc.variant("train_base")
    data = DataSpec(name="imagefolder", root=str(root), num_classes=classes, image_size=v.res,
                    num_threads=os.cpu_count() or 4, hw_decoder_load=pc.data.hw_decoder_load)
    variants = make_variants(train_size=n_train, val_size=n_val, batch_size=v.batch, val_batch_size=v.batch,
                             base_res=v.res, lowres_res=v.res, lowres_epochs=0, val_res=v.res, drop_last=False)
    return dataclasses.replace(pc, data=data, model=dataclasses.replace(pc.model, num_classes=classes),
                               trainer=dataclasses.replace(pc.trainer, epochs=max(2, pc.trainer.epochs)),  # it runs two
                               train_size=n_train, val_size=n_val, variants=variants, lowres_epochs=0,
                               runtime=dataclasses.replace(pc.runtime, compile=compile_mode))


def e2e_tr(pc, workdir: str, warm_steps: int = 8, profile_steps: int = 0) -> dict:
    """tr_hydra end to end: one epoch of the folder after a warm-up (pipelines built, decoders
    and graphs ready); the first figure is build + capture + warm-up. ``profile_steps``: after
    the timed window, that many steps of a third epoch under ``torch.profiler`` (``profile``:
    where the device time goes while the input pipeline shares the GPU, DALI's kernels as a
    group of their own, and how busy the device is)."""
    import dataclasses
    from tr_hydra.runtime.runner import Trainer, epoch_schedule
    if profile_steps:  # the plan runs on into the profiled epoch; the timed window is the same
        pc = dataclasses.replace(pc, trainer=dataclasses.replace(pc.trainer, epochs=max(3, pc.trainer.epochs)))
    t0 = time.perf_counter()
    tr = Trainer(pc, workdir, log=lambda *_: None, telemetry=False)
    tr.capture()
    sched = epoch_schedule(pc, 0)
    tr.run_steps(sched[:warm_steps], "train", epoch=0)
    _sync()
    first = time.perf_counter() - t0
    t1, w1, c1 = time.perf_counter(), tr.data_wait, getattr(tr.source, "copy_wait", 0.0)
    marks = _Marks()
    marks.mark()
    tr.run_steps(sched[warm_steps:], "train", epoch=0)  # the rest of the epoch, then a whole one
    marks.mark()
    tr.run_steps(epoch_schedule(pc, 1), "train", epoch=1)
    marks.mark()
    _sync()
    seconds = time.perf_counter() - t1
    parts = [sum(s[2] for s in sched[warm_steps:]), sum(s[2] for s in epoch_schedule(pc, 1))]
    n = sum(parts)
    # where the time went: the host waiting for batches (in all, and for epoch 1's first one:
    # the epoch switch), and whether epoch 1's reader was ready in advance
    # the wait for batches includes waiting for the copy out of the previous one, which keeps
    # pace with the device (two steps queued): that part is reported apart
    out = {"img_per_sec": n / seconds, "images": n, "first_step_seconds": first, "seconds": seconds,
           "epoch_img_per_sec": _epoch_rates(marks, parts),
           "data_wait_seconds": tr.data_wait - w1,
           "copy_wait_seconds": getattr(tr.source, "copy_wait", 0.0) - c1,
           "epoch_switch_wait_seconds": tr.first_batch_wait,
           "epochs_read_ahead": getattr(tr.source, "ahead_used", 0)}
    if profile_steps:
        out["profile"] = _profile_e2e(tr, epoch_schedule(pc, 2)[:profile_steps])
    return out


def _profile_e2e(tr, steps: list) -> dict:
    """``steps`` of epoch 2 under torch.profiler: ``cli.bench.kernel_profile``'s figures per
    step, and how long the host waited for batches meanwhile."""
    from torch.profiler import ProfilerActivity, profile
    from tr_hydra.cli.bench import kernel_profile
    cuda = tr.device.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    _sync()
    w0 = tr.data_wait
    with profile(activities=acts) as prof:
        t = time.perf_counter()
        tr.run_steps(steps, "train", epoch=2)
        _sync()
        wall = time.perf_counter() - t
    return dict(kernel_profile(prof, "tr", len(steps), wall, cuda),
                data_wait_ms_per_step=1000 * (tr.data_wait - w0) / max(len(steps), 1))


def _compiled_step(model_name: str, classes: int, device, amp: bool, options: dict | None = None):
    from tr_hydra.models.registry import build_model
    torch.backends.cudnn.benchmark = True
    model = build_model(model_name, classes).to(device).to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-5, fused=device.type == "cuda")

    def fwd_bwd(x, y):
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
            loss = F.cross_entropy(model(x), y)
        loss.backward()
    fwd_bwd = compile_as(fwd_bwd, None, options)

    def step(x, y):
        fwd_bwd(x, y)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def _timed_epoch(batches, step, warm_steps: int, t0: float) -> dict:
    """Run ``warm_steps`` batches, then time the rest of the iterator (the rest of the first
    epoch and all of the second, as for tr_hydra). ``batches`` yields (epoch, images, labels)."""
    n = k = 0
    first = t1 = None
    marks, parts, last = _Marks(), [0], 0
    for epoch, x, y in batches:
        if t1 is not None and epoch != last:  # the first step of the second epoch
            marks.mark()
            parts.append(0)
        last = epoch
        step(x, y)
        k += 1
        if k == warm_steps:
            _sync()
            first = time.perf_counter() - t0
            t1 = time.perf_counter()
            marks.mark()
        elif k > warm_steps:
            n += x.shape[0]
            parts[-1] += x.shape[0]
    marks.mark()
    _sync()
    return {"img_per_sec": n / (time.perf_counter() - t1), "images": n, "first_step_seconds": first,
            "epoch_img_per_sec": _epoch_rates(marks, parts)}


def e2e_dataloader_compile(root: str, model_name: str, batch: int, res: int, device, amp: bool,
                           warm_steps: int = 8, options: dict | None = None) -> dict:
    """torchvision ImageFolder + DataLoader (a worker per core, pinned memory) with the usual
    ImageNet training transforms; the model under torch.compile, bf16 autocast, fused SGD."""
    import os
    from pathlib import Path
    import torchvision.transforms as T
    from torchvision.datasets import ImageFolder
    t0 = time.perf_counter()
    tf = T.Compose([T.RandomResizedCrop(res), T.RandomHorizontalFlip(), T.ToTensor(),
                    T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])
    ds = ImageFolder(str(Path(root) / "train"), tf)
    dl = torch.utils.data.DataLoader(ds, batch_size=batch, shuffle=True, num_workers=os.cpu_count() or 4,
                                     pin_memory=device.type == "cuda", drop_last=True, persistent_workers=True,
                                     prefetch_factor=4)
    step = _compiled_step(model_name, len(ds.classes), device, amp, options)

    def batches():
        for epoch in range(2):  # two epochs; the first warm_steps batches are the warm-up
            for x, y in dl:
                yield (epoch, x.to(device, non_blocking=True).to(memory_format=torch.channels_last),
                       y.to(device, non_blocking=True))
    return _timed_epoch(batches(), step, warm_steps, t0)


def e2e_dali_compile(root: str, model_name: str, batch: int, res: int, device, amp: bool,
                     warm_steps: int = 8, hw_decoder_load: float | None = None,
                     options: dict | None = None) -> dict:
    """NVIDIA DALI as its documentation sets it up (file reader, nvJPEG mixed decode of the random
    crop's region only, resize, flip, normalise to fp16 HWC; pipelined asynchronous executor, every core)
    feeding the model under torch.compile, bf16 autocast, fused SGD."""
    import os
    from pathlib import Path
    from nvidia.dali import fn, pipeline_def, types
    from nvidia.dali.plugin.pytorch import DALIGenericIterator, LastBatchPolicy
    t0 = time.perf_counter()
    train = Path(root) / "train"
    classes = sorted(p.name for p in train.iterdir() if p.is_dir())

    @pipeline_def(batch_size=batch, num_threads=os.cpu_count() or 4, device_id=device.index or 0, seed=1)
    def pipe():
        enc, label = fn.readers.file(file_root=str(train), random_shuffle=True, name="Reader")
        # data.hw_decoder_load, when set, applies to this pipeline as to tr_hydra's
        hw = {} if hw_decoder_load is None else {"hw_decoder_load": hw_decoder_load}
        # decode only the random crop's region, then resize (DALI's own ResNet-50 training recipe)
        img = fn.decoders.image_random_crop(enc, device="mixed", output_type=types.RGB, **hw)
        img = fn.resize(img, size=(res, res))
        img = fn.crop_mirror_normalize(img, mirror=fn.random.coin_flip(), dtype=types.FLOAT16,
                                       output_layout="HWC", mean=[0.485 * 255, 0.456 * 255, 0.406 * 255],
                                       std=[0.229 * 255, 0.224 * 255, 0.225 * 255])
        return img, label.gpu()
    p = pipe()
    p.build()
    it = DALIGenericIterator([p], ["x", "y"], reader_name="Reader", last_batch_policy=LastBatchPolicy.DROP,
                             auto_reset=True)
    step = _compiled_step(model_name, len(classes), device, amp, options)

    def batches():
        for epoch in range(2):  # two epochs (auto_reset); the first warm_steps batches are the warm-up
            for d in it:
                yield epoch, d[0]["x"].permute(0, 3, 1, 2), d[0]["y"].view(-1).long()
    return _timed_epoch(batches(), step, warm_steps, t0)


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
    ap.add_argument("--data", default=None, help="JPEG folder for the end-to-end modes (made if missing)")
    ap.add_argument("--jpegs", type=int, default=8192, help="how many JPEGs to generate for --data")
    a = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    amp = not a.fp32
    if a.data:
        print("the end-to-end comparison is part of tr-bench now: tr-bench bench.data=<folder>", file=sys.stderr)
        return 2
    results = []
    for mode in a.modes.split(","):
        t0 = time.perf_counter()
        torch.cuda.reset_peak_memory_stats() if device.type == "cuda" else None
        if mode.startswith("tr"):
            step, tr = tr_runner(a.model, a.batch, a.res, a.classes,
                                 "inductor" if mode == "tr-inductor" else "none", device, amp,
                                 deterministic=mode == "tr-deterministic")
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
            rec["predicted_bytes"] = tr.compiled.predicted_need
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
