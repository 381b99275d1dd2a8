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

    def put(self, buffer: str, variant: str, images: torch.Tensor, labels: torch.Tensor) -> None:
        img, lab = self.ex.input_views(variant, buffer)
        if img.shape != images.shape:
            raise ValueError(f"batch of shape {tuple(images.shape)} does not fit variant {variant} "
                             f"{tuple(img.shape)}")
        if not self.cuda:
            img.copy_(images)
            lab.copy_(labels)
            return
        # the source produced its tensors on the current stream
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(self.consumed[buffer])  # the step that last read it is done
            img.copy_(images, non_blocking=True)
            lab.copy_(labels, non_blocking=True)
            self.copied[buffer].record(self.stream)
        images.record_stream(self.stream)
        labels.record_stream(self.stream)

    def before_step(self, buffer: str) -> None:
        if self.cuda:
            torch.cuda.current_stream().wait_event(self.copied[buffer])

    def after_step(self, buffer: str) -> None:
        if self.cuda:
            self.consumed[buffer].record(torch.cuda.current_stream())
