"""PyTorch's side of tr-bench: the usual best-practice training step (eager or torch.compile),
and the end-to-end baselines on a JPEG folder (torchvision's DataLoader, NVIDIA DALI) feeding the
model under torch.compile."""
from __future__ import annotations

import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from tr_hydra.bench.timing import Marks, epoch_rates, sync


def compile_as(fn, mode: str | None = None, options: dict | None = None, **kw):
    """``torch.compile(fn, mode=mode)``, with Inductor ``options`` (``runtime.inductor_options``)
    on top of the mode's own: torch.compile takes a mode or options, not both. Stock PyTorch:
    none of tr_hydra's patches is in force here (``tr_hydra.internals.patched``)."""
    if not options:
        return torch.compile(fn, mode=mode, **kw) if mode else torch.compile(fn, **kw)
    from tr_hydra.internals.inductor import mode_options
    return torch.compile(fn, options={**(mode_options(mode) if mode else {}), **options}, **kw)


def _model_and_optimizer(model_name: str, classes: int, device, lr: float = 0.1, weight_decay: float = 5e-5):
    """The torchvision-style model in channels_last and fused SGD with momentum (fused on CUDA)."""
    from tr_hydra.models.registry import build_model
    torch.backends.cudnn.benchmark = True
    model = build_model(model_name, classes).to(device).to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=weight_decay,
                          fused=device.type == "cuda")
    return model, opt


def _fwd_bwd(model, device, amp: bool, returns_loss: bool = True):
    """Forward, loss and backward under bf16 autocast (``amp``); returning the loss or not."""
    def fwd_bwd(x, y):
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
            loss = F.cross_entropy(model(x), y)
        loss.backward()
        return loss if returns_loss else None
    return fwd_bwd


def pytorch_runner(model_name: str, batch: int, res: int, classes: int, mode: str, device, amp: bool,
                   options: dict | None = None):
    """The usual best-practice PyTorch step: channels_last, bf16 autocast, fused SGD with momentum,
    zero_grad(set_to_none=True), cudnn.benchmark; ``mode`` eager, compile or reduce-overhead.
    ``options``: Inductor options for the compiled modes (tr-bench passes tr_hydra's
    ``runtime.inductor_options``, so both compile alike). Returns ``step()``, one training step
    on a fixed synthetic batch already on the device."""
    torch.manual_seed(0)
    model, opt = _model_and_optimizer(model_name, classes, device)
    x = torch.randn(batch, 3, res, res, device=device).to(memory_format=torch.channels_last)
    y = torch.randint(0, classes, (batch,), device=device)
    if amp:
        x = x.to(torch.bfloat16)
    fwd_bwd = _fwd_bwd(model, device, amp)
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


def _compiled_step(model_name: str, classes: int, device, amp: bool, options: dict | None = None):
    """``step(x, y)``: the end-to-end baselines' training step, the model under torch.compile."""
    model, opt = _model_and_optimizer(model_name, classes, device)
    fwd_bwd = compile_as(_fwd_bwd(model, device, amp, returns_loss=False), None, options)

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
    marks, parts, last = Marks(), [0], 0
    for epoch, x, y in batches:
        if t1 is not None and epoch != last:  # the first step of the second epoch
            marks.mark()
            parts.append(0)
        last = epoch
        step(x, y)
        k += 1
        if k == warm_steps:
            sync()
            first = time.perf_counter() - t0
            t1 = time.perf_counter()
            marks.mark()
        elif k > warm_steps:
            n += x.shape[0]
            parts[-1] += x.shape[0]
    marks.mark()
    sync()
    return {"img_per_sec": n / (time.perf_counter() - t1), "images": n, "first_step_seconds": first,
            "epoch_img_per_sec": epoch_rates(marks, parts)}


def e2e_dataloader_compile(root: str, model_name: str, batch: int, res: int, device, amp: bool,
                           warm_steps: int = 8, options: dict | None = None) -> dict:
    """torchvision ImageFolder + DataLoader (a worker per core, pinned memory) with the usual
    ImageNet training transforms; the model under torch.compile, bf16 autocast, fused SGD."""
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
                     options: dict | None = None, shards: str | None = None, host: bool = False) -> dict:
    """NVIDIA DALI as its documentation sets it up (a reader, nvJPEG mixed decode of the random
    crop's region only, resize, flip, normalise to fp16 HWC; pipelined asynchronous executor,
    every core) feeding the model under torch.compile, bf16 autocast, fused SGD. The reader:
    ``fn.readers.file`` over the folder ``root``, or with ``shards`` (a tr-prepare output)
    ``fn.readers.webdataset`` over its training shards; ``host``: decoded and resized on the
    host's threads (``data.decode``, as tr_hydra's). First DALI alone over an epoch (the
    decode-only rate), then the training."""
    from nvidia.dali.plugin.pytorch import DALIGenericIterator, LastBatchPolicy
    t0 = time.perf_counter()
    p, classes = _dali_pipe(root, batch, res, device, hw_decoder_load, shards, host)
    it = DALIGenericIterator([p], ["x", "y"], reader_name="Reader", last_batch_policy=LastBatchPolicy.DROP,
                             auto_reset=True)
    decode = _decode_rate(it, device, shards is not None)
    t0 += decode["seconds"]  # the first-step figure counts building and warming up, not the decode-only pass
    step = _compiled_step(model_name, classes, device, amp, options)

    def batches():
        for epoch in range(2):  # two epochs (auto_reset); the first warm_steps batches are the warm-up
            for d in it:
                x = d[0]["x"].permute(0, 3, 1, 2)  # DALI's fp16; autocast takes it as it is
                yield epoch, (x if amp else x.float()), _labels(d[0]["y"], shards is not None, device)
    return dict(_timed_epoch(batches(), step, warm_steps, t0), decode_img_per_sec=decode["img_per_sec"])


def _dali_pipe(root: str, batch: int, res: int, device, hw_decoder_load, shards: str | None, host: bool = False):
    """(pipeline, classes): DALI's usual training pipeline over the folder or the shards."""
    import json
    from nvidia.dali import fn, pipeline_def, types
    gpu = device.type == "cuda"
    if shards is None:
        train = Path(root) / "train"
        classes = sorted(p.name for p in train.iterdir() if p.is_dir())
    else:
        index = json.loads((Path(shards) / "index.json").read_text())
        classes, n = index["classes"], index["splits"]["train"]["count"]
        tars = [str(Path(shards) / "train" / s["name"]) for s in index["splits"]["train"]["shards"]]

    @pipeline_def(batch_size=batch, num_threads=os.cpu_count() or 4, device_id=(device.index or 0) if gpu else None,
                  seed=1)
    def pipe():
        if shards is None:
            enc, label = fn.readers.file(file_root=str(train), random_shuffle=True, name="Reader")
        else:  # webdataset: shards read in turn through a shuffle buffer
            enc, label = fn.readers.webdataset(paths=tars, ext=["jpg", "cls"], random_shuffle=True,
                                               initial_fill=min(4096, n), name="Reader")
            label = fn.pad(label, fill_value=0)  # ASCII of any length: zero-padded to the batch's longest
        # data.hw_decoder_load, when set, applies to this pipeline as to tr_hydra's
        host_only = host or not gpu
        hw = {} if hw_decoder_load is None or host_only else {"hw_decoder_load": hw_decoder_load}
        # decode only the random crop's region, then resize (DALI's own ResNet-50 training recipe)
        img = fn.decoders.image_random_crop(enc, device="cpu" if host_only else "mixed", output_type=types.RGB, **hw)
        img = fn.resize(img, size=(res, res))
        if gpu and host:
            img = img.gpu()
        img = fn.crop_mirror_normalize(img, mirror=fn.random.coin_flip(), dtype=types.FLOAT16,
                                       output_layout="HWC", mean=[0.485 * 255, 0.456 * 255, 0.406 * 255],
                                       std=[0.229 * 255, 0.224 * 255, 0.225 * 255])
        return img, (label.gpu() if gpu and shards is None else label)
    p = pipe()
    p.build()
    return p, len(classes)


def _labels(y, text: bool, device) -> torch.Tensor:
    """The batch's labels: the file reader's ints, or the ASCII text of webdataset's ``.cls``."""
    if not text:
        return y.view(-1).long()
    return torch.tensor([int(bytes(v.tolist()).rstrip(b"\0").decode()) for v in y.cpu()], device=device)


def _decode_rate(it, device, text_labels: bool) -> dict:
    """DALI alone: img/s over one epoch of ``it`` with no training step (the batches reach the
    device as they would for training)."""
    t = time.perf_counter()
    n = 0
    for d in it:
        _labels(d[0]["y"], text_labels, device)
        n += d[0]["x"].shape[0]
    sync()
    seconds = time.perf_counter() - t
    return {"img_per_sec": n / seconds if seconds else 0.0, "seconds": seconds}
