"""Data parallel on CPU with gloo and 2 processes launched by torchrun."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

from tests.integration.test_cli import ENV, run

ENV2 = ENV | {"OMP_NUM_THREADS": "1"}


def torchrun(n: int, *args, cwd):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}",
           "-m", "tr_hydra.cli.train", "dist=ddp", *args]
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, env=ENV2, timeout=600)


def _arrays(path: Path, n=64, val=16, res=16):
    rng = np.random.default_rng(0)
    y = rng.integers(0, 4, n + val)
    x = (rng.integers(0, 80, (n + val, res, res, 3)) + 40 * y[:, None, None, None]).astype(np.uint8)
    np.savez(path, x_train=x[:n], y_train=y[:n], x_val=x[n:], y_val=y[n:])


COMMON = ["data=arrays", "data.num_classes=4", "data.shuffle=false", "data.augment=false",
          "variants.base_res=16", "variants.val_res=16", "runtime.deterministic=true",
          "optimizer=sgd", "optimizer.lr=0.05", "optimizer.schedule=constant"]


def test_ddp_without_torchrun_is_one_line(tmp_path):
    env = {k: v for k, v in ENV.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR")}
    out = subprocess.run([sys.executable, "-m", "tr_hydra.cli.train", "dist=ddp"], cwd=tmp_path,
                         capture_output=True, text=True, env=env, timeout=300)
    lines = [l for l in out.stderr.splitlines() if l.strip()]
    assert out.returncode == 2 and len(lines) == 1 and "torchrun" in lines[0], out.stderr


def test_two_ranks_equal_one_rank_with_twice_the_batch(tmp_path):
    _arrays(tmp_path / "d.npz")
    args = COMMON + [f"data.path={tmp_path / 'd.npz'}", "model=convnet_mini", "trainer.epochs=2"]
    two = torchrun(2, *args, "variants.batch_size=8", "variants.val_batch_size=8",
                   f"hydra.run.dir={tmp_path / 'two'}", cwd=tmp_path)
    assert two.returncode == 0, two.stderr[-3000:]
    assert "weights identical on all 2 ranks" in two.stdout
    one = run("tr-train", *args, "variants.batch_size=16", "variants.val_batch_size=16",
              f"hydra.run.dir={tmp_path / 'one'}", cwd=tmp_path)
    assert one.returncode == 0, one.stderr[-3000:]
    a = torch.load(tmp_path / "two" / "model_final.pt", weights_only=True)
    b = torch.load(tmp_path / "one" / "model_final.pt", weights_only=True)
    for k in b:
        err = ((a[k].double() - b[k].double()).norm() / b[k].double().norm()).item()
        assert err <= 1e-5, (k, err)
    # only rank 0 keeps a run dir with files
    assert (tmp_path / "two" / "metrics.json").is_file() and (tmp_path / "two" / "tb").is_dir()
    # the ranks start the clock together, and say how long each waited for the others
    assert "all 2 ranks ready; waited for the others: rank 0" in two.stdout
    summary = json.loads((tmp_path / "two" / "metrics.json").read_text())["summary"]
    assert len(summary["start_wait_seconds"]) == 2 and min(summary["start_wait_seconds"]) >= 0
    assert "start_wait_seconds" not in json.loads((tmp_path / "one" / "metrics.json").read_text())["summary"]
    # the run's own log, kept in its run dir, holds what stdout said
    log = (tmp_path / "two" / "train.log").read_text()
    assert "weights identical on all 2 ranks" in log and "done: " in log


def test_two_ranks_checkpoint_and_resume(tmp_path):
    _arrays(tmp_path / "d.npz")
    args = COMMON + [f"data.path={tmp_path / 'd.npz'}", "model=resnet_mini", "variants.batch_size=8",
                     "variants.val_batch_size=8", "trainer.epochs=2"]
    full = torchrun(2, *args, f"hydra.run.dir={tmp_path / 'full'}", cwd=tmp_path)
    assert full.returncode == 0, full.stderr[-3000:]
    part = torchrun(2, *args, "trainer.max_steps=4", f"hydra.run.dir={tmp_path / 'part'}", cwd=tmp_path)
    assert part.returncode == 0, part.stderr[-3000:]
    again = torchrun(2, *args, "resume=auto", f"hydra.run.dir={tmp_path / 'part'}", cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed from" in again.stdout
    a = torch.load(tmp_path / "full" / "model_final.pt", weights_only=True)
    b = torch.load(tmp_path / "part" / "model_final.pt", weights_only=True)
    assert all(torch.equal(a[k], b[k]) for k in a)


def _mismatch_worker(rank, store, results):
    import torch.distributed as dist
    from tr_hydra.errors import ConfigError
    from tr_hydra.runtime.distributed import DistContext, check_same_plan
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        check_same_plan(DistContext(rank, 2, rank, "gloo"), f"fp{rank}",
                        {"model": "resnet50" if rank else "resnet18", "optimizer": "lars"})
        results.put((rank, "accepted"))
    except ConfigError as e:
        results.put((rank, str(e)))
    finally:
        dist.destroy_process_group()



def _two_ranks(worker, tmp_path) -> dict:
    """``worker(rank, store, results)`` on two spawned ranks; what each put in ``results``, by rank."""
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, str(tmp_path / "store"), q)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict(q.get(timeout=120) for _ in range(2))
    for p in procs:
        p.join(timeout=60)
    return got


def test_mismatched_plans_are_refused(tmp_path):
    got = _two_ranks(_mismatch_worker, tmp_path)
    for r in range(2):
        assert "rank 1 compiled another plan" in got[r] and "model 'resnet18' vs 'resnet50'" in got[r]


def _stop_worker(rank, store, results):
    """Rank 1 alone gets a signal; what each rank's stop policy answers, between log intervals
    and at one, before and after it."""
    from types import SimpleNamespace

    import torch.distributed as dist
    from tr_hydra.runtime.distributed import DistContext
    from tr_hydra.train.stop import StopPolicy
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        rt = SimpleNamespace(dist=DistContext(rank, 2, rank, "gloo"), device=torch.device("cpu"))
        policy = StopPolicy(SimpleNamespace(), rt)
        seen = [policy.preempted(at_log=True)]
        if rank == 1:
            policy.guard.stop.signal_name = "SIGTERM"
        seen += [policy.preempted(at_log=False), policy.preempted(at_log=True)]
        results.put((rank, seen))
    finally:
        dist.destroy_process_group()


def test_every_rank_stops_at_the_log_interval_after_one_rank_is_signalled(tmp_path):
    got = _two_ranks(_stop_worker, tmp_path)
    assert got == {0: [False, False, True], 1: [False, False, True]}
