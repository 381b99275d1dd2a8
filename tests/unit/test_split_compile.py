"""A training variant's backward compiled in a twin process (``startup.split_compile``) and found
by the process compiling the variant whole, on the CPU (Inductor's C++ code)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

from tr_hydra.startup import children as pcm
from tr_hydra.startup import split_compile

from tests.helpers import small_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# one process: a convolution, BatchNorm and ReLU's training step compiled whole (saved_compile), as
# a parallel compile does. "twin" compiles it under backward_only; "whole" under from_twin, and
# "plain" as usual: each then saves it, loads the file back and prints the gradients of a step
SCRIPT = textwrap.dedent("""
    import json, sys
    import torch, torch.nn as nn
    from torch._dynamo.utils import counters
    from tr_hydra.runtime import saved_compile
    from tr_hydra.startup import split_compile

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.c, self.b, self.fc = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.Linear(8, 10)

        def forward(self, x):
            return self.fc(torch.relu(self.b(self.c(x))).mean((2, 3)))

    mode, path = sys.argv[1], sys.argv[2]
    torch.manual_seed(0)
    net = Net().to(memory_format=torch.channels_last)
    x = torch.randn(4, 3, 8, 8).to(memory_format=torch.channels_last)
    out = {"mode": mode}
    if mode == "twin":
        split_compile.hold(path + ".lock")
        with split_compile.backward_only():
            try:
                saved_compile.compile_forward(net, x)(x)
                out["ran"] = True
            except Exception as e:  # the whole compile fails after the backward, or its forward raises
                out["ran"] = False
    else:
        waited = []
        if mode == "whole":
            with split_compile.from_twin(path + ".lock", waited):
                f = saved_compile.compile_forward(net, x)
        else:
            f = saved_compile.compile_forward(net, x)
        out["fx"] = {k: int(v) for k, v in counters["inductor"].items() if k.startswith("fxgraph_cache")}
        saved_compile.save(f, path)
        saved_compile.load(path, net)(x).square().mean().backward()
        out["grads"] = [p.grad.double().flatten().tolist() for p in net.parameters()]
        out["waited"] = waited
    out.setdefault("fx", {k: int(v) for k, v in counters["inductor"].items() if k.startswith("fxgraph_cache")})
    print(json.dumps(out))
""")


def _start(mode: str, cache: str, path: str, tmp_path) -> subprocess.Popen:
    script = tmp_path / "step.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache, PYTHONPATH=ROOT)
    return subprocess.Popen([sys.executable, str(script), mode, path], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)


def _held(lock: str) -> bool:
    return os.path.exists(lock) and os.path.getsize(lock) > 0  # the twin writes once it holds it


def _result(p: subprocess.Popen) -> dict:
    out, err = p.communicate(timeout=600)
    assert p.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def test_this_pytorch_has_what_a_twin_uses():
    assert split_compile.supported() == ""


def test_a_whole_compile_takes_the_backward_its_twin_compiled_and_saves_the_same_code(tmp_path):
    shared, fresh = str(tmp_path / "shared"), str(tmp_path / "fresh")
    mine, plain = str(tmp_path / "whole.bin"), str(tmp_path / "plain.bin")
    # side by side, as in a run: the twin first; the whole compile once the twin holds its lock
    twin_p = _start("twin", shared, mine, tmp_path)
    deadline = time.monotonic() + 300
    while twin_p.poll() is None and time.monotonic() < deadline and not _held(mine + ".lock"):
        time.sleep(0.05)
    whole_p, usual_p = _start("whole", shared, mine, tmp_path), _start("plain", fresh, plain, tmp_path)
    twin, whole, usual = _result(twin_p), _result(whole_p), _result(usual_p)
    # its forward never ran; its backward went into the FX graph cache, which a whole compile
    # alone would neither read nor write
    assert twin["ran"] is False and twin["fx"] == {"fxgraph_cache_miss": 1}, twin
    assert whole["fx"] == {"fxgraph_cache_hit": 1} and len(whole["waited"]) == 1, whole  # the twin's backward
    assert usual["fx"] == {}  # the usual whole compile: no FX cache
    # each file saved, loaded back and stepped: the same numbers, to the bit
    assert whole["grads"] == usual["grads"]


def test_waiting_for_a_twin(tmp_path):
    lock = str(tmp_path / "x.backward.lock")
    assert split_compile.wait_for(lock) is None  # no file: no twin
    open(lock, "w").close()
    assert split_compile.wait_for(lock) is None  # empty: the twin has not started
    code = f"import sys, time; sys.path.insert(0, {ROOT!r}); from tr_hydra.startup import split_compile; " \
           f"split_compile.hold({lock!r}); print('held', flush=True); time.sleep(float(sys.argv[1]))"
    holder = subprocess.Popen([sys.executable, "-c", code, "1.5"], stdout=subprocess.PIPE, text=True)
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
    holder = subprocess.Popen([sys.executable, "-c", code, "60"], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    holder.kill()
    holder.wait()
    assert split_compile.wait_for(lock, timeout=5) < 1.0


def test_twins_where_cores_and_device_memory_are_spare():
    GiB = 2**30
    short = [("train_base", True)]
    mlperf = [("train_base", True), ("train_last", True), ("val_last", False)]
    mix = [("train_base", True), ("train_last", True), ("train_lowres", True), ("train_lowres_last", True),
           ("val_last", False)]
    args = (100 * GiB, GiB // 4, 10 * GiB, 1.1)
    assert pcm.twins_wanted(short, 1, 16, *args) == ("train_base",)   # 5 compiles wanted, 2 running
    assert pcm.twins_wanted(mlperf, 3, 16, *args) == ("train_base",)  # 4 running: one more
    assert pcm.twins_wanted(mix, 5, 16, *args) == ()                  # 6 running already
    assert pcm.twins_wanted(mlperf, 3, 32, *args) == ("train_base", "train_last")  # never a validation one
    assert pcm.twins_wanted(mlperf, 2, 32, *args) == ("train_base", "train_last")
    assert pcm.twins_wanted(mlperf, 1, 32, *args) == ("train_base",)  # only children that start at once
    assert pcm.twins_wanted(short, 1, 6, *args) == ()
    assert pcm.twins_wanted(short, 0, 16, *args) == ()
    # device memory: the training process's activations and the children first, then an arena
    # and a CUDA context per twin
    child = int((GiB // 4 + 10 * GiB) * 1.1) + pcm.CONTEXT_BYTES
    twin = int(GiB // 4 * 1.1) + pcm.CONTEXT_BYTES
    base = int(10 * GiB * 1.1) + 3 * child
    assert pcm.twins_wanted(mlperf, 3, 32, base + twin, GiB // 4, 10 * GiB, 1.1) == ("train_base",)
    assert pcm.twins_wanted(mlperf, 3, 32, base + twin - 1, GiB // 4, 10 * GiB, 1.1) == ()


def test_a_variants_child_loads_the_backward_its_twin_compiled(tmp_path, monkeypatch):
    """The Precompiler's children on the CPU (Inductor): a twin for train_last beside the child
    compiling train_last whole; the child waits for the twin, then finds the model's backward in
    the FX graph cache, and its saved compile loads."""
    from tr_hydra.runtime import saved_compile
    from tr_hydra.runtime.build import Runtime
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "cache"))
    pc = small_config(compile="inductor", train_size=80, val_size=40)
    logs = []
    pre = pcm.Precompiler(pc, [("train_last", True)], workers=1, log=logs.append, twins=("train_last",))
    try:
        pre.wait("train_last")
        s = pre.summary()
        rt = Runtime(pc, log=lambda *_: None, source=False)
        saved_compile.load(pre.saved_forward("train_last"), rt.model, "train_last")
    finally:
        pre.close()
    assert sorted(s) == ["train_last", "train_last backward"], s
    twin, whole = s["train_last backward"], s["train_last"]
    assert twin["ok"] and twin["forward_skipped"] is True and twin["fxgraph_cache_miss"] >= 1, (twin, logs)
    assert whole["ok"] and whole["twin_wait_s"] >= 0 and whole["fxgraph_cache_hit"] >= 1, (whole, logs)
    assert not whole.get("saved_errors"), whole
    assert any("train_last: backward compiled in a twin process" in ln for ln in logs), logs


def test_a_twin_that_cannot_start_leaves_the_backward_to_its_variant(monkeypatch):
    import errno
    logs = []

    def no_process(*a, **k):
        raise OSError(errno.EAGAIN, "Resource temporarily unavailable")
    monkeypatch.setattr(pcm, "_spawn", no_process)
    pre = pcm.Precompiler(small_config(), [("train_last", True)], workers=1, log=logs.append, twins=("train_last",))
    try:
        assert pre.twins[0].ok is False and pre.children[0].ok is False
    finally:
        pre.close()
    assert any("train_last: could not start a backward twin" in ln and "the variant's compile does its backward" in ln
               for ln in logs), logs
    assert any("train_last: could not start a parallel compile" in ln for ln in logs), logs
