"""TensorBoard telemetry into the run dir: training and validation scalars, region telemetry
(bytes per region and series, L2 norms of the populated W/G/M/V/E spans), the region table, a
picture of the arena, and the config as hparams."""
from __future__ import annotations

import contextlib
import math
import os
import threading
from pathlib import Path

import numpy as np
import torch

from tr_hydra.memory.regions import ALL_REGIONS, SERIES_ORDER, series_of

NORM_SERIES = ("W", "G", "M", "V", "E")
SERIES_COLORS = {"B": (76, 114, 176), "W": (221, 132, 82), "E": (85, 168, 104), "E16": (140, 200, 150),
                 "A": (196, 78, 82), "G": (129, 114, 179), "R": (40, 40, 40), "G16": (170, 160, 210),
                 "M": (147, 120, 96), "V": (218, 139, 195), "N": (140, 140, 140), "I": (204, 185, 116),
                 "F": (100, 181, 205), "S": (60, 60, 60), "T": (180, 180, 180)}


class SpanNorms:
    """L2 norm of every populated W, G, M, V, E span: one reduction each on the device, read in
    one transfer when the metrics are read. ``grads_16bit`` lists (fp32 span, 16-bit span) pairs
    whose fp32 side the step does not write (the update reads the 16-bit gradients): the G norm
    is then taken over the 16-bit side there. When the 16-bit gradients also share the A
    regions' bytes (``plan.share_grad16``), the step has rewritten them with the new 16-bit
    weights by the time the norms are read: their part comes from ``grad16_sumsq``, the sum of
    squares the step's non-finite check took while reading them. Without it, the norm is over
    the fp32 gradients only (BN, fc bias) and named ``G_fp32``, so that it is not taken for the
    whole."""

    def __init__(self, arena, grads_16bit=(), grad16_sumsq=None):
        self.views: list[tuple[str, list[torch.Tensor], torch.Tensor | None]] = []
        plan = arena.plan
        unwritten = {i for (a, b), _ in grads_16bit for i in range(int(a), int(b) + 1)}
        for series in NORM_SERIES:
            regions = [r for r in ALL_REGIONS if series_of(r) == series and plan.region_size[r]]
            if series == "G" and unwritten and plan.shared:
                parts = [arena.span(r, r) for r in regions if int(r) not in unwritten]
                self.views.append(("G" if grad16_sumsq is not None else "G_fp32", parts, grad16_sumsq))
            elif series == "G" and unwritten:
                parts = [arena.span(r, r) for r in regions if int(r) not in unwritten]
                parts += [arena.span(b16[0], b16[1]) for _, b16 in grads_16bit]
                self.views.append((series, parts, None))
            elif regions:
                self.views.append((series, [arena.span(regions[0], regions[-1], torch.float32)], None))

    def read(self) -> dict[str, float]:
        if not self.views:
            return {}
        norms = []
        for _, parts, sq in self.views:
            s2 = torch.stack([torch.linalg.vector_norm(p, dtype=torch.float32) ** 2 for p in parts]).sum()
            norms.append((s2 + sq.sum() if sq is not None else s2).sqrt())
        vals = torch.stack(norms).tolist()
        return {name: val for (name, _, _), val in zip(self.views, vals)}


def memory_map_image(plan, width: int = 1200, height: int = 260) -> np.ndarray:
    """The arena drawn to scale: one band, regions as coloured blocks, labelled where wide."""
    from PIL import Image, ImageDraw
    img = Image.new("RGB", (width, height), (255, 255, 255))
    d = ImageDraw.Draw(img)
    total = max(plan.total_bytes, 1)
    top, band = 30, 110
    d.text((8, 6), f"arena {total / 2**20:,.1f} MiB, 68 regions (to scale)", fill=(0, 0, 0))
    label_y = top + band + 8
    for r in ALL_REGIONS:
        size = plan.own_bytes(r)  # a region on another's bytes is drawn as that one
        if not size:
            continue
        x0 = int(plan.region_base[r] / total * (width - 1))
        x1 = max(x0 + 1, int((plan.region_base[r] + size) / total * (width - 1)))
        d.rectangle([x0, top, x1, top + band], fill=SERIES_COLORS[series_of(r)], outline=(255, 255, 255))
        if x1 - x0 > 60:
            d.text((x0 + 3, top + 4), r.name, fill=(0, 0, 0))
            d.text((x0 + 3, top + 18), f"{size / 2**20:.1f} MiB", fill=(0, 0, 0))
    x = 8
    for s in SERIES_ORDER:
        b = sum(plan.own_bytes(r) for r in ALL_REGIONS if series_of(r) == s)
        if not b:
            continue
        d.rectangle([x, label_y, x + 12, label_y + 12], fill=SERIES_COLORS[s])
        text = f"{s} {100 * b / total:.1f}%"
        d.text((x + 16, label_y), text, fill=(0, 0, 0))
        x += 22 + 7 * len(text)
    return np.asarray(img)


def region_table_markdown(plan) -> str:
    rows = ["| no. | region | tensors | bytes | base offset | share |", "|---|---|---:|---:|---:|---:|"]
    for r in ALL_REGIONS:
        if plan.region_size[r]:
            share = (f"on {plan.shared[r].name}" if r in plan.shared
                     else f"{100 * plan.region_size[r] / plan.total_bytes:.2f}%")
            rows.append(f"| {r.number} | {r.name} | {len(plan.tensors_in(r))} | {plan.region_size[r]:,} | "
                        f"{plan.region_base[r]:,} | {share} |")
    return "\n".join(rows)


def flat_config(d: dict, prefix: str = "") -> dict:
    """Nested config -> {"optimizer.lr": 0.1, ...} with values TensorBoard's hparams accept."""
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flat_config(v, key + "."))
        elif isinstance(v, (bool, int, float, str)):
            out[key] = v
        elif v is None:
            out[key] = "null"
        else:
            out[key] = str(v)
    return out


def _quiet_writer_threads() -> None:
    """TensorBoard's event writer writes on a thread of its own; a write that fails there (a
    read-only or full disk) would print that thread's traceback. The writer keeps the error
    and raises it in the training thread at its next write, flush or close, where
    ``Telemetry`` turns it into one line: the thread's own report is left out."""
    prev = threading.excepthook
    if getattr(prev, "_tr_hydra_tensorboard", False):
        return

    def hook(args):
        t = args.thread
        if (isinstance(args.exc_value, OSError) and type(t).__name__ == "_AsyncWriterThread"
                and type(t).__module__.startswith("tensorboard.")):
            return
        prev(args)
    hook._tr_hydra_tensorboard = True
    threading.excepthook = hook


class Telemetry:
    """TensorBoard scalars, text and images of one run (rank 0). A file it cannot write (a
    read-only ``tb/``, a full disk) turns TensorBoard off for the rest of the run with one
    line in the log; training goes on (the run's own files, checkpoints and metrics.json,
    stop the run with one line if they cannot be written)."""

    def __init__(self, run_dir: Path, compiled, arena, enabled: bool = True, grads_16bit=(), grad16_sumsq=None,
                 log=print):
        self.enabled = enabled
        self.norms = SpanNorms(arena, grads_16bit, grad16_sumsq)
        self.plan = compiled.plan
        self.log = log
        self.dir = Path(run_dir) / "tb"
        self.writer = None
        if enabled:
            _quiet_writer_threads()
            from torch.utils.tensorboard import SummaryWriter
            with self._guard():
                self.writer = SummaryWriter(log_dir=str(self.dir))

    @contextlib.contextmanager
    def _guard(self):
        """A failed write: one line, TensorBoard off (its writer's thread has stopped)."""
        try:
            yield
        except OSError as e:
            where = os.fsdecode(e.filename) if e.filename else str(self.dir)
            self.log(f"tensorboard: cannot write {where}: {e.strerror or type(e).__name__}; "
                     f"TensorBoard is off for the rest of this run")
            w, self.writer = self.writer, None
            if w is not None:
                with contextlib.suppress(Exception):
                    w.close()

    def start(self, step: int = 0) -> None:
        if not self.writer:
            return
        with self._guard():
            self._start(step)

    def _start(self, step: int) -> None:
        w, plan = self.writer, self.plan
        for r in ALL_REGIONS:
            if plan.region_size[r]:
                w.add_scalar(f"regions/bytes/{r.number}_{r.name}", plan.region_size[r], step)
        for s, b in plan.series_bytes().items():
            if b:
                w.add_scalar(f"series/bytes/{s}", b, step)
                w.add_scalar(f"series/fraction/{s}", b / plan.total_bytes, step)
        w.add_scalar("arena/total_bytes", plan.total_bytes, step)
        w.add_text("arena/region_table", region_table_markdown(plan), step)
        w.add_image("arena/memory_map", memory_map_image(plan), step, dataformats="HWC")

    def train(self, step: int, m: dict, *, lr: float, img_per_sec: float, step_time_ms: float,
              data_wait_ms: float, loss_scale: float | None, skipped: float) -> None:
        if not self.writer:
            return
        with self._guard():
            w = self.writer
            for k in ("loss", "top1", "top5"):
                w.add_scalar(f"train/{k}", m[k], step)
            w.add_scalar("lr", lr, step)
            w.add_scalar("img_per_sec", img_per_sec, step)
            w.add_scalar("step_time_ms", step_time_ms, step)
            w.add_scalar("data_wait_ms", data_wait_ms, step)
            w.add_scalar("skipped_steps", skipped, step)
            if loss_scale is not None:
                w.add_scalar("loss_scale", loss_scale, step)
            for name, val in self.norms.read().items():
                w.add_scalar(f"norms/{name}", val, step)

    def val(self, step: int, name: str, m: dict) -> None:
        if self.writer:
            with self._guard():
                for k in ("loss", "top1", "top5"):
                    self.writer.add_scalar(f"{name}/{k}", m[k], step)

    def close(self, config: dict | None = None, final: dict | None = None) -> None:
        """Flush and close (once; later calls do nothing)."""
        if not self.writer:
            return
        with self._guard():
            if config is not None and final:
                clean = {f"hparam/{k}": v for k, v in final.items() if isinstance(v, (int, float)) and math.isfinite(v)}
                self.writer.add_hparams(flat_config(config), clean, run_name=".")
            self.writer.flush()
            self.writer.close()
        self.writer = None
