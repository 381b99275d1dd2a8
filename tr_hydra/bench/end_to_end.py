"""tr-bench end to end (``bench.data``): tr_hydra, DALI + torch.compile and DataLoader +
torch.compile on a JPEG folder, same model, batch, resolution and precision; img/s over the rest
of a first epoch after a warm-up and a second whole epoch."""
from __future__ import annotations

import dataclasses
import os
import sys
import time
from pathlib import Path

import torch

from tr_hydra.bench.baselines import e2e_dali_compile, e2e_dataloader_compile
from tr_hydra.bench.modes import lr_of, pick_modes, ready_runtime
from tr_hydra.bench.report import kernel_profile, write_json
from tr_hydra.bench.timing import Marks, epoch_rates, sync
from tr_hydra.config.epochs import epoch_schedule
from tr_hydra.data.dali_source import decodes_on_host


def end_to_end(pc, b, device) -> dict:
    """Every mode of ``b.modes`` on the folder ``b.data`` (first ``b.generate`` JPEGs written
    into it, if asked) and on shards tr-prepare wrote from it (``<b.data>/shards``, written on
    first use with tr-prepare's defaults); the results as tr-bench writes them."""
    modes = pick_modes(b.modes, device, e2e=True)
    if b.generate:
        make_jpegs(b.data, b.generate)
    fpc = folder_config(pc, b.data, pc.runtime.compile)
    shards = ensure_shards(b.data) if any("shards" in m for m in modes) else None
    v = fpc.variant("train_base")
    options = dict(fpc.runtime.inductor_options)
    records = []
    out = {"config": fpc.describe(), "runtime": dataclasses.asdict(fpc.runtime), "device": str(device),
           "data": b.data, "shards": str(shards) if shards else None, "train_images": fpc.train_size,
           "batch": v.batch, "res": v.res, "modes": records}
    for m in modes:
        if m in ("tr", "tr-shards"):
            mpc = fpc if m == "tr" else shards_config(fpc, shards)
            r = e2e_tr(mpc, warm_steps=b.warmup, profile_steps=b.steps if b.profile else 0, name=m)
            r["decode_img_per_sec"] = decode_only(mpc, device)
        elif m == "tr-synthetic":  # the same plan and epochs, the images already in host memory
            spc = dataclasses.replace(fpc, data=dataclasses.replace(pc.data, name="synthetic",
                                                                     num_classes=fpc.model.num_classes))
            r = e2e_tr(spc, warm_steps=b.warmup, name=m)
        elif m in ("dali-compile", "dali-shards-compile"):
            on = shards_config(fpc, shards) if m == "dali-shards-compile" else fpc  # data.decode: as tr_hydra's
            r = e2e_dali_compile(b.data, fpc.model.name, v.batch, v.res, device, fpc.amp, warm_steps=b.warmup,
                                 hw_decoder_load=fpc.data.hw_decoder_load, options=options,
                                 shards=str(shards) if m == "dali-shards-compile" else None,
                                 host=decodes_on_host(on.data, device.type == "cuda", os.cpu_count() or 1))
        else:
            r = e2e_dataloader_compile(b.data, fpc.model.name, v.batch, v.res, device, fpc.amp,
                                       warm_steps=b.warmup, options=options)
        r["mode"] = m
        records.append(r)
        print(f"tr-bench: {m} {r['img_per_sec']:,.1f} img/s", file=sys.stderr, flush=True)
        write_json(out, b.out, quiet=True)  # what is measured so far survives a later mode's failure
        sync(device)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return out


def ensure_shards(root: str) -> Path:
    """``<root>/shards``: the folder prepared by tr-prepare's defaults (max_side 320, quality 90),
    written on first use, then reused (tr-prepare checks it is the same preparation)."""
    from tr_hydra.config.specs import DataSpec
    from tr_hydra.data.prepare import Settings, prepare
    out = Path(root) / "shards"
    if not (out / "index.json").is_file():
        print(f"tr-bench: preparing shards of {root} in {out} (tr-prepare's defaults)", flush=True)
    prepare(DataSpec(name="imagefolder", root=str(root)), out, Settings(), workers=os.cpu_count() or 1,
            skip_corrupt=False, log=lambda m: print(m, flush=True))
    return out


def shards_config(pc, shards: Path):
    """``pc`` (of the folder) reading the shards prepared from it instead."""
    return dataclasses.replace(pc, data=dataclasses.replace(pc.data, name="shards", root=str(shards)))


def decode_only(pc, device) -> float:
    """tr_hydra's input alone: img/s of the training split's first epoch from its DALI source,
    each batch copied to the device as the feeder copies it, no step; timed from the first
    batch's arrival, as the baselines' rate is (their iterator builds and runs its pipeline's
    first batch before the clock starts)."""
    from tr_hydra.data.dali_source import DaliSource
    src = DaliSource(pc.source_spec(), device, torch.float16 if pc.amp else torch.float32, log=lambda *_: None)
    try:
        sched = epoch_schedule(pc, 0)
        t, n = time.perf_counter(), 0
        for k, (v, i, size) in enumerate(sched):
            out = src.batch("train", i, pc.variant(v).batch, size, pc.variant(v).res, epoch=0)
            images = out.images.as_tensor() if hasattr(out.images, "as_tensor") else out.images
            if device.type == "cuda":
                from nvidia.dali.plugin.pytorch import feed_ndarray
                buf = torch.empty(images.shape(), dtype=out.dtype, device=device)
                feed_ndarray(images, buf, cuda_stream=torch.cuda.current_stream())
            if k == 0 and len(sched) > 1:  # the pipeline is built and running: start the clock
                sync(device)
                t = time.perf_counter()
                continue
            n += size
        sync(device)
        return n / (time.perf_counter() - t)
    finally:
        src.close()


def make_jpegs(root: str, n: int, classes: int = 100, width: int = 500, height: int = 375) -> str:
    """n ImageNet-sized JPEGs (smooth random content, ~60-120 KB each) in root/{train,val}/<class>."""
    from concurrent.futures import ProcessPoolExecutor
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
    from tr_hydra.config.epochs import make_variants
    from tr_hydra.config.specs import DataSpec
    from tr_hydra.data.index import scan_imagefolder
    from tr_hydra.data.sizes import count_images
    n_train, n_val = count_images(Path(root) / "train"), count_images(Path(root) / "val")
    classes = len(scan_imagefolder(root, "train")[1])
    v = pc.variant("train_base")
    data = DataSpec(name="imagefolder", root=str(root), num_classes=classes, num_threads=os.cpu_count() or 4,
                    hw_decoder_load=pc.data.hw_decoder_load, decode=pc.data.decode)
    variants = make_variants(train_size=n_train, val_size=n_val, batch_size=v.batch, val_batch_size=v.batch,
                             base_res=v.res, lowres_res=v.res, lowres_epochs=0, val_res=v.res, drop_last=False)
    return dataclasses.replace(pc, data=data, model=dataclasses.replace(pc.model, num_classes=classes),
                               trainer=dataclasses.replace(pc.trainer, epochs=max(2, pc.trainer.epochs)),  # it runs two
                               train_size=n_train, val_size=n_val, variants=variants, lowres_epochs=0,
                               runtime=dataclasses.replace(pc.runtime, compile=compile_mode))


def e2e_tr(pc, warm_steps: int = 8, profile_steps: int = 0, name: str = "tr") -> dict:
    """tr_hydra end to end: one epoch of the folder after a warm-up (pipelines built, decoders
    and graphs ready); the first figure is build + capture + warm-up. ``profile_steps``: after
    the timed window, that many steps of a third epoch under ``torch.profiler`` (``profile``:
    where the device time goes while the input pipeline shares the GPU, DALI's kernels as a
    group of their own, and how busy the device is)."""
    if profile_steps:  # the plan runs on into the profiled epoch; the timed window is the same
        pc = dataclasses.replace(pc, trainer=dataclasses.replace(pc.trainer, epochs=max(3, pc.trainer.epochs)))
    t0 = time.perf_counter()
    rt, rep, _, _ = ready_runtime(pc, lambda *_: None)
    try:
        lr = lr_of(pc)
        sched = epoch_schedule(pc, 0)
        rt.run_steps(sched[:warm_steps], "train", lr=lr, epoch=0)
        sync(rt.device)
        first = time.perf_counter() - t0
        t1, w1, c1 = time.perf_counter(), rt.data_wait, getattr(rt.source, "copy_wait", 0.0)
        marks = Marks()
        marks.mark()
        rt.run_steps(sched[warm_steps:], "train", lr=lr, epoch=0)  # the rest of the epoch, then a whole one
        marks.mark()
        rt.run_steps(epoch_schedule(pc, 1), "train", lr=lr, epoch=1)
        marks.mark()
        sync(rt.device)
        seconds = time.perf_counter() - t1
        parts = [sum(s[2] for s in sched[warm_steps:]), sum(s[2] for s in epoch_schedule(pc, 1))]
        n = sum(parts)
        # where the time went: the host waiting for batches (in all, and for epoch 1's first one:
        # the epoch switch), and whether epoch 1's reader was ready in advance; the wait for
        # batches includes waiting for the copy out of the previous one, which keeps pace with
        # the device (two steps queued): that part is reported apart
        out = {"img_per_sec": n / seconds, "images": n, "first_step_seconds": first, "seconds": seconds,
               "epoch_img_per_sec": epoch_rates(marks, parts),
               "data_wait_seconds": rt.data_wait - w1,
               "copy_wait_seconds": getattr(rt.source, "copy_wait", 0.0) - c1,
               "epoch_switch_wait_seconds": rt.first_batch_wait,
               "epochs_read_ahead": getattr(rt.source, "ahead_used", 0),
               "startup": rep.to_json()}
        if profile_steps:
            out["profile"] = _profile_e2e(rt, epoch_schedule(pc, 2)[:profile_steps], lr, name)
    finally:
        rt.close()
    return out


def _profile_e2e(rt, steps: list, lr, name: str = "tr") -> dict:
    """``steps`` of epoch 2 under torch.profiler: ``report.kernel_profile``'s figures per step,
    and how long the host waited for batches meanwhile."""
    from torch.profiler import ProfilerActivity, profile
    cuda = rt.device.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    sync(rt.device)
    w0 = rt.data_wait
    with profile(activities=acts) as prof:
        t = time.perf_counter()
        rt.run_steps(steps, "train", lr=lr, epoch=2)
        sync(rt.device)
        wall = time.perf_counter() - t
    return dict(kernel_profile(prof, name, len(steps), wall, cuda),
                data_wait_ms_per_step=1000 * (rt.data_wait - w0) / max(len(steps), 1))


def e2e_table(records: list[dict]) -> str:
    tr = next((r for r in records if r["mode"] == "tr"), None)
    lines = [f"{'mode':<20} {'img/s':>10} {'tr_hydra x':>11} {'decode only':>12} {'first step s':>13} "
             f"{'epoch 0 rest / epoch 1':>24}"]
    for r in records:
        ratio = f"{tr['img_per_sec'] / r['img_per_sec']:.2f}" if tr else "-"  # no tr_hydra run: no ratio
        parts = " / ".join(f"{v:,.0f}" for v in r.get("epoch_img_per_sec", []))
        dec = f"{r['decode_img_per_sec']:,.0f}" if r.get("decode_img_per_sec") else "-"
        lines.append(f"{r['mode']:<20} {r['img_per_sec']:>10,.1f} {ratio:>11} {dec:>12} {r['first_step_seconds']:>13.1f} "
                     f"{parts:>24}")
    for r in records:
        if r["mode"] in ("tr", "tr-shards", "tr-synthetic") and "data_wait_seconds" in r:
            lines.append(f"{r['mode']} waited {r['data_wait_seconds']:.2f} s of {r['seconds']:.2f} s for batches "
                         f"({r.get('copy_wait_seconds', 0.0):.2f} s of it for the device to take the previous one, "
                         f"{r['epoch_switch_wait_seconds']:.2f} s at the start of epoch 1; epoch 1's first batch "
                         f"decoding before the switch: {'yes' if r['epochs_read_ahead'] else 'no'})")
    lines.append("decode only: the input alone over an epoch (img/s with no training step); where it is "
                 "below a mode's img/s ceiling, the input sets the pace")
    return "\n".join(lines)
