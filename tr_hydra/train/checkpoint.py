"""Checkpoints: the persistent regions of the arena, byte for byte, plus what resuming needs.

File layout: 8-byte magic, 32-byte SHA-256 of the payload, payload (``torch.save`` of plain
tensors, numbers and strings). A truncated or altered file fails the checksum before anything is
deserialised, and loading uses ``weights_only=True``: no code runs. A payload that passes its
checksum but that loading refuses (a crafted pickle), or that lacks a key or holds one of another
type, is a ``CheckpointError`` naming the file and what is wrong, as a corrupt file is (so
``resume=auto`` takes an older one). Files are written to a
temporary name, fsynced and renamed, so a crash leaves the previous checkpoint intact; a write
that fails (read-only file system, full disk) removes its temporary file and raises a
``DiskError`` naming the file and the cause.
"""
from __future__ import annotations

import hashlib
import io
import re
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from tr_hydra.errors import TrHydraError, disk_error
from tr_hydra.files import write_atomic  # the trainer writes metrics.json through it too (ck.write_atomic)
from tr_hydra.memory.arena import ArenaKeeper
from tr_hydra.memory.regions import ALL_REGIONS, Region
from tr_hydra.train import tally

MAGIC = b"TRHCKPT1"
NAME = re.compile(r"^ckpt_e(\d{4})_s(\d{8})\.pt$")

# Regions that carry state from step to step; I, F, T, G and per-step results are rebuilt by
# every step, so they are not saved. N (LARS) holds the step's norms and trust ratios: the
# update writes them before it reads them, every step.
TRANSIENT_SERIES = ("I", "F", "T", "G", "G16", "N")
TRANSIENT_REGIONS = {Region.R_RESULT, Region.R_PREDICTED_LABEL}


class CheckpointError(TrHydraError):
    pass


def persistent_regions(arena: ArenaKeeper) -> list[Region]:
    return [r for r in ALL_REGIONS
            if arena.plan.region_size[r] and r.series not in TRANSIENT_SERIES and r not in TRANSIENT_REGIONS]


@dataclass
class Position:
    epoch: int   # epochs completed
    step: int    # optimizer steps completed


def save(path: Path, arena: ArenaKeeper, *, position: Position, fingerprint: str, config: dict,
         describe: dict, history: list, extra: dict | None = None) -> Path:
    regions = {r.name: arena.span(r, r, torch.uint8).to("cpu", copy=True) for r in persistent_regions(arena)}
    payload = {
        "format": 1,
        "regions": regions,
        "region_sizes": {r.name: arena.plan.region_size[r] for r in ALL_REGIONS},
        "position": {"epoch": position.epoch, "step": position.step},
        "fingerprint": fingerprint,
        "describe": describe,
        "config": config,
        "history": history,
        "rng": {"torch": torch.get_rng_state()},
        "extra": extra or {},
    }
    if torch.cuda.is_available():
        payload["rng"]["cuda"] = torch.cuda.get_rng_state_all()
    data = _saved(payload)
    return write_atomic(Path(path), MAGIC, hashlib.sha256(data).digest(), data, what="checkpoint")


def _saved(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def atomic_save(obj, path: Path, what: str = "weights") -> Path:
    """``torch.save(obj)`` into ``path``, whole or not at all (``model_final.pt``)."""
    return write_atomic(Path(path), _saved(obj), what=what)


def load(path: str | Path) -> dict:
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise CheckpointError(f"resume: cannot read {path}: {e.strerror}") from None
    if len(raw) < 40 or raw[:8] != MAGIC:
        raise CheckpointError(f"resume: {path} is not a tr_hydra checkpoint")
    digest, data = raw[8:40], raw[40:]
    if hashlib.sha256(data).digest() != digest:
        raise CheckpointError(f"resume: {path} is truncated or corrupt (checksum mismatch)")
    try:
        with warnings.catch_warnings():  # (a payload in torch's legacy format warns of its protocol)
            warnings.simplefilter("ignore")
            state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except MemoryError:
        raise
    except Exception as e:  # noqa: BLE001 - a crafted payload fails in many ways (unpickling, struct, EOF, codecs...)
        raise CheckpointError(f"resume: {path} holds a payload that torch.load(weights_only=True) "
                              f"refuses ({_load_error(e)})") from None
    why = malformed(state)
    if why:
        raise CheckpointError(f"resume: {path} is not a whole tr_hydra checkpoint ({why})")
    return state


def _load_error(e: Exception) -> str:
    """What torch's loader says, without its advice to load with ``weights_only=False``: the first
    sentence of the unpickler's own message."""
    text = str(e)
    if "WeightsUnpickler error:" in text:
        text = text.split("WeightsUnpickler error:", 1)[1]
    elif text.startswith("Weights only load failed."):
        head, _, rest = text.partition("\n")
        text = rest if "weights_only" in head else head.removeprefix("Weights only load failed.")
    line = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
    return line.split(". ")[0].removesuffix(".") or type(e).__name__


# the payload's keys and their types, as ``save`` writes them
_KEYS = {"format": int, "regions": dict, "region_sizes": dict, "position": dict, "fingerprint": str,
         "describe": dict, "config": dict, "history": list, "rng": dict, "extra": dict}


def malformed(state) -> str | None:
    """What a loaded payload lacks, or holds of another type, for ``save``'s structure."""
    def kind(v):
        return type(v).__name__
    if not isinstance(state, dict):
        return f"{'an' if kind(state)[0] in 'aeiou' else 'a'} {kind(state)}, not a dict"
    for key, want in _KEYS.items():
        if key not in state:
            return f"no {key!r}"
        if not isinstance(state[key], want) or isinstance(state[key], bool):
            return f"{key!r} is {kind(state[key])}, not {want.__name__}"
    if state["format"] != 1:
        return f"format {state['format']}; this tr_hydra reads format 1"
    for name, t in state["regions"].items():
        if not isinstance(t, torch.Tensor) or t.dtype != torch.uint8 or t.dim() != 1:
            return f"region {name!r} is not a 1-D uint8 tensor"
    if not all(isinstance(v, int) for v in state["region_sizes"].values()):
        return "'region_sizes' holds a value that is not an int"
    for key in ("epoch", "step"):
        v = state["position"].get(key)
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            return f"position {key!r} is {'missing' if v is None else repr(v)}, not a count"
    for rec in state["history"]:
        if not (isinstance(rec, dict) and isinstance(rec.get("epoch"), int) and isinstance(rec.get("step"), int)
                and isinstance(rec.get("train"), dict) and isinstance(rec["train"].get("count"), (int, float))):
            return "a 'history' record without its epoch, step and train metrics"
    rng = state["rng"]
    if not isinstance(rng.get("torch"), torch.Tensor) or rng["torch"].dtype != torch.uint8:
        return "'rng' has no torch generator state (a uint8 tensor)"
    if "cuda" in rng and not (isinstance(rng["cuda"], list) and all(isinstance(t, torch.Tensor) for t in rng["cuda"])):
        return "'rng' holds a cuda state that is not a list of tensors"
    if "data" in state["extra"] and not isinstance(state["extra"]["data"], list):
        return "'extra' holds input state ('data') that is not a list"
    return tally.check_extra(state["extra"])


def check_compatible(ckpt: dict, arena: ArenaKeeper, fingerprint: str, describe: dict, path) -> None:
    """Refuse a checkpoint of another plan, naming what differs."""
    if ckpt["fingerprint"] == fingerprint:
        return
    diffs = [f"{k} {ckpt['describe'].get(k)!r} vs {v!r}" for k, v in describe.items()
             if ckpt["describe"].get(k) != v]
    for r in ALL_REGIONS:
        old, new = ckpt["region_sizes"].get(r.name, 0), arena.plan.region_size[r]
        if old != new:
            diffs.append(f"region {r.name} {old:,} vs {new:,} bytes")
            break
    raise CheckpointError(f"resume: {path} comes from another plan ({'; '.join(diffs) or 'layout differs'})")


def restore(ckpt: dict, arena: ArenaKeeper) -> None:
    for r in persistent_regions(arena):
        src = ckpt["regions"].get(r.name)
        dst = arena.span(r, r, torch.uint8)
        if src is None or src.numel() != dst.numel():
            raise CheckpointError(f"resume: region {r.name} is missing or has another size")
        dst.copy_(src)
    torch.set_rng_state(ckpt["rng"]["torch"])
    if "cuda" in ckpt["rng"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(ckpt["rng"]["cuda"])


def checkpoints_in(run_dir: Path) -> list[Path]:
    """Checkpoint files of a run dir, newest first."""
    d = Path(run_dir) / "checkpoints"
    if not d.is_dir():
        return []
    found = [p for p in d.iterdir() if NAME.match(p.name)]
    return sorted(found, key=lambda p: tuple(int(x) for x in NAME.match(p.name).groups()), reverse=True)


def newest_valid(run_dir: Path, log=print) -> Path | None:
    """The newest checkpoint that loads (its checksum, its payload and its structure); broken
    ones are skipped with a note.
    None when the run dir has none; when it has some but every one is broken, a
    ``CheckpointError`` (they are kept: a run that started afresh there would replace them)."""
    found = checkpoints_in(run_dir)
    first = None
    for i, p in enumerate(found):
        try:
            load(p)
            return p
        except CheckpointError as e:
            first = first or str(e).removeprefix("resume: ")
            log(f"{e}; trying an older one" if i + 1 < len(found) else str(e))
    if found:
        n = len(found)
        raise CheckpointError(
            f"resume=auto: {'the' if n == 1 else f'all {n}'} checkpoint{'s' if n > 1 else ''} in "
            f"{Path(run_dir) / 'checkpoints'} {'is' if n == 1 else 'are'} corrupt ({first}); "
            f"{'it is' if n == 1 else 'they are'} kept: move {'it' if n == 1 else 'them'} away, "
            f"or train in another run dir (leave hydra.run.dir out for a new one)")
    return None


def prune(run_dir: Path, keep: int) -> None:
    for p in checkpoints_in(run_dir)[max(keep, 1):]:
        try:
            p.unlink(missing_ok=True)
        except OSError as e:
            raise disk_error("checkpoint", p, e, "remove") from None
