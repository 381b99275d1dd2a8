"""The installed console scripts, run from a temporary working directory."""
from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys

import pytest
import torch
import torch.nn as nn
import torchvision

ENV = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}


def _cli(name: str) -> list[str]:
    exe = shutil.which(name)
    if exe:
        return [exe]
    module = {"tr-plan": "tr_hydra.cli.plan", "tr-train": "tr_hydra.cli.train", "tr-bench": "tr_hydra.cli.bench"}[name]
    return [sys.executable, "-m", module]


def run(name, *args, cwd, env=None):
    return subprocess.run(_cli(name) + list(args), cwd=cwd, capture_output=True, text=True,
                          env=dict(ENV, **(env or {})), timeout=600)


def test_tr_plan_table_from_any_directory(tmp_path):
    out = run("tr-plan", "model=resnet50", "optimizer=lars", "amp=true", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    for needle in ("W_DEEP_CONV", "A_DEEP_CONV", "G_DEEP_CONV_FP16", "M_DEEP_CONV", "N_DEEP_CONV",
                   "arena total", "train_base", "RANGE_UPDATE_WEIGHT_LARS", "per series"):
        assert needle in text, needle
    assert "V_DEEP_CONV" not in text  # LARS keeps no second moment


def test_tr_plan_json(tmp_path):
    out = run("tr-plan", "plan.format=json", "optimizer=adamw", "ema=true", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout)
    assert {"total_bytes", "regions", "dtensors"} <= set(plan)
    assert len(plan["regions"]) == 68
    assert sum(r["total_bytes"] for r in plan["regions"]) == plan["total_bytes"]
    names = {d["name"] for d in plan["dtensors"]}
    assert "layer1.conv1.weight" in names and "v.layer1.conv1.weight" in names
    for d in plan["dtensors"]:
        assert d["offset"] % 256 == 0
        assert set(d) == {"id", "name", "region", "shape", "dtype", "offset", "slot_bytes"}


def test_tr_plan_says_whether_a_cuda_run_would_tune_and_why(tmp_path):
    """runtime.tuning=auto, planned for CUDA on any machine: the MLPerf recipe's 37 ImageNet epochs
    tune their full training batch (not the last batches nor validation), two short epochs
    nothing; the line gives the estimate, the JSON its figures; on the CPU nothing is tuned."""
    ml = ("recipe=resnet50_imagenet_mlperf", "data=synthetic", "variants.train_size=1281167",
          "variants.val_size=50000", "runtime.device=cuda")
    long = run("tr-plan", *ml, cwd=tmp_path)
    assert long.returncode == 0, long.stderr
    line = next(ln for ln in long.stdout.splitlines() if ln.startswith("runtime.tuning="))
    assert line.startswith("runtime.tuning=auto: coordinate descent on train_base (train_base: 185,148 steps of about "), line
    assert "train_last: 37 steps of about" in line and "val_base: 7,215 steps of about" in line, line
    short = run("tr-plan", *ml, "trainer.epochs=2", "variants.train_size=16384", "variants.val_size=512",
                "plan.format=json", cwd=tmp_path)
    t = json.loads(short.stdout)["tuning"]
    assert not t["tune"] and t["asked"] == "auto" and t["variants"] == [], t
    base = t["estimates"]["train_base"]
    assert base["steps"] == 2 * 64 and 0 < base["saving"] < base["cost"] and not base["tune"], t
    from tr_hydra.cli._common import compose
    from tr_hydra.cli.plan import plan_table
    from tr_hydra.compiler.compile import compile_plan
    from tr_hydra.resolve import resolve
    cpu = plan_table(compile_plan(resolve(compose(["runtime.device=cpu", "runtime.tuning=full"]))))
    assert "runtime.tuning=full: no tuning (no Triton kernels to tune on the CPU)" in cpu


def test_tr_train_writes_loadable_weights(tmp_path):
    out = run("tr-train", "model=resnet18_cifar", "data.train_size=48", "data.val_size=16",
              "variants.batch_size=16", "variants.val_batch_size=16", "variants.base_res=16",
              "variants.val_res=16", "trainer.epochs=1", f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "epoch   1" in out.stdout and "val loss" in out.stdout
    sd = torch.load(tmp_path / "run" / "model_final.pt", weights_only=True)
    # the modified resnet18, built here independently of tr_hydra
    ref = torchvision.models.resnet18(num_classes=10)
    ref.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
    ref.maxpool = nn.Identity()
    ref.load_state_dict(sd)  # strict
    assert int(sd["bn1.num_batches_tracked"]) == 3
    assert (tmp_path / "run" / ".hydra" / "config.yaml").is_file()


def test_init_from_starts_from_given_weights(tmp_path):
    from tests.helpers import small_config
    from tr_hydra.compiler.compile import instantiate_model
    from tr_hydra.config.specs import ModelSpec
    from tr_hydra.train.trainer import Trainer
    torch.manual_seed(123)
    pc = small_config()
    src = instantiate_model(pc).state_dict()
    path = tmp_path / "init.pt"
    torch.save(src, path)
    pc2 = small_config()
    pc2 = pc2.__class__(**{**pc2.__dict__, "model": ModelSpec(init_from=str(path))})
    tr = Trainer(pc2, tmp_path / "run", log=lambda *_: None)
    got = tr.final_state_dict()
    for k, v in src.items():
        if not k.endswith("num_batches_tracked"):
            assert torch.equal(got[k], v), k


def test_bad_inputs_are_one_line(tmp_path):
    cases = [("tr-train", "optimizer=adagrad"), ("tr-train", "model.init_from=/nonexistent.pt"),
             ("tr-train", "data=imagefolder", "data.root=/nonexistent"), ("tr-plan", "amp=maybe")]
    for args in cases:
        out = run(*args, cwd=tmp_path)
        lines = [l for l in out.stderr.splitlines() if l.strip()]
        assert out.returncode == 2 and len(lines) == 1 and "error:" in lines[0], (args, out.stderr)


def test_default_run_learns_digits(tmp_path):
    """`tr-train` with no arguments: the built-in digits set, ~25 s on 2 CPU cores."""
    out = subprocess.run(_cli("tr-train") + [f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path,
                         capture_output=True, text=True, env=ENV | {"TR_HYDRA_CACHE": str(tmp_path / "cache")},
                         timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    top1 = float(out.stdout.split("final val top1")[1].split(",")[0])
    assert top1 >= 85.0, out.stdout


def test_arrays_from_the_command_line(tmp_path):
    import numpy as np
    rng = np.random.default_rng(0)
    y = rng.integers(0, 4, 40)
    x = (rng.integers(0, 60, (40, 16, 16, 3)) + 40 * y[:, None, None, None]).astype(np.uint8)
    np.savez(tmp_path / "set.npz", x_train=x, y_train=y, x_val=x[:12], y_val=y[:12])
    out = run("tr-train", "data=arrays", f"data.path={tmp_path / 'set.npz'}", "data.num_classes=4",
              "variants.batch_size=16", "variants.val_batch_size=8", "variants.base_res=16",
              "variants.val_res=16", "trainer.epochs=2", f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "epoch   2" in out.stdout


def test_corrupt_image_stops_with_one_line(tmp_path):
    from PIL import Image
    import numpy as np
    for split in ("train", "val"):
        for c in ("a", "b"):
            d = tmp_path / "data" / split / c
            d.mkdir(parents=True)
            for i in range(4):
                Image.fromarray(np.full((16, 16, 3), 40 * i, np.uint8)).save(d / f"{i}.jpg")
    (tmp_path / "data" / "train" / "b" / "2.jpg").write_bytes(b"\xff\xd8\xff garbage")
    out = run("tr-train", "data=imagefolder", f"data.root={tmp_path / 'data'}", "data.num_classes=2",
              "variants.batch_size=4", "variants.val_batch_size=4", "variants.base_res=16",
              "variants.val_res=16", "trainer.epochs=1", f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    lines = [l for l in out.stderr.splitlines() if l.strip()]
    assert out.returncode == 2 and len(lines) == 1, out.stderr
    assert "b/2.jpg" in lines[0] and "skip_corrupt" in lines[0]


def test_tr_bench_on_cpu_writes_table_and_json(tmp_path):
    out = run("tr-bench", "data=synthetic", "data.train_size=200", "variants.lowres_epochs=1",
              "bench.steps=2", "bench.repeats=2", "bench.warmup=1", "bench.epoch_mix=true",
              "bench.modes=[eager,tr]", "bench.profile=true", f"bench.out={tmp_path / 'b.json'}", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "x best PyTorch" in out.stdout and "epoch mix" in out.stdout
    for line in ("tr-bench: building eager (1/2)", "tr-bench: building tr (2/2)", "tr-bench: tr ready, first step after",
                 "tr-bench: repeat 2/2 timed"):  # progress, on stderr
        assert line in out.stderr, out.stderr[-2000:]
    res = json.loads((tmp_path / "b.json").read_text())
    assert [m["mode"] for m in res["modes"]] == ["eager", "tr"]
    assert res["runtime"]["compile"] == "auto" and res["runtime"]["device"] == "auto"  # the run's settings
    assert set(res["runtime"]).isdisjoint({"compile_gc", "cudnn_benchmark_limit", "stem_channels", "maxpool"})
    host = res["host"]  # what it ran on: the host's Python speed moves compile times most
    assert host["cores"] == os.cpu_count() and host["python"] == platform.python_version()
    assert host["python_loop_ms"] > 0 and host["torch"] == torch.__version__ and "gpu" not in host
    assert host["bytecode"] == "beside the sources" or host["bytecode"].startswith(("in ", "kept", "not"))
    assert f"host: {host['cpu']}, {host['cores']} cores; Python {host['python']}" in out.stdout
    for m in res["modes"]:
        assert len(m["img_per_sec_all"]) == 2 and m["img_per_sec_median"] > 0
    assert res["modes"][1]["img_per_sec_single_buffer_median"] > 0  # tr_hydra timed both ways
    assert "tr, timed as one step at a time on buffer A" in out.stdout
    mem = res["modes"][1]["memory"]  # where tr_hydra's memory goes; eager has no arena
    assert mem["arena_bytes"] > 0 and "arena_bytes" not in res["modes"][0]["memory"]
    assert mem["predicted_need_bytes"] == (mem["arena_bytes"] + mem["activation_estimate_bytes"]
                                           + mem["gradient_transient_bytes"] + mem["library_workspace_bytes"])
    assert "tr memory MiB: arena" in out.stdout
    startup = res["modes"][1]["startup"]  # tr_hydra's start-up, one key (StartupReport.to_json())
    assert startup["graphs"] == 0 and startup["cudnn"] is None and startup["children"] is None  # the CPU's
    assert "startup" not in res["modes"][0]
    mix = res["epoch_mix"]
    assert list(mix["variants"]) == ["train_base", "train_last", "train_lowres", "train_lowres_last", "val_base"]
    assert list(mix["modes"]) == ["tr", "eager"]
    for r in mix["modes"].values():
        assert r["img_per_sec"] > 0 and r["first_step_of_all_variants_seconds"] > 0
        assert set(r["step_ms_by_variant"]) == set(mix["variants"])
    assert set(mix["modes"]["eager"]["first_step_seconds_by_variant"]) == set(mix["variants"])
    parts = mix["modes"]["tr"]["ready_seconds"]  # the time to the first steps, split
    assert set(parts) == {"runtime", "start_children", "record_convs", "prime_cudnn", "warmup", "graphs",
                          "capture_other", "first_steps"} and parts["runtime"] > 0 and parts["first_steps"] > 0
    assert abs(sum(parts.values()) - mix["modes"]["tr"]["first_step_of_all_variants_seconds"]) < 1e-6
    assert "tr: first step of every variant after" in out.stdout and "record convs" in out.stdout
    tlog = mix["modes"]["tr"]["log"]  # what the runtime and its start-up reported, kept
    assert isinstance(tlog, list) and all(isinstance(ln, str) for ln in tlog)
    st = mix["modes"]["tr"]["startup"]  # the start-up's report, under one key
    assert st["launcher_error"] == "" and st["launcher_ready_s"] is None and st["warmup_seconds"] == {}
    assert set(mix["modes"]["tr"]).isdisjoint({"gc", "compile_gc", "twin_wait_seconds", "launcher_head_start_seconds",
                                               "cudnn_prime", "precompile", "saved_load_seconds"})
    # the profiler pass: per-mode time by group, the convolutions among the top operators
    assert [p["mode"] for p in res["profile"]] == ["eager", "tr"] and "kernels per step" in out.stdout
    for p in res["profile"]:
        assert any("conv" in k["name"] for k in p["top_kernels"][:5]) and p["wall_ms_per_step"] > 0
        # each group's own largest, adding up to no more than the group
        assert set(p["top_by_group"]) == set(p["groups_ms_per_step"])
        for g, top in p["top_by_group"].items():
            assert top and sum(k["ms_per_step"] for k in top) <= p["groups_ms_per_step"][g] * (1 + 1e-9)
    bad = run("tr-bench", "bench.modes=[eager,turbo]", cwd=tmp_path)
    lines = [l for l in bad.stderr.splitlines() if l.strip()]
    assert bad.returncode == 2 and len(lines) == 1 and "unknown ['turbo']" in lines[0], bad.stderr


def test_tr_bench_end_to_end_on_a_jpeg_folder_on_cpu(tmp_path):
    import numpy as np
    from PIL import Image
    rng = np.random.default_rng(0)
    for split, n in (("train", 40), ("val", 12)):
        for i in range(n):
            d = tmp_path / "jpegs" / split / f"c{i % 12}"  # labels of one and two digits in the shards
            d.mkdir(parents=True, exist_ok=True)
            Image.fromarray(rng.integers(0, 255, (20, 24, 3), dtype=np.uint8)).save(d / f"{i}.jpg")
    out = run("tr-bench", "recipe=cpu_smoke", f"bench.data={tmp_path / 'jpegs'}", "bench.warmup=2",
              "bench.modes=[tr,dl-compile,tr-shards,tr-synthetic,dali-compile,dali-shards-compile]", "variants.batch_size=8",
              "variants.base_res=16",
              "variants.val_res=16", "bench.profile=true", "bench.steps=3", f"bench.out={tmp_path / 'e.json'}",
              cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    res = json.loads((tmp_path / "e.json").read_text())
    assert [m["mode"] for m in res["modes"]] == ["tr", "dl-compile", "tr-shards", "tr-synthetic", "dali-compile",
                                                 "dali-shards-compile"] and res["train_images"] == 40
    # the shards: prepared from the folder on first use (tr-prepare's defaults), every image in them
    index = json.loads((tmp_path / "jpegs" / "shards" / "index.json").read_text())
    assert res["shards"] == str(tmp_path / "jpegs" / "shards") and index["splits"]["train"]["count"] == 40
    by = {m["mode"]: m for m in res["modes"]}
    assert by["tr-shards"]["images"] == by["tr"]["images"] == by["tr-synthetic"]["images"] == 40 - 2 * 8 + 40
    assert "decode_img_per_sec" not in by["tr-synthetic"]  # no input pipeline to time alone
    for m in ("tr", "tr-shards", "dali-compile", "dali-shards-compile"):  # the input alone, no step
        assert by[m]["decode_img_per_sec"] > 0 and by[m]["img_per_sec"] > 0
    assert "decode_img_per_sec" not in by["dl-compile"] and "decode only" in out.stdout
    tr = res["modes"][0]
    assert tr["images"] == 40 - 2 * 8 + 40 and tr["img_per_sec"] > 0  # rest of epoch 0, all of epoch 1
    assert tr["startup"]["graphs"] == 0 and "startup" not in res["modes"][1]  # tr_hydra's start-up, on the CPU
    assert 0 <= tr["epoch_switch_wait_seconds"] <= tr["data_wait_seconds"] < tr["seconds"]
    assert 0 <= tr["copy_wait_seconds"] <= tr["data_wait_seconds"]  # part of it: the previous copy out
    assert tr["epochs_read_ahead"] == 1  # epoch 1's reader was built while epoch 0 ran
    for r in res["modes"][:2]:  # each part of the window timed on its own: rest of epoch 0, epoch 1
        assert len(r["epoch_img_per_sec"]) == 2 and min(r["epoch_img_per_sec"]) > 0
        # the parts add up to the whole window (host clock on the CPU, no gaps between marks)
        parts = [24, 40] if r["mode"] == "tr" else None
        if parts:
            total = sum(n / v for n, v in zip(parts, r["epoch_img_per_sec"]))
            assert total == pytest.approx(r["images"] / r["img_per_sec"], rel=0.05)
    assert "epoch 0 rest / epoch 1" in out.stdout
    assert "waited" in out.stdout
    # bench.profile: after the timed window (its figures above unchanged), 3 steps of a third
    # epoch under the profiler; on the CPU, operators by their own time
    prof = tr["profile"]
    assert prof["mode"] == "tr" and prof["wall_ms_per_step"] > 0 and prof["device_busy_ms_per_step"] > 0
    assert prof["groups_ms_per_step"] and prof["top_kernels"] and prof["data_wait_ms_per_step"] >= 0
    assert "device busy" in out.stdout and "profile" not in res["modes"][1]
    assert "tr, profiled steps: the host waited" in out.stdout and "tr-shards, profiled steps" in out.stdout
    bad = run("tr-bench", f"bench.data={tmp_path / 'jpegs'}", "bench.modes=[reduce-overhead]", cwd=tmp_path)
    assert bad.returncode == 2 and "unknown ['reduce-overhead'] with bench.data" in bad.stderr


def test_done_line_says_when_no_validation_ran(tmp_path):
    """A run stopped by max_steps before its first epoch ended has no validation figure; the last
    line says so instead of printing nan."""
    out = run("tr-train", "recipe=cpu_smoke", "trainer.max_steps=2", f"hydra.run.dir={tmp_path / 'r'}", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-1500:]
    done = [l for l in out.stdout.splitlines() if l.startswith("done:")][0]
    assert "2 steps" in done and "final val top1 n/a (the last epoch ran no validation)" in done and "nan" not in done
    summary = [l for l in out.stdout.splitlines() if l.startswith("summary:")][0]
    assert summary.startswith("summary: best val top1 n/a  total") and "nan" not in summary


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_tr_bench_cold_epoch_mix_stopped_by_sigterm_keeps_what_finished(tmp_path, sig):
    """A time limit's SIGTERM (or Ctrl-C's SIGINT) during the second cold mode: the first
    mode's results are in the JSON (marked incomplete), the running mode's process is stopped
    and its caches deleted, and no traceback."""
    import signal
    import time
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    p = subprocess.Popen(_cli("tr-bench") + [
        "data=synthetic", "data.train_size=200", "variants.lowres_epochs=1", "bench.modes=[eager]",
        "bench.steps=2", "bench.repeats=1", "bench.warmup=1", "bench.epoch_mix=true",
        "bench.epoch_mix_modes=[eager,tr]", "bench.cold=true", f"bench.out={tmp_path / 'b.json'}"],
        cwd=tmp_path, env=dict(ENV, TMPDIR=str(tmpdir)), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        # a shell's background job starts with SIGINT ignored, and Python then never raises
        # KeyboardInterrupt: give the run the default disposition, as a terminal's would have
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    t0 = time.time()
    while not list(tmpdir.glob("tr_bench_cold_tr_*")) and p.poll() is None and time.time() - t0 < 300:
        time.sleep(0.05)  # the second mode's process has started
    assert p.poll() is None, "the run ended before the second mode started"
    time.sleep(0.5)
    p.send_signal(getattr(signal, sig))
    stdout, stderr = p.communicate(timeout=120)
    assert p.returncode == (143 if sig == "SIGTERM" else 130), stderr[-2000:]
    assert f"tr-bench: stopped by {sig}" in stderr and "Traceback" not in stderr, stderr[-2000:]
    res = json.loads((tmp_path / "b.json").read_text())
    assert [m["mode"] for m in res["modes"]] == ["eager"]
    mix = res["epoch_mix"]
    assert mix["complete"] is False and list(mix["modes"]) == ["eager"] and mix["modes"]["eager"]["img_per_sec"] > 0
    assert not list(tmpdir.glob("tr_bench_cold_*")), "a cold mode's caches were left behind"
    assert not (tmp_path / "b.json.tmp").exists()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG and /proc are Linux's")
def test_a_cold_modes_process_ends_with_a_bench_killed_outright(tmp_path):
    """tr-bench killed with SIGKILL during the second cold mode: that mode's process ends with it
    and never writes its results (left alone, it runs to its end and writes them)."""
    import signal
    import time
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    p = subprocess.Popen(_cli("tr-bench") + [
        "data=synthetic", "data.train_size=200", "variants.lowres_epochs=1", "bench.modes=[]",
        "bench.epoch_mix=true", "bench.epoch_mix_modes=[eager,tr]", "bench.cold=true",
        f"bench.out={tmp_path / 'b.json'}"],
        cwd=tmp_path, env=dict(ENV, TMPDIR=str(tmpdir)), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    t0 = time.time()
    while not list(tmpdir.glob("tr_bench_cold_tr_*")) and p.poll() is None and time.time() - t0 < 300:
        time.sleep(0.05)  # the second mode's process has started
    assert p.poll() is None, "the run ended before the second mode started"
    mode = None
    while mode is None and time.time() - t0 < 300:  # the bench's child process: the running mode
        for d in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{d}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == p.pid:
                        mode = int(d)
            except (OSError, ValueError, IndexError):
                continue
        time.sleep(0.05)
    assert mode is not None
    p.send_signal(signal.SIGKILL)
    p.wait(timeout=60)

    def alive(pid):
        try:
            with open(f"/proc/{pid}/status") as f:
                return not any(ln.startswith("State:") and "Z" in ln.split()[1] for ln in f)
        except FileNotFoundError:
            return False
    while alive(mode) and time.time() - t0 < 300:
        time.sleep(0.1)
    assert not alive(mode), "the cold mode's process outlived the bench"
    time.sleep(0.5)
    assert not (tmp_path / "b.cold_tr.json").exists()  # it did not run on to its end
    assert (tmp_path / "b.cold_eager.json").exists()    # the first mode's, from before


def test_tr_bench_cold_epoch_mix_runs_each_mode_in_a_process_of_its_own(tmp_path):
    """bench.cold=true: each epoch-mix mode runs in a fresh process with empty Inductor/Triton
    caches of its own, deleted afterwards; the results come back into one table and JSON."""
    out = run("tr-bench", "data=synthetic", "data.train_size=200", "variants.lowres_epochs=1",
              "bench.modes=[eager]", "bench.steps=2", "bench.repeats=1", "bench.warmup=1",
              "bench.epoch_mix=true", "bench.epoch_mix_modes=[tr,eager]", "bench.cold=true",
              f"bench.out={tmp_path / 'b.json'}", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    res = json.loads((tmp_path / "b.json").read_text())
    assert [m["mode"] for m in res["modes"]] == ["eager"]  # the step modes, in this process
    mix = res["epoch_mix"]
    assert mix["cold"] and list(mix["modes"]) == ["tr", "eager"]
    dirs = [mix["modes"][m]["caches"]["inductor"] for m in ("tr", "eager")]
    assert dirs[0] != dirs[1] and not any(os.path.exists(d) for d in dirs)
    for r in mix["modes"].values():
        assert r["img_per_sec"] > 0 and r["first_step_of_all_variants_seconds"] > 0
    if sys.platform.startswith("linux"):  # the mode's process, from its start to its runtime's
        before = mix["modes"]["tr"]["process_seconds_before_runtime"]
        assert 0 < before < 300, before
        assert f"{before + mix['modes']['tr']['first_step_of_all_variants_seconds']:.1f}s since the process started" \
            in out.stdout
    assert out.stdout.count("in a process of its own, with empty caches") == 2
    assert "cold (bench.cold)" in out.stdout
    assert "complete" not in mix  # the last write is the whole run's
    for m in ("tr", "eager"):  # each mode's own results are kept beside the output
        own = json.loads((tmp_path / f"b.cold_{m}.json").read_text())["epoch_mix"]["modes"][m]
        assert own["img_per_sec"] == mix["modes"][m]["img_per_sec"]
    bad = run("tr-bench", "bench.cold=true", cwd=tmp_path)
    lines = [l for l in bad.stderr.splitlines() if l.strip()]
    assert bad.returncode == 2 and len(lines) == 1 and "add bench.epoch_mix=true" in lines[0], bad.stderr
