"""Synthetic data generated on the device from the seed: every class has a fixed low-frequency
pattern, each image is its class pattern plus noise. Learnable, so the loss must fall; costs
nothing at run time (batches are slices of a bank made once).

On CUDA the bank stays in pinned host memory, as a loader's batches would: the feeder copies each
batch into the arena's input buffer on its own stream while the previous step runs, and no device
memory goes to the bank (at ResNet-50 batch 32 it held 36.75 MiB on the device)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

BANK_BATCHES = 4  # distinct batches per (split, resolution); reused cyclically


class SyntheticSource:
    def __init__(self, num_classes: int, channels: int, seed: int, device, dtype: torch.dtype,
                 train_size: int, val_size: int, channel_pad: int = 0):
        self.num_classes, self.channels, self.seed = num_classes, channels, seed
        self.device, self.dtype, self.pad = device, dtype, channel_pad
        self.sizes = {"train": train_size, "val": val_size}
        g = torch.Generator().manual_seed(seed)
        self.patterns = torch.randn(num_classes, channels, 8, 8, generator=g)
        self._banks: dict[tuple[str, int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def _bank(self, split: str, res: int, batch: int):
        key = (split, res, batch)
        if key not in self._banks:
            n = min(self.sizes[split], BANK_BATCHES * batch)
            g = torch.Generator().manual_seed(self.seed * 1000 + res * 7 + (split == "val"))
            labels = torch.randint(0, self.num_classes, (n,), generator=g)
            pat = F.interpolate(self.patterns, size=(res, res), mode="bilinear", align_corners=False)
            imgs = pat[labels] + 0.8 * torch.randn(n, self.channels, res, res, generator=g)
            imgs = imgs.permute(0, 2, 3, 1).to(self.dtype)  # NHWC
            if self.pad > self.channels:  # the input buffer's padded layout: one plain copy per batch
                imgs = F.pad(imgs, (0, self.pad - self.channels))
            imgs = imgs.contiguous()
            labels = labels.to(torch.int32)
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
