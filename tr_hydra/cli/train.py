"""tr-train: compose (Hydra), compile, allocate, capture and train. Sweeps with -m."""
from __future__ import annotations

import contextlib
import sys
import time

from tr_hydra.cli._common import compose, fail, user_errors
from tr_hydra.config.locate import config_dir


def _is_multirun(argv: list[str]) -> bool:
    return any(a in ("-m", "--multirun") for a in argv)


def _overrides(argv: list[str]) -> list[str]:
    return [a for a in argv if not a.startswith("-") and "=" in a and not a.startswith("hydra")]


def _close(trainer) -> None:
    """The graphs first, then the process group: a graph holding an NCCL collective keeps the
    communicator alive, and destroying the group would wait for it for ever."""
    from tr_hydra.runtime.distributed import shutdown
    try:
        trainer.close()
    finally:
        shutdown()


class _RunLog:
    """What a run says: on stdout, and appended, time-stamped, to the run dir's train.log (the
    file Hydra names after the job), so the log is kept with the run."""

    def __init__(self, run_dir: str):
        from pathlib import Path
        self.path = Path(run_dir) / "train.log"

    def __call__(self, msg: str) -> None:
        print(msg, flush=True)
        try:
            with open(self.path, "a") as f:
                f.write(f"[{time.strftime('%Y-%m-%d %H:%M:%S')}] {msg}\n")
        except OSError:  # a full or read-only disk must not stop training: stdout still has it
            pass

    @contextlib.contextmanager
    def errors(self):
        """An error that ends the run is written to train.log too (stderr says it as well)."""
        try:
            yield
        except BaseException as e:
            msg = f"stopped: {type(e).__name__}: {e}".rstrip(": ")
            try:
                with open(self.path, "a") as f:
                    f.write(f"[{time.strftime('%Y-%m-%d %H:%M:%S')}] {msg}\n")
            except OSError:
                pass
            raise


def run(cfg) -> dict:
    """The Hydra task: one training run in the Hydra run dir."""
    from hydra.core.hydra_config import HydraConfig

    from tr_hydra.config.plan_config import plan_config_from
    with user_errors("tr-train"):
        pc = plan_config_from(cfg)
        from tr_hydra.train.trainer import Trainer
        run_dir = HydraConfig.get().runtime.output_dir
        say = _RunLog(run_dir)
        with say.errors():
            trainer = Trainer(pc, run_dir, log=say)
            if not trainer.is_main:
                try:
                    trainer.fit()
                finally:
                    _close(trainer)
                return {}
            say(f"run dir {run_dir}  device {trainer.device}  arena {trainer.compiled.plan.total_bytes:,} bytes  "
                f"model={pc.model.name} optimizer={pc.optimizer.name} amp={pc.amp_dtype if pc.amp else 'off'}")
            try:
                result = trainer.fit()
            finally:
                _close(trainer)
    if result.preempted:
        return {}
    last = result.epochs[-1] if result.epochs else {}
    top1 = last.get("val", {}).get("top1")
    val = f"final val top1 {top1:.2f}" if top1 is not None else "final val top1 n/a (the last epoch ran no validation)"
    say(f"done: {result.steps} steps, {result.img_per_sec:,.1f} img/s, {val}, weights in {result.final_path}")
    return last


def _expand_rerun(argv: list[str]) -> list[str]:
    """--rerun DIR: the saved config of a past run as overrides, then the rest of argv."""
    from tr_hydra.cli.rerun import rerun_overrides
    out, i = [], 0
    while i < len(argv):
        a = argv[i]
        if a == "--rerun" or a.startswith("--rerun="):
            if a == "--rerun":
                if i + 1 >= len(argv):
                    fail("tr-train", ValueError("--rerun needs a run dir"))
                run_dir, i = argv[i + 1], i + 2
            else:
                run_dir, i = a.split("=", 1)[1], i + 1
            with user_errors("tr-train"):
                out = rerun_overrides(run_dir) + out
            continue
        out.append(a)
        i += 1
    return out


def _rank_overrides() -> list[str]:
    """Under torchrun only rank 0 keeps a run dir; the others write nothing of their own."""
    from tr_hydra.runtime.world import env_world
    w = env_world()
    if w is None or w[0] == 0:
        return []
    import tempfile
    return ["hydra.output_subdir=null", f"hydra.run.dir={tempfile.gettempdir()}/tr_hydra_rank{w[0]}",
            "hydra/job_logging=disabled", "hydra/hydra_logging=disabled"]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    argv = _expand_rerun(argv) + _rank_overrides()
    if not _is_multirun(argv) and not any(a.startswith("--") for a in argv):
        # Compose once up front so a bad override is one line, not a Hydra report.
        with user_errors("tr-train"):
            from tr_hydra.config.plan_config import plan_config_from
            plan_config_from(compose(_overrides(argv)))
    import hydra
    task = hydra.main(version_base="1.3", config_path=str(config_dir()), config_name="config")(run)
    sys.argv = [sys.argv[0]] + argv
    try:
        task()
    except SystemExit:
        raise
    except Exception as e:  # Hydra reports most errors itself; anything else is one line too
        fail("tr-train", e)
    return 0


if __name__ == "__main__":
    sys.exit(main())
