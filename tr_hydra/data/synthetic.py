"""Synthetic data generated on the device from the seed: every class has a fixed low-frequency
pattern, each image is its class pattern plus noise. Learnable, so the loss must fall; costs
nothing at run time (batches are slices of a bank made once).

On CUDA the bank stays in pinned host memory, as a loader's batches would: the feeder copies each
batch into the arena's input buffer on its own stream while the previous step runs, and no device
memory goes to the bank (at ResNet-50 batch 32 it held 36.75 MiB on the device).

Making a bank is host work: ResNet-50's three (training at two resolutions, validation at
batch 256) took 11.6 s on a 2-core CPU. ``build_ahead`` makes them on a thread while the steps
compile, so that the first steps do not wait for it; the values are the same either way."""
from __future__ import annotations

import atexit
import threading
import weakref

import torch
import torch.nn.functional as F

BANK_BATCHES = 4  # distinct batches per (split, resolution); reused cyclically

# sources whose banks a thread may still be making. A process leaving while that thread is
# inside a torch op aborts in PyTorch's teardown ("terminate called without an active
# exception", status 134, not the process's own exit code): at exit, each is stopped after the
# bank in progress and joined
_AHEAD: "weakref.WeakSet[SyntheticSource]" = weakref.WeakSet()


@atexit.register
def _stop_all_ahead() -> None:
    for src in list(_AHEAD):
        src.close()


class SyntheticSource:
    def __init__(self, num_classes: int, channels: int, seed: int, device, dtype: torch.dtype,
                 train_size: int, val_size: int, channel_pad: int = 0):
        self.num_classes, self.channels, self.seed = num_classes, channels, seed
        self.device, self.dtype, self.pad = device, dtype, channel_pad
        self.sizes = {"train": train_size, "val": val_size}
        g = torch.Generator().manual_seed(seed)
        self.patterns = torch.randn(num_classes, channels, 8, 8, generator=g)
        self._banks: dict[tuple[str, int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self._ahead: dict[tuple[str, int, int], threading.Event] = {}  # build_ahead's keys: done when set
        self._made: dict[tuple[str, int, int], tuple[torch.Tensor, torch.Tensor]] = {}  # by the thread
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def _make(self, split: str, res: int, batch: int):
        """A bank's images (NHWC, padded) and labels, on the host, not yet pinned: CPU work only."""
        n = min(self.sizes[split], BANK_BATCHES * batch)
        g = torch.Generator().manual_seed(self.seed * 1000 + res * 7 + (split == "val"))
        labels = torch.randint(0, self.num_classes, (n,), generator=g)
        pat = F.interpolate(self.patterns, size=(res, res), mode="bilinear", align_corners=False)
        imgs = pat[labels] + 0.8 * torch.randn(n, self.channels, res, res, generator=g)
        imgs = imgs.permute(0, 2, 3, 1).to(self.dtype)  # NHWC
        if self.pad > self.channels:  # the input buffer's padded layout: one plain copy per batch
            imgs = F.pad(imgs, (0, self.pad - self.channels))
        return imgs.contiguous(), labels.to(torch.int32)

    def build_ahead(self, keys: list[tuple[str, int, int]]) -> None:
        """Make the banks for ``keys`` ((split, res, batch) as ``batch()`` will ask) on a thread,
        now. It does CPU work only: pinning (a CUDA call, which a CUDA graph capture elsewhere
        in the process would not allow) happens at first use, on the caller's thread."""
        todo = [k for k in dict.fromkeys(keys) if k not in self._banks and k not in self._ahead]
        if not todo:
            return
        for k in todo:
            self._ahead[k] = threading.Event()

        def work():
            for k in todo:
                try:
                    if not self._stop.is_set():  # stopped: the rest are made at first use
                        self._made[k] = self._make(*k)
                except Exception:  # noqa: BLE001 - only a head start: the bank is made at first use
                    pass
                finally:
                    self._ahead[k].set()
        self._thread = threading.Thread(target=work, name="tr_hydra-synthetic-banks", daemon=True)
        _AHEAD.add(self)
        self._thread.start()

    def close(self) -> None:
        """Stops making banks ahead (after the one in progress) and waits for the thread; a bank
        not made is made at first use."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        _AHEAD.discard(self)

    def _bank(self, split: str, res: int, batch: int):
        key = (split, res, batch)
        if key not in self._banks:
            done = self._ahead.get(key)
            if done is not None:
                done.wait()
            imgs, labels = self._made.pop(key, None) or self._make(*key)
            if torch.device(self.device).type == "cuda":  # host, pinned: copies to the device are async
                imgs, labels = imgs.pin_memory(), labels.pin_memory()
            else:
                imgs, labels = imgs.to(self.device), labels.to(self.device)
            self._banks[key] = (imgs, labels)
        return self._banks[key]

    def batch(self, split: str, index: int, batch: int, size: int, res: int, epoch: int = 0):
        """Images NHWC (compute dtype; with ``channel_pad``, that many channels, the extra ones
        zero) and int32 labels of batch ``index`` (``size`` <= batch); pinned host tensors when
        the device is CUDA."""
        imgs, labels = self._bank(split, res, batch)
        n = imgs.shape[0]
        start = (index * batch) % n
        if start + size > n:
            start = 0
        return imgs[start:start + size], labels[start:start + size]
