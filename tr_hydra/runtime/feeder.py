"""A/B input feeder: the batch for step n+1 is copied into the idle input buffer on a side stream
while step n runs on the other; CUDA events order copy and step, the host never waits."""
from __future__ import annotations

import torch

from tr_hydra.runtime.executor import StepExecutor


class Feeder:
    def __init__(self, executor: StepExecutor):
        self.ex = executor
        self.cuda = executor.device.type == "cuda"
        if self.cuda:
            self.stream = torch.cuda.Stream(device=executor.device)
            self.copied = {b: torch.cuda.Event() for b in ("A", "B")}
            self.consumed = {b: torch.cuda.Event() for b in ("A", "B")}

    def put(self, buffer: str, variant: str, batch) -> None:
        """Copy a batch (a (images, labels) pair of tensors, or a DaliBatch) into ``buffer``."""
        if self.cuda:
            # Not waiting for the compute stream: that would wait for the step just launched and
            # serialise copy and step. Sources hand over batches that are ready on any stream
            # (DALI orders its own copies; synthetic banks are in pinned host memory).
            with torch.cuda.stream(self.stream):
                self.stream.wait_event(self.consumed[buffer])  # the step that last read it is done
                self._copy(buffer, variant, batch)
                self.copied[buffer].record(self.stream)
        else:
            self._copy(buffer, variant, batch)

    def _copy(self, buffer: str, variant: str, batch) -> None:
        if isinstance(batch, tuple):
            images, labels = batch
            img, lab = self.ex.input_views(variant, buffer)
            if img.shape != images.shape and images.shape[-1] != img.shape[-1]:  # padded channels
                img = self.ex.input_views(variant, buffer, padded=True)[0]
            if img.shape != images.shape:
                raise ValueError(f"batch of shape {tuple(images.shape)} does not fit variant {variant} "
                                 f"{tuple(img.shape)}")
            img.copy_(images, non_blocking=True)
            lab.copy_(labels, non_blocking=True)
            if self.cuda and images.is_cuda:
                images.record_stream(self.stream)
            return
        from nvidia.dali.plugin.pytorch import feed_ndarray
        img, lab = self.ex.input_views(variant, buffer, padded=batch.dtype == torch.float16)
        dense = batch.images.as_tensor()
        if tuple(dense.shape()) != tuple(img.shape):
            raise ValueError(f"DALI batch {tuple(dense.shape())} does not fit variant {variant} {tuple(img.shape)}")
        if img.dtype != batch.dtype:  # the buffers hold what DALI delivers (executor.input_dtype)
            raise ValueError(f"DALI batch of {batch.dtype} for an input buffer of {img.dtype}")
        # fp16 (bf16 compute included) or fp32: straight into the arena
        feed_ndarray(dense, img, cuda_stream=self.stream.cuda_stream if self.cuda else None)
        lab.copy_(batch.labels, non_blocking=True)

    def last_copy_event(self):
        """An event recorded after the latest copy (None on CPU, where copies are synchronous)."""
        if not self.cuda:
            return None
        ev = torch.cuda.Event()
        ev.record(self.stream)
        return ev

    def before_step(self, buffer: str) -> None:
        if self.cuda:
            torch.cuda.current_stream().wait_event(self.copied[buffer])

    def after_step(self, buffer: str) -> None:
        if self.cuda:
            self.consumed[buffer].record(torch.cuda.current_stream())
