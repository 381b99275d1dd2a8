"""Clocks the bench's modes share: waiting for the device, and points in a timed run."""
from __future__ import annotations

import itertools
import time

import torch


def sync(device: torch.device | None = None) -> None:
    """Wait for ``device``'s queued work (every CUDA device's when None; nothing on the CPU)."""
    if device is None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    elif device.type == "cuda":
        torch.cuda.synchronize(device)


class Marks:
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
            return [a.elapsed_time(b) / 1e3 for a, b in itertools.pairwise(p)]
        return [b - a for a, b in itertools.pairwise(p)]


def epoch_rates(marks: Marks, images: list[int]) -> list[float]:
    """img/s of each timed part: the rest of the first epoch, then the second epoch."""
    return [n / s if s > 0 else 0.0 for n, s in zip(images, marks.seconds())]
