"""tr-train: compose (Hydra), compile, allocate, capture and train. Sweeps with -m."""
from __future__ import annotations

import contextlib
import os
import sys
import time
from pathlib import Path

from tr_hydra.cli._common import (compose, fail, one_line, parse_overrides, user_errors, with_source_defaults,
                                  without_hydra)
from tr_hydra.cli.plugins import check_plugins, search_sweeper
from tr_hydra.cli.run_dir import check_run_dir, check_writable, results_in, take_dir
from tr_hydra.config.locate import config_dir
from tr_hydra.errors import ConfigError
from tr_hydra.resolve import Counts, resolve

# this process's sweep (-m): how many jobs ran, and "job N: reason" for each that failed (main's exit code)
_SWEEP = {"jobs": 0, "failed": []}
PER_INVOCATION = ("trainer.max_steps=",)  # what a resume does not take from the run's saved config
EXIT_JOBS_FAILED = 1  # a sweep ran to its end and some of its jobs failed (2: refused before anything ran)
# the datasets this invocation counted (``main`` starts it empty): its checks before Hydra and its
# Hydra task, or a sweep's jobs of the same data, count each once
_COUNTS = Counts()


def _is_multirun(argv: list[str], composed) -> bool:
    """-m, or a config that sets hydra.mode=MULTIRUN (as a search config may); ``composed``:
    ``_composed(argv)``."""
    if any(a in ("-m", "--multirun", "hydra.mode=MULTIRUN") for a in argv):
        return True
    return composed is not None and str(composed.hydra.mode) == "RunMode.MULTIRUN"


def _fixed(argv: list[str]) -> list[str]:
    """The overrides that are not sweeps (``a=1,2``, ``choice(...)``, ``interval(...)``)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    args = _all_overrides(argv)
    try:
        parsed = OverridesParser.create().parse_overrides(args)
    except Exception:  # noqa: BLE001 - composing them names the bad one
        return args
    return [o.input_line for o in parsed if not o.is_sweep_override()]


def _composed(argv: list[str]):
    """The config, hydra node included, as the fixed overrides compose it; None where they do
    not (Hydra, or the checks before it, say why)."""
    try:
        return compose(_fixed(argv), return_hydra_config=True)
    except Exception:  # noqa: BLE001 - Hydra itself reports what does not compose
        return None


def _overrides(argv: list[str]) -> list[str]:
    return [a for a in argv if not a.startswith("-") and "=" in a and not a.startswith("hydra")]


def _all_overrides(argv: list[str]) -> list[str]:
    """The overrides, hydra.* ones included."""
    return [a for a in argv if not a.startswith("-") and "=" in a]


def _hydra_dirs(composed):
    """(hydra.run.dir, hydra.sweep.dir) of a config composed with its hydra node, as Hydra will
    resolve them; None where it did not compose."""
    if composed is None:
        return None, None
    try:
        return str(composed.hydra.run.dir), str(composed.hydra.sweep.dir)
    except Exception:  # noqa: BLE001 - Hydra itself reports what does not resolve
        return None, None


def _sweep_jobs(argv: list[str]) -> list[list[str]]:
    """The jobs of a -m sweep, each as its overrides (as Hydra's basic sweeper expands them)."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser
    parsed = OverridesParser.create().parse_overrides(_all_overrides(argv))
    return [job for batch in BasicSweeper.split_arguments(parsed, None) for job in batch]


def _task_config(argv: list[str], composed):
    """The config of a run's overrides, without the hydra node: ``composed`` (``_composed(argv)``)
    where it holds every one of them, else composed again (which says what does not compose)."""
    if composed is not None and _fixed(argv) == _all_overrides(argv):
        return without_hydra(composed)
    return compose(_overrides(argv))


def _check_before_hydra(argv: list[str], multirun: bool, rank0: bool, composed) -> list[str]:
    """What Hydra would report as a multi-line error or a traceback, as one line (exit 2),
    before anything is written: every override parses, the config of the run (or every job of a
    sweep) composes, the run or sweep dir can be made and holds no other run's results. Then the
    dir is this process's (``take_dir``: a lock, held until the process ends) and named to Hydra
    by its real path; a resume of the run there composes from the run's saved config. Returns
    argv as Hydra is to run it. ``composed``: ``_composed(argv)``, the one composition of a run's
    overrides the checks share."""
    from tr_hydra.config.plan_config import resume_choice
    with user_errors("tr-train"):
        parse_overrides(_all_overrides(argv))
        check_plugins(_all_overrides(argv))
        if not multirun:
            cfg = _task_config(argv, composed)
            pc = resolve(cfg, _COUNTS)
            run_dir, _ = _hydra_dirs(composed)
            if run_dir is None:
                return argv
            run_dir = os.path.realpath(run_dir)  # "a/nothere/../run1" is run1: the dir checked is the dir used

            def as_run() -> tuple[list[str], bool]:  # every rank composes what rank 0 does
                resumed = _resumed(run_dir, argv, cfg) if pc.resume is not None else None
                return (resumed, True) if resumed else (with_source_defaults(argv, composed), False)
            if not rank0:
                return as_run()[0]
            check_writable("hydra.run.dir", run_dir)
            argv = _named("hydra.run.dir", run_dir, argv)

            def only_this_run():
                nonlocal argv
                argv, resumed = as_run()
                # a resume runs on the run's saved config, composed anew; else the run is pc's
                check_run_dir("hydra.run.dir", run_dir, resolve(compose(_overrides(argv)), _COUNTS) if resumed else pc)
            take_dir("hydra.run.dir", run_dir, only_this_run)
            return argv
        # a sweep: every job's config composes (a value of the wrong type is refused here, naming
        # key and value); the checks of each job's values are its own (a failed job is a row).
        # A search sweeper picks its jobs' values itself: what is fixed composes, and the
        # sweeper must seek the objective's best, not its worst
        fixed = composed if composed is not None else compose(_fixed(argv), return_hydra_config=True)
        if search_sweeper(fixed.hydra):
            from tr_hydra.config.objective import check_sweeper_direction
            check_sweeper_direction(fixed.trainer.objective, fixed.hydra.sweeper.get("direction"))
            jobs = [_fixed(argv)]
            _, sweep_dir = _hydra_dirs(fixed)
        else:
            jobs = _sweep_jobs(argv)
            first = _composed(jobs[0]) if jobs else None  # with its hydra node: the sweep dir's
            for i, job in enumerate(jobs):
                if i or first is None:
                    compose(_overrides(job))
            _, sweep_dir = _hydra_dirs(first if jobs else fixed)
        argv = with_source_defaults(argv, fixed)
        if not rank0 or sweep_dir is None:
            return argv
        sweep_dir = os.path.realpath(sweep_dir)
        check_writable("hydra.sweep.dir", sweep_dir)
        resumes = all(any(o.split("=", 1)[0].lstrip("+") == "resume" and resume_choice(o.split("=", 1)[1])
                          for o in job) for job in jobs)

        def no_other_sweep():
            held = sorted((d.name for d in Path(sweep_dir).iterdir() if d.is_dir() and results_in(d)),
                          key=lambda n: (len(n), n))
            if held and not resumes:
                raise ConfigError(f"hydra.sweep.dir={sweep_dir} already holds another sweep's results "
                                  f"(job{'s' if len(held) > 1 else ''} {', '.join(held)}); a run never "
                                  f"writes over another's: leave hydra.sweep.dir out (a new dir), pick "
                                  f"another, or add resume=auto to continue those jobs")
        take_dir("hydra.sweep.dir", sweep_dir, no_other_sweep)
        return _named("hydra.sweep.dir", sweep_dir, argv)


def _named(key: str, path: str, argv: list[str]) -> list[str]:
    """argv with ``key`` set to ``path`` (quoted: any character of a path is a value)."""
    from tr_hydra.cli.rerun import quoted
    return [a for a in argv if a.split("=", 1)[0].lstrip("+") != key] + [f"{key}={quoted(path)}"]


def _resumed(run_dir: str, argv: list[str], cfg) -> list[str] | None:
    """A resume of the run in ``run_dir``: argv after the run's saved config, so what the command
    line leaves out is what the run had, not today's default; an override that changes what the
    run computes is refused (``record.resume_changes`` names the rest in the log). None where the
    dir holds no record. ``cfg``: what argv's overrides compose to."""
    from tr_hydra.cli.record import explicit_changes, saved_config
    from tr_hydra.cli.rerun import rerun_overrides
    saved = saved_config(run_dir)
    if saved is None:  # no record (an older run's dir, or a new one): the checkpoint's fingerprint decides
        return None
    explicit_changes(run_dir, saved, cfg, _overrides(argv))
    # trainer.max_steps stops one invocation (a run stopped there goes on when resumed)
    return [o for o in rerun_overrides(run_dir, quiet=True) if not o.startswith(PER_INVOCATION)] + argv


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


def run(cfg) -> float:
    """The Hydra task: one training run in the Hydra run dir; returns ``trainer.objective``'s
    best value (NaN where no validation ran), what a search sweeper optimises. Alone, a mistake or
    a stop ends the process with one line (exit 2); in a sweep (-m) a job's error of any kind is
    that job's ``failed.txt`` and its row in the summary, and the sweep goes on to the next job:
    Hydra's basic sweeper gets NaN, a search sweeper (Optuna, ...) a failed trial, which it records
    as failed before it goes on (within its ``max_failure_rate``)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode
    hc = HydraConfig.get()
    run_dir = hc.runtime.output_dir
    if hc.mode != RunMode.MULTIRUN:
        with user_errors("tr-train"):
            try:
                return _train(cfg, run_dir, "hydra.run.dir")
            except OSError as e:  # a disk error (the run dir, a checkpoint) is one line too
                fail("tr-train", e)
    from tr_hydra.telemetry.sweep import FAILED
    _SWEEP["jobs"] += 1
    failed = Path(run_dir) / FAILED
    try:
        failed.unlink(missing_ok=True)  # a resumed job's earlier failure
        return _train(cfg, run_dir, "hydra.sweep.dir")
    except (Exception, SystemExit) as e:  # noqa: BLE001 - a sweep survives a failed job; Ctrl-C ends it
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            import traceback
            traceback.print_exception(e)
        reason = one_line(e) if not isinstance(e, SystemExit) else f"exited with status {e.code}"
        _SWEEP["failed"].append(f"job {hc.job.num}: {reason}")
        print(f"tr-train: job {hc.job.num} failed: {reason}", file=sys.stderr, flush=True)
        try:
            failed.write_text(reason + "\n")
        except OSError as w:
            print(f"tr-train: {failed} not written: {w.strerror}", file=sys.stderr, flush=True)
        if not search_sweeper(hc):
            return float("nan")
        raise TrialFailed(f"job {hc.job.num}: {reason}") from None


class TrialFailed(RuntimeError):
    """A sweep's job that failed, as a search sweeper is told (its reason is in failed.txt)."""


def _train(cfg, run_dir: str, key: str) -> float:
    from tr_hydra.runtime.world import env_world, submitit_job
    w = env_world()
    rank0 = w is None or w[0] == 0  # the other ranks keep no run dir of their own
    changes = _record(cfg, run_dir) if rank0 else []
    pc = resolve(cfg, _COUNTS)
    if rank0:
        check_run_dir(key, run_dir, pc)
    from tr_hydra.train.trainer import Trainer
    say = _RunLog(run_dir)
    if changes:
        say(f"resume: the run's saved config, with {'; '.join(changes)}")
    job = submitit_job()
    if job:
        say(job)
    with say.errors():
        trainer = Trainer(pc, run_dir, log=say)
        if not trainer.is_main:
            try:
                trainer.fit()
            finally:
                _close(trainer)
            return float("nan")
        say(f"run dir {run_dir}  device {trainer.device}  arena {trainer.compiled.plan.total_bytes:,} bytes  "
            f"model={pc.model.name} optimizer={pc.optimizer.name} amp={pc.amp_dtype if pc.amp else 'off'}")
        try:
            result = trainer.fit()
        finally:
            _close(trainer)
    if result.preempted:
        return float("nan")
    last = result.epochs[-1] if result.epochs else {}
    top1 = last.get("val", {}).get("top1")
    val = f"final val top1 {top1:.2f}" if top1 is not None else "final val top1 n/a (the last epoch ran no validation)"
    say(f"done: {result.steps} steps, {result.img_per_sec:,.1f} img/s, {val}, weights in {result.final_path}")
    return float(result.summary.get("objective_value", float("nan")))


def _record(cfg, run_dir: str) -> list[str]:
    """The run's record: written for a new run; a resume of a recorded run keeps it and returns
    what it changes (refused where a change is not one a resume may make)."""
    from hydra.core.hydra_config import HydraConfig
    from tr_hydra.cli.record import resume_changes, saved_config, write_record
    from tr_hydra.config.plan_config import resume_choice
    if resume_choice(cfg.resume) is not None and saved_config(run_dir) is not None:
        return resume_changes(run_dir, cfg)
    write_record(run_dir, cfg, HydraConfig.get())
    return []


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
    global _COUNTS
    argv = sys.argv[1:] if argv is None else argv
    _COUNTS = Counts()  # what an earlier call in this process counted may have changed since
    rank = _rank_overrides()
    argv = _expand_rerun(argv)
    composed = _composed(argv)
    multirun = _is_multirun(argv, composed)
    if not any(a.startswith("-") and a not in ("-m", "--multirun") for a in argv):  # not --help, --cfg, ...
        argv = _check_before_hydra(argv, multirun, rank0=not rank, composed=composed)
    argv = argv + rank
    import hydra
    task = hydra.main(version_base="1.3", config_path=str(config_dir()), config_name="config")(run)
    sys.argv = [sys.argv[0]] + argv
    from tr_hydra.cli.plugins import SweepStopped, stopped, sweep_stops
    try:
        with sweep_stops():
            task()
    except SweepStopped as e:  # the sweeper raised once the sweep began: what ran, and why it stopped
        print(f"tr-train: {stopped(Path(e.sweep_dir), e.error)}", file=sys.stderr, flush=True)
        return EXIT_JOBS_FAILED
    except SystemExit:
        raise
    except Exception as e:  # Hydra reports most errors itself; anything else is one line too
        fail("tr-train", e)
    if multirun:
        # the summary's rows (its callback reads each job's dir, whatever launcher ran the jobs),
        # or what the jobs in this process said
        from tr_hydra.telemetry.sweep import LAST
        rows = LAST.get("rows") or []
        failed = max(sum(1 for r in rows if r.get("failed")), len(_SWEEP["failed"]))
        jobs = max(len(rows), _SWEEP["jobs"])
        if failed:
            print(f"tr-train: {failed} of {jobs} sweep jobs failed (rows 'failed:' in the summary)",
                  file=sys.stderr, flush=True)
            return EXIT_JOBS_FAILED
    return 0


if __name__ == "__main__":
    sys.exit(main())
