"""NVIDIA DALI input: imagefolder, digits, arrays and prepared shards through one pipeline shape.

The host decides every batch (order from (seed, epoch), shard, partial last batch) and feeds the
samples through ``external_source``; DALI decodes (``data.decode``: nvJPEG "mixed" on the GPU,
or its CPU decoder on the host's threads), augments and normalises to NHWC in the compute dtype,
and the feeder copies the result straight into the idle arena input buffer.
"""
from __future__ import annotations

import collections
import os
import threading
import time
from dataclasses import dataclass

import numpy as np
import torch

from tr_hydra.config.epochs import train_variants
from tr_hydra.config.source import SourceSpec
from tr_hydra.data.decoder_noise import DecoderNoiseFilter, native_stderr_kept_on_success
from tr_hydra.data.index import SplitIndex, check_labels, epoch_order, load_arrays, scan_imagefolder
from tr_hydra.errors import ConfigError, TrHydraError


class DataError(TrHydraError):
    """A sample that cannot be read or decoded."""


@dataclass
class DaliBatch:
    """Valid until the next ``batch()`` of the same pipeline (DALI reuses its output buffers);
    the feeder copies it into the arena right away."""
    images: object            # DALI TensorList (CPU or GPU), NHWC, C padded to 4 for fp16
    labels: torch.Tensor      # int32 [n], on the host
    dtype: torch.dtype        # dtype DALI produced (fp16 or fp32)


def load_index(spec: SourceSpec, log=print) -> dict[str, SplitIndex]:
    d = spec.data
    if d.name in ("imagefolder", "digits"):
        root = d.root
        if d.name == "digits":
            from tr_hydra.data.digits import ensure_digits
            root = ensure_digits(d.cache_dir)
        if not root:
            raise ConfigError("data.root: required for data=imagefolder")
        train, classes = scan_imagefolder(root, "train")
        val, _ = scan_imagefolder(root, "val", classes)
        index = {"train": train, "val": val}
        _fewer_classes(classes, d.num_classes, os.path.join(root, "train"), log)
    elif d.name == "shards":
        if not d.root:
            raise ConfigError("data.root: required for data=shards (a tr-prepare output)")
        from tr_hydra.data.shards import load_shards
        parts, classes = load_shards(d.root, log)
        index = {s: SplitIndex(labels, paths=names, blob=blob) for s, (labels, names, blob) in parts.items()}
        _fewer_classes(classes, d.num_classes, d.root, log, "classes")
    elif d.name == "arrays":
        if not d.path:
            raise ConfigError("data.path: required for data=arrays")
        index = load_arrays(d.path, spec.num_classes)
    else:
        raise ConfigError(f"data={d.name} is not a DALI source")
    for split in ("train", "val"):
        check_labels(index[split], spec.num_classes, f"{split} split")
    return index


def _fewer_classes(classes: list, n: int, where, log, what: str = "class folders") -> None:
    if len(classes) < n:
        log(f"data: {where} has {len(classes)} {what} but data.num_classes={n}: {n - len(classes)} of the "
            f"model's outputs never see a label (set data.num_classes={len(classes)} if that is not meant)")


DEPTH = 2  # batches DALI prepares ahead of the one being consumed


# tr-prepare's shards decoded on the host pay from this many threads per rank: about 560 img/s a
# thread, against 6,228 img/s for the same shards decoded on the GPU beside ResNet-50's step (docs/input.md)
HOST_DECODE_MIN_THREADS = 12


def decodes_on_host(d, gpu: bool, threads: int) -> bool:
    """``data.decode``: where JPEGs are decoded. ``auto`` decodes tr-prepare's shards (at most
    320 px) on the host's ``threads`` when there are ``HOST_DECODE_MIN_THREADS`` of them, so the
    step's SMs run no decode kernels beside it; full-size files, which the host's threads could
    not keep up with, and shards with fewer threads on the GPU (nvJPEG)."""
    if not gpu:
        return True
    if d.decode != "auto":
        return d.decode == "host"
    return d.name == "shards" and threads >= HOST_DECODE_MIN_THREADS


def dali_threads(spec, local_ranks: int = 1, cpus: int | None = None) -> int:
    """``data.num_threads``: a count, or ``auto``: the cores this process may use, shared with
    the other ranks on the host (at most ``local_ranks`` of them), at least one."""
    if spec != "auto":
        return max(1, int(spec))
    if cpus is None:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", local_ranks) or local_ranks)
    return max(1, cpus // max(1, local))


class _Stream:
    """One split at one (resolution, full batch size), for the whole run: a pipeline with DALI's
    pipelined asynchronous executor that is fed, ``DEPTH`` batches ahead of the one consumed, the
    batches the plan will ask for next, across epoch ends (the partial last batch and the next
    epoch's first batches included; validation passes repeat). Files are read by DALI's own
    threads (``io.file.read`` of the paths fed); in-memory arrays are fed as they are. Random
    augmentation draws come from the pipeline's generators, whose state a checkpoint keeps
    (``state``), so a resumed run draws the same crops as one that never stopped. A request for
    anything else (another position, resolution or batch size) builds a new stream there."""

    def __init__(self, src: "DaliSource", split: str, key: tuple, pos: tuple, checkpoint: bytes | None = None):
        self.src, self.split, self.key = src, split, key
        self.at = pos                 # the next (epoch, index) to feed; None: the plan ends here
        self.fed: collections.deque = collections.deque()  # (pos, ids, replaced) fed, not taken
        self._started = False
        self.before: tuple | None = None  # (position, DALI state) before the latest batch taken
        res, batch = key
        self.pipe = src._build(split, res, batch, stream=True, checkpoint=checkpoint)

    def peek(self) -> tuple | None:
        """The position the next ``run`` returns."""
        return self.fed[0][0] if self.fed else self.at

    def _feed(self) -> None:
        pos = self.at
        if pos is None:  # past the plan's end: repeat the last batch so DALI's prefetch is fed
            _, ids, _ = self.fed[-1]
            replaced = 0
        else:
            ids, replaced = self.src._planned(self.split, pos, self.key[1])
            self.at = self.src._following(self.split, pos, self.key)
        self.pipe.feed_input("images", self.src._samples(self.split, ids))
        self.fed.append((pos, ids, replaced))

    def _schedule(self) -> None:
        for _ in range(1 if self._started else DEPTH):  # the first run prefetches DEPTH batches
            self._feed()
        self.pipe.schedule_run()
        self._started = True

    def run(self) -> tuple[object, np.ndarray, int]:
        """(images, the sample ids they are, how many known-bad samples were replaced)."""
        if not self._started or (len(self.fed) < DEPTH and self.at is not None):
            self._schedule()
        # DALI's state before this batch (0.1 ms): a run stopped mid-epoch has taken the batch
        # after its last step, and resumes at that batch
        if self.split == "train":
            self.before = (self.fed[0][0], self.pipe.checkpoint())
        out = self.pipe.outputs()
        pos, ids, replaced = self.fed.popleft()
        if pos is None:
            raise DataError(f"data: the {self.split} stream ran past its plan")
        return out[0], ids, replaced

    def resume_points(self) -> list[tuple[tuple, bytes]]:
        """(position, DALI state from which that position's batch is drawn) before the latest
        batch taken and now: the state after the batches taken, not the ones decoding ahead."""
        points = [self.before] if self.before is not None and self.before[0] is not None else []
        if self.peek() is not None:
            points.append((self.peek(), self.pipe.checkpoint()))
        return points


def _retire(stream: "_Stream | None") -> None:
    """Drop a stream that is no longer read on a background thread: a pipeline's destructor
    stops its workers and frees its buffers (device frees synchronise), which would otherwise
    happen on the training thread."""
    if stream is None:
        return
    box = [stream]
    del stream
    threading.Thread(target=box.clear, daemon=False, name="tr_hydra-dali-retire").start()


class DaliSource:
    """The batches of a plan's data (``spec``: ``PlanConfig.source_spec``), rank ``shard_id`` of
    ``num_shards``'s share of each split."""

    def __init__(self, spec: SourceSpec, device: torch.device, out_dtype: torch.dtype,
                 shard_id: int = 0, num_shards: int = 1, log=print):
        self.spec, self.device, self.log = spec, device, log
        self.shard_id, self.num_shards = shard_id, num_shards
        self._filtering = False
        self.index = load_index(spec, log)
        for split, want in (("train", spec.train_size), ("val", spec.val_size)):
            total = want * num_shards
            if len(self.index[split]) < total:
                raise ConfigError(f"data.{split}_size: the plan expects {total} {split} samples "
                                  f"but the source has {len(self.index[split])}")
            self.index[split] = self.index[split].subset(total)
        # DALI has no bfloat16: bf16 runs get fp16 from DALI, written into the arena as it is
        # (executor.input_dtype); the step's first convolution converts it
        self.half = out_dtype in (torch.float16, torch.bfloat16)
        self.dali_dtype = torch.float16 if self.half else torch.float32
        self._pipes: dict[tuple, object] = {}    # synchronous pipelines (fallback, bad-file search)
        self._streams: dict[str, _Stream] = {}   # one asynchronous stream per split
        self._resume: dict | None = None         # a checkpointed train stream, until it is rebuilt
        self.ahead_used = 0                      # epochs whose first batch was decoding before the switch
        self.copy_wait = 0.0                     # host seconds waiting for the previous copy out
        self._orders: dict[tuple[str, int], np.ndarray] = {}
        self._bad: set[int] = set()  # train/val sample ids known to be undecodable
        self.skipped = 0
        self._after = None  # the copy out of the latest batch; DALI reuses its buffers after it
        self.threads = dali_threads(spec.data.num_threads, num_shards)  # DALI's, per pipeline
        # where this source's JPEGs are decoded: "host" or "gpu" (kept in a checkpoint's input state)
        self.decoded_on = "host" if decodes_on_host(spec.data, device.type == "cuda", self.threads) else "gpu"
        if self.index["train"].encoded and device.type == "cuda":
            d = spec.data
            if self.decoded_on == "host":
                where = f"on the host ({self.threads} threads)"
            else:
                where = "by nvJPEG on the GPU"
                if d.decode == "auto" and d.name == "shards":
                    where += f" ({self.threads} threads per rank, under the {HOST_DECODE_MIN_THREADS} the host needs)"
            log(f"data: JPEGs decoded {where} (data.decode={d.decode})")
        if self.index["train"].encoded:  # until close(): the decoders' own lines about damaged files dropped
            DecoderNoiseFilter.acquire()
            self._filtering = True

    def close(self) -> None:
        """The process's stderr as it was (see ``DecoderNoiseFilter``); the pipelines stay."""
        if self._filtering:
            self._filtering = False
            DecoderNoiseFilter.release()

    # ------------------------------------------------------------------ pipelines
    def _pipeline(self, split: str, res: int, max_batch: int, epoch: int):
        """A synchronous pipeline (a batch after a failed decode); its training augmentation is
        seeded by (seed, epoch)."""
        key = (split, res, max_batch, epoch if split == "train" else 0)
        if key not in self._pipes:
            self._pipes = {k: v for k, v in self._pipes.items() if k[0] != split or k[3] == key[3]}
            self._pipes[key] = self._build(split, res, max_batch, epoch=key[3])
        return self._pipes[key]

    def _build(self, split: str, res: int, max_batch: int, device_override=None, epoch: int = 0,
               stream: bool = False, checkpoint: bytes | None = None):
        """A pipeline taking a batch through ``feed_input("images", ...)``: encoded files by path
        (DALI's threads read them), in-memory arrays as they are. ``stream``: DALI's pipelined
        asynchronous executor ``DEPTH`` batches ahead, with checkpointing (``checkpoint``: the
        state to start from); otherwise the synchronous executor."""
        from nvidia.dali import fn, pipeline_def, types
        d, encoded = self.spec.data, self.index[split].encoded
        gpu = (device_override or self.device).type == "cuda"
        host = decodes_on_host(d, gpu, self.threads)
        augment = split == "train" and d.augment
        # the share of JPEGs for the GPU's hardware decoder (the rest: nvJPEG on the host's threads)
        hw = {"hw_decoder_load": d.hw_decoder_load} if not host and d.hw_decoder_load is not None else {}
        dtype = types.FLOAT16 if self.half else types.FLOAT
        # a stream's generators run on over the epochs; a synchronous pipeline is per epoch
        salt = (self.shard_id * 1009 + 7) if stream else epoch * 104729
        kw = {"enable_checkpointing": True, "checkpoint": checkpoint} if stream else {}

        @pipeline_def(batch_size=max_batch, num_threads=self.threads,
                      device_id=(self.device.index or 0) if gpu else None,
                      seed=(self.spec.seed * 7919 + salt + res * 31 + (split == "val")) % (2**31),
                      prefetch_queue_depth=DEPTH if stream else 1,
                      exec_async=stream, exec_pipelined=stream, **kw)
        def pipe():
            if encoded:
                enc = fn.external_source(name="images", dtype=types.UINT8, ndim=1)
                if self.index[split].blob is None:  # file paths, not shards' JPEG bytes: read them
                    # plain reads: mapping each file read 25,000 files/s against 41,000-55,000
                    # with plain reads (2 threads, page cache warm)
                    enc = fn.io.file.read(enc, dont_use_mmap=True)
                dev = "cpu" if host else "mixed"
                if augment:  # decode only the random crop's region (DALI's fused decoder and crop)
                    img = fn.decoders.image_random_crop(enc, device=dev, output_type=types.RGB,
                                                        random_area=list(d.crop_scale),
                                                        random_aspect_ratio=list(d.crop_ratio), **hw)
                    img = fn.resize(img, size=(res, res))
                else:
                    img = fn.decoders.image(enc, device=dev, output_type=types.RGB, **hw)
            else:
                img = fn.external_source(name="images", dtype=types.UINT8, ndim=3, layout="HWC")
                if gpu:
                    img = img.gpu()
            if augment:
                if not encoded:
                    img = fn.random_resized_crop(img, size=(res, res), random_area=list(d.crop_scale),
                                                 random_aspect_ratio=list(d.crop_ratio))
                mirror = fn.random.coin_flip() if d.flip else 0
            else:
                shorter = res if split == "train" else int(round(res / d.val_crop))
                img = fn.resize(img, resize_shorter=shorter)
                mirror = 0
            if encoded and gpu and host:  # decoded and resized on the host: normalised on the GPU
                img = img.gpu()
            return fn.crop_mirror_normalize(img, crop=(res, res), mirror=mirror, mean=list(d.mean),
                                            std=list(d.std), dtype=dtype, output_layout="HWC",
                                            pad_output=self.half)
        p = pipe()
        p.build()
        return p

    # ------------------------------------------------------------------ batches
    def order(self, split: str, epoch: int) -> np.ndarray:
        key = (split, epoch if split == "train" else 0)
        if key not in self._orders:
            self._orders = {k: v for k, v in self._orders.items() if k[0] != split or k[1] >= key[1] - 1}
            shuffle = self.spec.data.shuffle and split == "train"
            self._orders[key] = epoch_order(len(self.index[split]), self.spec.seed, epoch, shuffle,
                                            self.shard_id, self.num_shards)
        return self._orders[key]

    def _samples(self, split: str, ids: np.ndarray) -> list:
        """What a pipeline is fed for ``ids``: the shards' bytes, the encoded files' paths (as
        bytes), or the arrays."""
        idx = self.index[split]
        if idx.blob is not None:
            return [idx.blob(i) for i in ids]
        if idx.encoded:
            return [np.frombuffer(idx.paths[i].encode(), dtype=np.uint8) for i in ids]
        return [idx.images[i] for i in ids]

    def _planned(self, split: str, pos: tuple, batch: int) -> tuple[np.ndarray, int]:
        """The sample ids of batch ``pos`` = (epoch, index) at ``batch`` per full batch (the
        partial last batch is shorter), known-bad ones replaced; and how many were."""
        epoch, index = pos
        return self._replace_bad(split, self.order(split, epoch)[index * batch:(index + 1) * batch])

    def _train_res(self, epoch: int) -> int:
        return self.spec.variant(train_variants(self.spec, epoch)[0]).res

    def _following(self, split: str, pos: tuple, key: tuple) -> tuple | None:
        """The batch the plan asks a (resolution, batch) stream for after ``pos``: the next one
        of the epoch (the partial last one where the plan trains or validates it), then the next
        epoch's first if that epoch keeps the resolution (validation passes repeat); None past
        the plan's end."""
        epoch, index = pos
        res, batch = key
        n = len(self.order(split, epoch))
        partial = (train_variants(self.spec, epoch)[1] is not None if split == "train"
                   else self.spec.has_variant("val_last"))
        count = n // batch + (1 if n % batch and partial else 0)
        if index + 1 < count:
            return epoch, index + 1
        if split != "train":
            return epoch, 0
        if epoch + 1 >= self.spec.epochs or self._train_res(epoch + 1) != res:
            return None
        return epoch + 1, 0

    def prefetch(self, split: str, index: int, batch: int, size: int, res: int, epoch: int = 0,
                 after=None) -> None:
        """DALI already works ahead on the stream; ``after`` (a CUDA event) marks the end of the
        copy out of the latest batch, whose buffers the next run may reuse."""
        self._after = after

    def batch(self, split: str, index: int, batch: int, size: int, res: int, epoch: int = 0) -> DaliBatch:
        """Batch ``index`` of ``split`` in this epoch's order (``size`` samples: ``batch``, or
        fewer for the partial last one). The batches the plan asks for in turn come from the
        split's asynchronous stream, decoded ahead across epoch ends; any other request (a
        resumed position, another resolution, the batch after a failed decode) starts a new
        stream there."""
        if self._after is not None:
            t = time.perf_counter()
            self._after.synchronize()  # the previous batch's buffers are free once copied out
            self.copy_wait += time.perf_counter() - t  # the device's pace, not DALI's
            self._after = None
        key, pos = (res, batch), (epoch if split == "train" else 0, index)
        st = self._streams.get(split)
        if st is None or st.key != key or st.peek() != pos:
            _retire(self._streams.pop(split, None))
            st = self._streams[split] = _Stream(self, split, key, pos, checkpoint=self._checkpoint_for(split, key, pos))
        elif split == "train" and index == 0 and st._started:
            self.ahead_used += 1  # the stream went on from the last epoch: this batch was decoding
        try:
            with native_stderr_kept_on_success():
                images, ids, replaced = st.run()
        except DataError:
            self._streams.pop(split, None)
            raise
        except Exception:  # a read or decode failure: this batch synchronously, with the full handling
            self._streams.pop(split, None)
            return self._decode(split, index, batch, size, res, epoch)
        if len(ids) != size:
            raise DataError(f"data: {split} batch {index} has {len(ids)} samples, expected {size}")
        self.skipped += replaced
        labels = torch.from_numpy(self.index[split].labels[ids].copy())
        return DaliBatch(images, labels, self.dali_dtype)

    # ------------------------------------------------------------------ checkpoints
    def state(self) -> dict | None:
        """Where the train stream stands and its DALI state (the random generators after the
        batches taken), for a checkpoint: at the next batch, and before the latest one taken (a
        run stopped mid-epoch resumes there); None without a train stream."""
        st = self._streams.get("train")
        points = st.resume_points() if st is not None else []
        if not points:
            return None
        return {"res": st.key[0], "batch": st.key[1], "decode": self.decoded_on,
                "points": [{"epoch": p[0], "index": p[1], "dali": torch.frombuffer(bytearray(c), dtype=torch.uint8)}
                           for p, c in points]}

    def restore(self, state: dict | None) -> None:
        """Start the train stream from a checkpoint's ``state`` when the run asks for its batch.
        JPEGs decoded elsewhere than the checkpoint's run did (``data.decode``) would give other
        crops: refused in one line (a checkpoint without the key: nvJPEG on CUDA)."""
        if state is not None and self.index["train"].encoded:
            was = state.get("decode", "gpu" if self.device.type == "cuda" else "host")
            if was != self.decoded_on:
                how = f"with data.decode={was}" if self.device.type == "cuda" else "on a GPU"
                raise ConfigError(f"data.decode: the checkpoint's run decoded its JPEGs on the "
                                  f"{'host' if was == 'host' else 'GPU'}; resume {how} to draw the same crops")
        self._resume = state

    def _checkpoint_for(self, split: str, key: tuple, pos: tuple) -> bytes | None:
        r = self._resume
        if split != "train" or r is None:
            return None
        self._resume = None  # used once: a stream built anywhere else starts fresh
        if (r["res"], r["batch"]) != key:
            return None
        for p in r["points"]:
            if (p["epoch"], p["index"]) == pos:
                return bytes(p["dali"].numpy())
        return None

    def _decode(self, split: str, index: int, batch: int, size: int, res: int, epoch: int = 0) -> DaliBatch:
        ids = self.order(split, epoch)[index * batch:index * batch + size]
        if len(ids) != size:
            raise DataError(f"data: {split} batch {index} has {len(ids)} samples, expected {size}")
        ids, replaced = self._replace_bad(split, ids)
        self.skipped += replaced
        pipe = self._pipeline(split, res, max(batch, size), epoch)
        try:
            pipe.feed_input("images", self._samples(split, ids))
            with native_stderr_kept_on_success():
                (images,) = pipe.run()
        except DataError:
            raise
        except Exception as e:  # a sample DALI cannot decode: find it, then skip or stop
            self._pipes.pop((split, res, max(batch, size), epoch if split == "train" else 0), None)
            bad = self._find_bad(split, ids, res)
            if not bad:
                raise DataError(f"data: the {split} pipeline failed: {str(e).splitlines()[0]}") from None
            paths = [self.index[split].paths[i] if self.index[split].encoded else f"{split} sample {i}" for i in bad]
            if not self.spec.data.skip_corrupt:
                raise DataError(f"data: cannot decode {paths[0]}"
                                f"{f' (and {len(paths) - 1} more in this batch)' if len(paths) > 1 else ''}; "
                                f"set data.skip_corrupt=true to skip such files") from None
            self._bad.update(int(i) for i in bad)
            self.log(f"data: skipping {len(bad)} undecodable file(s), e.g. {paths[0]}")
            return self._decode(split, index, batch, size, res, epoch)
        labels = torch.from_numpy(self.index[split].labels[ids].copy())
        return DaliBatch(images, labels, self.dali_dtype)

    def _replace_bad(self, split: str, ids: np.ndarray) -> tuple[np.ndarray, int]:
        """A known-bad sample is replaced by a good one of the same batch, so every variant keeps
        its shape; each replacement counts as skipped (the count is returned)."""
        if not self._bad:
            return ids, 0
        bad = np.isin(ids, list(self._bad))
        if not bad.any():
            return ids, 0
        good = ids[~bad]
        if good.size == 0:
            raise DataError(f"data: every sample of a {split} batch is undecodable")
        ids = ids.copy()
        ids[bad] = good[np.arange(bad.sum()) % good.size]
        return ids, int(bad.sum())

    def _find_bad(self, split: str, ids: np.ndarray, res: int) -> list[int]:
        """Decode each sample alone on the CPU; the ones that fail are the bad ones."""
        probe = self._build(split, res, 1, device_override=torch.device("cpu"))
        bad = []
        for i in ids:
            try:
                probe.feed_input("images", self._samples(split, np.asarray([i])))
                with native_stderr_kept_on_success():
                    probe.run()
            except DataError:
                raise
            except Exception:
                if self.index[split].encoded and self.index[split].blob is None:  # unreadable is no decode failure
                    try:
                        with open(self.index[split].paths[i], "rb"):
                            pass
                    except OSError as e:
                        raise DataError(f"data: cannot read {self.index[split].paths[i]}: {e.strerror}") from None
                bad.append(int(i))
                probe = self._build(split, res, 1, device_override=torch.device("cpu"))
        return bad
