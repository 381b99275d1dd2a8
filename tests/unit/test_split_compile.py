"""runtime.precompile_backward: a training graph's backward compiled in a twin process, found
in the FX graph cache by the process compiling the whole graph (CPU: Inductor's C++ code)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

from tr_hydra.runtime import precompile as pcm
from tr_hydra.runtime import split_compile
from tests.helpers import small_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# one process: a small conv/BatchNorm network's training step, compiled by Inductor; "twin"
# compiles under backward_only, "whole" compiles (and runs) it as usual and prints its gradients
SCRIPT = textwrap.dedent("""
    import json, sys
    import torch, torch.nn as nn
    from torch._dynamo.utils import counters
    from tr_hydra.runtime import split_compile
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                        nn.Conv2d(8, 16, 3, stride=2, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10)).to(memory_format=torch.channels_last)
    x = torch.randn(4, 3, 8, 8).to(memory_format=torch.channels_last)
    step = torch.compile(net, dynamic=len(sys.argv) > 2)  # "dynamic": the batch symbolic
    out = {"mode": sys.argv[1]}
    if sys.argv[1] == "twin":
        with split_compile.backward_only():
            try:
                step(x)
                out["skipped"] = False
            except split_compile.ForwardSkipped:
                out["skipped"] = True
        import torch._functorch.config as fc
        out["restored"] = not fc.force_non_lazy_backward_lowering and fc.enable_autograd_cache
    else:
        step(x).square().mean().backward()
        out["grads"] = [p.grad.double().flatten().tolist() for p in net.parameters()]
        out["loss"] = float(step(x).square().mean())
    out["fx"] = {k: int(v) for k, v in counters["inductor"].items() if k.startswith("fxgraph_cache")}
    print(json.dumps(out))
""")


def _run(mode: str, cache: str, tmp_path, *extra: str) -> dict:
    script = tmp_path / "step.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache, PYTHONPATH=ROOT)
    p = subprocess.run([sys.executable, str(script), mode, *extra], capture_output=True, text=True, env=env,
                       timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_this_pytorch_has_what_a_twin_uses():
    assert split_compile.supported() == ""


def test_a_twin_compiles_the_backward_that_a_whole_compile_then_loads_with_the_same_results(tmp_path):
    shared, fresh = str(tmp_path / "shared"), str(tmp_path / "fresh")
    twin = _run("twin", shared, tmp_path)
    assert twin["skipped"] and twin["restored"], twin  # its forward never ran; the config is back
    assert twin["fx"].get("fxgraph_cache_miss") == 2 and not twin["fx"].get("fxgraph_cache_hit"), twin
    loaded = _run("whole", shared, tmp_path)
    # the forward compiled here, the backward found in the cache, where only the twin put it
    assert loaded["fx"].get("fxgraph_cache_hit") == 1 and loaded["fx"].get("fxgraph_cache_miss") == 1, loaded
    whole = _run("whole", fresh, tmp_path)  # the same step compiled whole, in an empty cache
    assert whole["fx"].get("fxgraph_cache_miss") == 2, whole
    # the same compiled code: the same numbers, to the bit
    assert loaded["grads"] == whole["grads"] and loaded["loss"] == whole["loss"]
    # a twin that comes after the whole compile finds both halves, and still runs no step
    late = _run("twin", fresh, tmp_path)
    assert late["skipped"] and late["fx"].get("fxgraph_cache_hit") == 2 and not late["fx"].get("fxgraph_cache_miss"), late


def test_a_twin_of_a_graph_with_a_symbolic_batch(tmp_path):
    """A graph whose batch is symbolic: the saved tensors' strides are expressions of the batch
    size, handed over as Inductor prints them. (The trainer still uses no twins with
    runtime.dynamic_batch: on the H200 its children missed the twins' backward.)"""
    shared = str(tmp_path / "shared")
    twin = _run("twin", shared, tmp_path, "dynamic")
    assert twin["skipped"] and twin["fx"].get("fxgraph_cache_miss") == 2, twin
    loaded = _run("whole", shared, tmp_path, "dynamic")
    assert loaded["fx"].get("fxgraph_cache_hit") == 1 and loaded["fx"].get("fxgraph_cache_miss") == 1, loaded


def test_waiting_for_a_twin(tmp_path):
    lock = str(tmp_path / "x.backward.lock")
    assert split_compile.wait_for(lock) is None  # no file: no twin
    open(lock, "w").close()
    assert split_compile.wait_for(lock) is None  # empty: the twin has not started
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {ROOT!r})
        from tr_hydra.runtime import split_compile
        fd = split_compile.hold({lock!r})
        print("held", flush=True)
        time.sleep(1.5)
    """)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert split_compile.wait_for(lock, timeout=0.3) == pytest.approx(0.3, abs=0.25)  # gives up
        t = time.monotonic()
        waited = split_compile.wait_for(lock)
        assert 0.5 < waited < 5 and time.monotonic() - t < 5  # until the holder ended
    finally:
        holder.kill()
        holder.wait()
    assert split_compile.wait_for(lock) == pytest.approx(0.0, abs=0.1)  # ended: no wait
    # a holder killed outright releases it too (the kernel drops the lock)
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {ROOT!r})
        from tr_hydra.runtime import split_compile
        split_compile.hold({lock!r})
        print("held", flush=True)
        time.sleep(60)
    """)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    holder.kill()
    holder.wait()
    assert split_compile.wait_for(lock, timeout=5) < 1.0


def test_twins_limited_by_cores_count_and_device_memory():
    GiB = 2**30
    assert pcm.twins_limited(4, "auto", 16, 5, 100 * GiB, GiB // 4, GiB, 1.1) == 4
    assert pcm.twins_limited(4, "auto", 6, 2, 100 * GiB, GiB // 4, GiB, 1.1) == 2   # a third of the cores
    assert pcm.twins_limited(4, 1, 64, 1, 100 * GiB, GiB // 4, GiB, 1.1) == 1       # a count: that many
    assert pcm.twins_limited(0, "auto", 16, 5, 100 * GiB, GiB // 4, GiB, 1.1) == 0
    # memory: what the main process's activations and the five children leave, each twin an
    # arena and a context (768 MiB)
    child = int((GiB // 4 + GiB) * 1.1) + pcm.CONTEXT_BYTES
    twin = int(GiB // 4 * 1.1) + pcm.CONTEXT_BYTES
    free = int(GiB * 1.1) + 5 * child + 2 * twin + 1
    assert pcm.twins_limited(4, "auto", 16, 5, free, GiB // 4, GiB, 1.1) == 2
    assert pcm.twins_limited(4, "auto", 16, 5, int(GiB * 1.1) + 5 * child, GiB // 4, GiB, 1.1) == 0


def test_a_variants_child_loads_the_backward_its_twin_compiled(tmp_path, monkeypatch):
    """The Precompiler's children on the CPU: a twin for train_last and the child compiling the
    whole of train_last; the child waits for the twin, then finds the backward in the cache."""
    import dataclasses
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "cache"))
    pc = small_config(compile="inductor", train_size=80, val_size=40)
    pc = dataclasses.replace(pc, runtime=dataclasses.replace(pc.runtime, precompile=2))
    logs = []
    pre = pcm.Precompiler(pc, [("train_last", True)], workers=1, log=logs.append, twins=("train_last",))
    try:
        pre.wait("train_last")
        s = pre.summary()
    finally:
        pre.close()
    assert sorted(s) == ["train_last", "train_last backward"], s
    twin, whole = s["train_last backward"], s["train_last"]
    assert twin["ok"] and twin["forward_skipped"] is True, (twin, logs)
    assert whole["ok"] and "twin_wait_s" in whole, (whole, logs)
    assert whole["fxgraph_cache_hit"] >= 1, whole  # the model's backward, from the twin
    assert any("backward compiled in a twin process" in ln for ln in logs), logs
    assert pre.twin_lock("train_last").endswith("train_last.backward.lock") and pre.twin_lock("val_base") is None


def test_the_option_is_off_by_default_and_can_be_turned_on():
    from tr_hydra.cli._common import compose
    from tr_hydra.config.plan_config import plan_config_from
    assert plan_config_from(compose([])).runtime.precompile_backward is False
    assert plan_config_from(compose(["runtime.precompile_backward=true"])).runtime.precompile_backward is True


def test_the_trainer_gives_twins_to_static_graphs_only(tmp_path):
    import dataclasses
    from tr_hydra.runtime.runner import Trainer
    GiB = 2**30
    logs = []
    for dyn, want in ((False, ["train_base", "train_last"]), (True, [])):
        pc = small_config(train_size=200, batch=32, val_size=64, val_batch=32)
        pc = dataclasses.replace(pc, runtime=dataclasses.replace(pc.runtime, precompile=8, precompile_backward=True,
                                                                  dynamic_batch=dyn))
        tr = Trainer(pc, tmp_path / str(dyn), log=logs.append, telemetry=False, source=False)
        assert tr._twins(["train_base", "train_last"], 1, 100 * GiB) == want
    assert any("not with runtime.dynamic_batch" in ln for ln in logs), logs


def test_a_twin_that_cannot_start_leaves_the_backward_to_its_variant(monkeypatch):
    import errno
    logs = []

    def no_process(*a, **k):
        raise OSError(errno.EAGAIN, "Resource temporarily unavailable")
    monkeypatch.setattr(pcm, "_spawn", no_process)
    pre = pcm.Precompiler(small_config(), [("train_last", True)], workers=1, log=logs.append, twins=("train_base",))
    try:
        assert pre.twins[0].ok is False and pre.children[0].ok is False
    finally:
        pre.close()
    assert any("train_base: could not start a backward twin" in ln and "the variant's compile does its backward" in ln
               for ln in logs), logs
    assert any("train_last: could not start a parallel compile" in ln for ln in logs), logs
