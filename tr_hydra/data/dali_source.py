"""NVIDIA DALI input: imagefolder, arrays and digits through one pipeline shape.

The host decides every batch (order from (seed, epoch), shard, partial last batch) and feeds the
samples through ``external_source``; DALI decodes (nvJPEG "mixed" on GPU, CPU otherwise),
augments and normalises to NHWC in the compute dtype, and the feeder copies the result straight
into the idle arena input buffer.
"""
from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

import numpy as np
import torch

from tr_hydra.config.plan_config import PlanConfig
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


@contextlib.contextmanager
def native_stderr_kept_on_success():
    """DALI's decoders print their own lines to the C-level stderr before raising; those would
    break the one-line error. Capture them: pass them on when the run succeeds, drop them when it
    fails (the exception, turned into a DataError, says what went wrong)."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        ok = False
        try:
            yield
            ok = True
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            if ok:
                tmp.seek(0)
                text = tmp.read()
                if text:
                    sys.stderr.write(text.decode(errors="replace"))


def load_index(pc: PlanConfig) -> dict[str, SplitIndex]:
    d = pc.data
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
    elif d.name == "arrays":
        if not d.path:
            raise ConfigError("data.path: required for data=arrays")
        index = load_arrays(d.path, pc.model.num_classes)
    else:
        raise ConfigError(f"data={d.name} is not a DALI source")
    for split in ("train", "val"):
        check_labels(index[split], pc.model.num_classes, f"{split} split")
    return index


DEPTH = 2  # batches DALI prepares ahead of the one being consumed


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
    """One split's full batches in order from ``start``, through a pipeline with DALI's pipelined
    asynchronous executor, ``DEPTH`` batches ahead of the one consumed. Files are read by DALI's
    own file reader (its threads, not Python's) from the exact list this (seed, epoch, shard)
    orders; in-memory arrays come through a callback. After the last full batch the stream wraps
    to its first (validation passes repeat; a train stream ends with its epoch, so it schedules
    nothing past its last batch: no decode is left in flight when the next epoch's stream takes
    over); a partial last batch is not part of the stream."""

    def __init__(self, src: "DaliSource", split: str, key: tuple, batch: int, start: int, order=None):
        self.src, self.split, self.key, self.batch = src, split, key, batch
        res, max_batch, epoch = key
        self.order = src.order(split, epoch) if order is None else order
        self.count = len(self.order) // batch   # full batches
        self.first = self.next = start          # the index the next run() returns
        batches = [src._replace_bad(split, self.order[i * batch:(i + 1) * batch]) for i in range(start, self.count)]
        self._replaced = [r for _, r in batches]
        self._ids = [ids for ids, _ in batches]
        self._fed = 0
        self._started = False  # the first schedule_run prefetches DEPTH batches, later ones one
        self._pending = 0      # batches scheduled and not yet taken
        self._primed = False
        idx = src.index[split]
        if idx.encoded:
            ids = np.concatenate(self._ids) if self._ids else np.zeros(0, np.int64)
            files = ([idx.paths[i] for i in ids], [int(i) for i in ids])
            self.pipe = src._build(split, res, max_batch, epoch=epoch, files=files)
        else:
            self.pipe = src._build(split, res, max_batch, epoch=epoch, source=self._next)

    def _next(self):
        ids = self._ids[self._fed]
        self._fed = (self._fed + 1) % len(self._ids)
        return self.src._samples(self.split, ids)

    def _schedule(self) -> None:
        self.pipe.schedule_run()
        self._pending += 1 if self._started else DEPTH
        self._started = True

    def prime(self) -> None:
        """Start decoding the first ``DEPTH`` batches now (the stream built ahead does this on
        its thread, so the next epoch's first batch is ready at the switch)."""
        if not self._started:
            self._schedule()
            self._primed = True

    def run(self) -> tuple[object, np.ndarray, int]:
        """(images, the sample ids they are, how many known-bad samples were replaced)."""
        # DALI's scheduled API: keep DEPTH batches scheduled ahead, take the oldest. A train
        # stream schedules nothing past its pass (this batch and the ones after it).
        left = self.count - self.next
        if self._pending == 0 or (not self._primed and self._pending < DEPTH
                                  and (self.split != "train" or self._pending < left)):
            self._schedule()
        self._primed = False
        out = self.pipe.outputs()
        self._pending -= 1
        k = self.next - self.first
        self.next = self.next + 1 if self.next + 1 < self.count else self.first
        ids = self._ids[k]
        if len(out) > 1:  # the reader says which files it read: they must be the planned ones
            got = np.asarray(out[1].as_array()).reshape(-1)
            if not np.array_equal(got, ids):
                raise DataError(f"data: the {self.split} reader is out of step (batch {self.first + k})")
        return out[0], ids, self._replaced[k]


def _retire(stream: "_Stream | None") -> None:
    """Drop a stream that is no longer read on a background thread: a pipeline's destructor
    stops its workers and frees its buffers (device frees synchronise), which would otherwise
    happen on the training thread at the epoch switch."""
    if stream is None:
        return
    box = [stream]
    del stream
    threading.Thread(target=box.clear, daemon=False, name="tr_hydra-dali-retire").start()


class _Ahead:
    """The next epoch's training stream, built on a background thread while this epoch runs, and
    its first batches decoded there too: a pipeline decodes nothing until it is first run, so a
    stream only built ahead still left the first step of each epoch waiting 0.62 s (H200, batch
    256, 16 threads)."""

    def __init__(self, key: tuple, build):
        self.key, self.stream, self.error = key, None, None
        # not a daemon: a run that ends mid-build (max_steps) waits for the build at exit rather
        # than tearing DALI down under it
        self._thread = threading.Thread(target=self._run, args=(build,), daemon=False,
                                        name="tr_hydra-dali-ahead")
        self._thread.start()

    def _run(self, build) -> None:
        try:
            stream = build()
            stream.prime()
            self.stream = stream
        except BaseException as e:  # noqa: BLE001 - reported by taking the synchronous path
            self.error = e

    def take(self) -> "_Stream | None":
        self._thread.join()
        return self.stream


class DaliSource:
    def __init__(self, pc: PlanConfig, device: torch.device, out_dtype: torch.dtype,
                 shard_id: int = 0, num_shards: int = 1, log=print):
        self.pc, self.device, self.log = pc, device, log
        self.shard_id, self.num_shards = shard_id, num_shards
        self.index = load_index(pc)
        for split, want in (("train", pc.train_size), ("val", pc.val_size)):
            total = want * num_shards
            if len(self.index[split]) < total:
                raise ConfigError(f"data.{split}_size: the plan expects {total} {split} samples "
                                  f"but the source has {len(self.index[split])}")
            self.index[split] = self.index[split].subset(total)
        # DALI has no bfloat16: bf16 runs get fp16 from DALI and cast on the copy into the arena
        self.half = out_dtype in (torch.float16, torch.bfloat16)
        self.dali_dtype = torch.float16 if self.half else torch.float32
        self._pipes: dict[tuple, object] = {}    # synchronous pipelines (fallback, bad-file search)
        self._streams: dict[str, _Stream] = {}   # one asynchronous stream per split
        self._ahead: dict[str, _Ahead] = {}      # the next epoch's stream, being built
        self.ahead_used = 0                      # epochs whose stream was ready in advance
        self.copy_wait = 0.0                     # host seconds waiting for the previous copy out
        self._orders: dict[tuple[str, int], np.ndarray] = {}
        self._bad: set[int] = set()  # train/val sample ids known to be undecodable
        self.skipped = 0
        self._after = None  # the copy out of the latest batch; DALI reuses its buffers after it

    # ------------------------------------------------------------------ pipelines
    def _pipeline(self, split: str, res: int, max_batch: int, epoch: int):
        # training augmentation is seeded by (seed, epoch): a resumed run draws the same crops
        key = (split, res, max_batch, epoch if split == "train" else 0)
        if key not in self._pipes:
            self._pipes = {k: v for k, v in self._pipes.items() if k[0] != split or k[3] == key[3]}
            self._pipes[key] = self._build(split, res, max_batch, epoch=key[3])
        return self._pipes[key]

    def _build(self, split: str, res: int, max_batch: int, device_override=None, epoch: int = 0,
               source=None, files=None):
        """A pipeline fed through ``feed_input`` (synchronous executor), or DALI's pipelined
        asynchronous executor working ``DEPTH`` batches ahead, reading ``files`` ((paths, sample
        ids) in order) with its file reader or taking batches from ``source`` (a callable)."""
        stream = source is not None or files is not None
        from nvidia.dali import fn, pipeline_def, types
        d, encoded = self.pc.data, self.index[split].encoded
        gpu = (device_override or self.device).type == "cuda"
        augment = split == "train" and d.augment
        dtype = types.FLOAT16 if self.half else types.FLOAT

        @pipeline_def(batch_size=max_batch, num_threads=dali_threads(d.num_threads, self.num_shards),
                      device_id=(self.device.index or 0) if gpu else None,
                      seed=(self.pc.seed * 7919 + epoch * 104729 + res * 31 + (split == "val")) % (2**31),
                      prefetch_queue_depth=DEPTH if stream else 1,
                      exec_async=stream, exec_pipelined=stream)
        def pipe():
            src = {"source": source, "batch": True} if source else {"name": "images"}
            sid = None
            if files is not None:
                enc, sid = fn.readers.file(files=files[0], labels=files[1], random_shuffle=False,
                                           name="Reader", prefetch_queue_depth=DEPTH)
                img = fn.decoders.image(enc, device="mixed" if gpu else "cpu", output_type=types.RGB)
            elif encoded:
                enc = fn.external_source(**src, dtype=types.UINT8, ndim=1)
                img = fn.decoders.image(enc, device="mixed" if gpu else "cpu", output_type=types.RGB)
            else:
                img = fn.external_source(**src, dtype=types.UINT8, ndim=3, layout="HWC")
                if gpu:
                    img = img.gpu()
            if augment:
                img = fn.random_resized_crop(img, size=(res, res), random_area=list(d.crop_scale),
                                             random_aspect_ratio=list(d.crop_ratio))
                mirror = fn.random.coin_flip() if d.flip else 0
            else:
                shorter = res if split == "train" else int(round(res / d.val_crop))
                img = fn.resize(img, resize_shorter=shorter)
                mirror = 0
            out = fn.crop_mirror_normalize(img, crop=(res, res), mirror=mirror, mean=list(d.mean),
                                           std=list(d.std), dtype=dtype, output_layout="HWC",
                                           pad_output=self.half)
            return (out, sid) if sid is not None else out
        p = pipe()
        p.build()
        return p

    # ------------------------------------------------------------------ batches
    def order(self, split: str, epoch: int) -> np.ndarray:
        key = (split, epoch if split == "train" else 0)
        if key not in self._orders:
            self._orders = {k: v for k, v in self._orders.items() if k[0] != split}  # keep one per split
            shuffle = self.pc.data.shuffle and split == "train"
            self._orders[key] = epoch_order(len(self.index[split]), self.pc.seed, epoch, shuffle,
                                            self.shard_id, self.num_shards)
        return self._orders[key]

    def _samples(self, split: str, ids: np.ndarray):
        idx = self.index[split]
        if idx.encoded:
            out = []
            for i in ids:
                try:
                    out.append(np.fromfile(idx.paths[i], dtype=np.uint8))
                except OSError as e:
                    raise DataError(f"data: cannot read {idx.paths[i]}: {e.strerror}") from None
            return out
        return [idx.images[i] for i in ids]

    def prefetch(self, split: str, index: int, batch: int, size: int, res: int, epoch: int = 0,
                 after=None) -> None:
        """DALI already works ahead on the stream; ``after`` (a CUDA event) marks the end of the
        copy out of the latest batch, whose buffers the next run may reuse."""
        self._after = after

    def batch(self, split: str, index: int, batch: int, size: int, res: int, epoch: int = 0) -> DaliBatch:
        """Batch ``index`` of ``split`` in this epoch's order. Consecutive full batches come from
        the split's asynchronous stream, decoded ahead; any other request (a resumed position,
        a failed decode) starts a new stream there. A partial last batch (once per epoch) is
        decoded on its own."""
        if self._after is not None:
            t = time.perf_counter()
            self._after.synchronize()  # the previous batch's buffers are free once copied out
            self.copy_wait += time.perf_counter() - t  # the device's pace, not DALI's
            self._after = None
        if size < batch:
            return self._decode(split, index, batch, size, res, epoch)
        key = (res, batch, epoch if split == "train" else 0)
        st = self._streams.get(split)
        if st is None or st.key != key or st.next != index:
            _retire(self._streams.pop(split, None))
            st = self._streams[split] = self._stream_ready(split, key, index) or _Stream(self, split, key, batch, index)
            if split == "train":
                self._build_ahead(split, key, batch)
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

    def _stream_ready(self, split: str, key: tuple, index: int) -> "_Stream | None":
        """The stream built ahead for this (resolution, batch, epoch), if that is what is asked
        for from its first batch; otherwise None (the guess is dropped)."""
        ahead = self._ahead.pop(split, None)
        if ahead is None or ahead.key != key or index != 0:
            return None
        st = ahead.take()
        if st is not None:
            self.ahead_used += 1
        return st

    def _build_ahead(self, split: str, key: tuple, batch: int) -> None:
        """Start building the next epoch's stream, guessing it keeps this resolution and batch
        (a wrong guess, at the switch from low to full resolution, costs one unused build)."""
        res, max_batch, epoch = key
        if epoch + 1 >= self.pc.trainer.epochs:
            return
        nkey = (res, max_batch, epoch + 1)
        order = epoch_order(len(self.index[split]), self.pc.seed, epoch + 1,
                            self.pc.data.shuffle and split == "train", self.shard_id, self.num_shards)
        self._ahead[split] = _Ahead(nkey, lambda: _Stream(self, split, nkey, batch, 0, order=order))

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
            if not self.pc.data.skip_corrupt:
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
                bad.append(int(i))
                probe = self._build(split, res, 1, device_override=torch.device("cpu"))
        return bad
