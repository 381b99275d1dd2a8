"""tr-prepare: write a data source once as webdataset shards that data=shards reads.

    tr-prepare data=imagefolder data.root=/data/imagenet prepare.out=/data/imagenet-wds prepare.max_side=320
"""
from __future__ import annotations

import os
import sys
import time

from tr_hydra.cli._common import compose, fail, user_errors
from tr_hydra.errors import ConfigError

USAGE = ("usage: tr-prepare data=<imagefolder|digits|arrays> [data.root=DIR | data.path=FILE] prepare.out=DIR "
         "[prepare.max_side=320 prepare.quality=90 prepare.shard_samples=5000 prepare.workers=auto "
         "prepare.skip_corrupt=false]\nWrites the source's train and val splits as webdataset shards "
         "(train with data=shards data.root=DIR); a stopped run goes on where it stopped.")


def _checked(p) -> tuple:
    """(Settings, workers) from the composed ``prepare`` section; one line for a bad value."""
    from tr_hydra.data.prepare import Settings
    if not p.out:
        raise ConfigError("prepare.out: required (the dir to write the shards into)")
    if not 8 <= int(p.max_side) <= 65535:
        raise ConfigError(f"prepare.max_side: must be in [8, 65535] pixels, got {p.max_side}")
    if not 1 <= int(p.quality) <= 100:
        raise ConfigError(f"prepare.quality: must be in [1, 100], got {p.quality}")
    if int(p.shard_samples) < 1:
        raise ConfigError(f"prepare.shard_samples: must be >= 1, got {p.shard_samples}")
    w = p.workers
    if w == "auto":
        w = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    elif isinstance(w, bool) or not isinstance(w, int) or w < 1:
        raise ConfigError(f"prepare.workers: must be auto or >= 1, got {w!r}")
    return Settings(max_side=int(p.max_side), quality=int(p.quality), shard_samples=int(p.shard_samples)), int(w)


class _Progress:
    """A bar on a terminal; elsewhere (a log, a pipe) a line every 30 s."""

    def __init__(self, total: int):
        self.total, self.done, self.t0, self.last = total, 0, time.perf_counter(), time.perf_counter()
        self.bar = None
        if sys.stderr.isatty():
            from tqdm import tqdm
            self.bar = tqdm(total=total, unit="img", desc="tr-prepare", dynamic_ncols=True)

    def __call__(self, n: int) -> None:
        self.done += n
        if self.bar is not None:
            self.bar.update(n)
        elif time.perf_counter() - self.last >= 30:
            self.last = time.perf_counter()
            print(f"prepare: {self.done:,} of {self.total:,} images ({100 * self.done / max(self.total, 1):.0f}%), "
                  f"{time.perf_counter() - self.t0:.0f} s", flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv):
        print(USAGE)
        return 0
    from tr_hydra.config import schema
    from tr_hydra.config.plan_config import refuse_added_keys
    from tr_hydra.data.prepare import open_source, prepare
    with user_errors("tr-prepare"):
        cfg = compose(argv)
        refuse_added_keys(cfg, schema.Config)  # as tr-train: + adds only keys the schema declares
        settings, workers = _checked(cfg.prepare)
        source = open_source(cfg.data)  # scanned (and digested) once, for the bar's total and the work
    bar = _Progress(sum(len(s) for s in source.splits.values()))
    try:
        with user_errors("tr-prepare"):
            done = prepare(source, cfg.prepare.out, settings, workers, bool(cfg.prepare.skip_corrupt),
                           log=lambda m: print(m, flush=True), progress=bar)
    except OSError as e:  # a full or read-only disk: one line naming the path
        fail("tr-prepare", ConfigError(f"prepare.out: {e.filename or cfg.prepare.out}: {e.strerror or e}"))
    except KeyboardInterrupt:
        print("tr-prepare: stopped; the finished shards are kept: run the same command again to go on",
              file=sys.stderr, flush=True)
        return 130
    finally:
        bar.close()
    n = done["workers"]
    read, written = done["images_read"], done["images_written"]
    count = f"{written:,} images written" if read == written else f"{read:,} images read, {written:,} written"
    rate = (f"{count} in {done['seconds']:.1f} s: {done['img_per_sec']:,.1f} img/s "
            f"with {n} process{'es' if n != 1 else ''} ({done['img_per_sec'] / n:,.1f} img/s per process)"
            if done["img_per_sec"] else "nothing left to write")
    parts = ", ".join(f"{s} {m['count']:,} samples in {m['shards']} shard{'s' if m['shards'] != 1 else ''}"
                      + (f" ({m['skipped']} skipped)" if m["skipped"] else "") for s, m in done["splits"].items())
    use = (f"train with data=shards data.root={os.path.abspath(cfg.prepare.out)}" if done["splits"].get("train", {}).get("count")
           else "the train split holds no image: nothing to train on")
    print(f"prepare: {rate}; {parts}; {use}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
