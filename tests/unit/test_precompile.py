"""Parallel precompilation: how many children, and the child processes themselves (on CPU the
children run the eager step; on the GPU, tests/gpu checks that the main process then loads
Inductor's compiled code from the cache)."""
from __future__ import annotations

import pytest

from tr_hydra.config.plan_config import plan_config_from
from tr_hydra.runtime import precompile as pcm
from tr_hydra.cli._common import compose

from tests.helpers import small_config

GiB = 2**30


def test_requested_workers():
    # six variants: at most five children (the main process compiles the first)
    assert pcm.requested_workers("auto", 6, 1, 16) == 5
    assert pcm.requested_workers("auto", 6, 1, 7) == 2     # a third of the cores
    assert pcm.requested_workers("auto", 6, 1, 2) == 0
    assert pcm.requested_workers("auto", 6, 2, 64) == 0    # ddp: the ranks compile side by side
    assert pcm.requested_workers(3, 6, 2, 64) == 3         # unless asked for
    assert pcm.requested_workers(10, 6, 1, 2) == 5
    assert pcm.requested_workers(0, 6, 1, 16) == 0
    assert pcm.requested_workers("auto", 1, 1, 16) == 0


def test_memory_limit_counts_each_child_and_the_main_activations():
    # child: (1 + 2) GiB * 1.1 + 0.75 GiB context = 4.05 GiB; the main process keeps 2.2 GiB
    assert pcm.memory_limited(5, 20 * GiB, 1 * GiB, 2 * GiB, 1.1) == 4   # 17.8 / 4.05
    assert pcm.memory_limited(3, 20 * GiB, 1 * GiB, 2 * GiB, 1.1) == 3
    assert pcm.memory_limited(5, 6 * GiB, 1 * GiB, 2 * GiB, 1.1) == 0    # 3.8 GiB spare < 4.05
    assert pcm.memory_limited(5, 2 * GiB, 1 * GiB, 2 * GiB, 1.1) == 0


def test_default_is_auto_and_counts_are_accepted():
    assert plan_config_from(compose([])).runtime.precompile == "auto"
    assert plan_config_from(compose(["runtime.precompile=3"])).runtime.precompile == 3


def test_children_run_each_variant_and_a_failure_is_reported_not_raised():
    pc = small_config(train_size=80, val_size=40)  # train_base, train_last, val_base, val_last
    logs = []
    pre = pcm.Precompiler(pc, [("train_last", True), ("val_base", False), ("no_such_variant", True)],
                          workers=2, log=logs.append)
    try:
        for name in ("train_last", "val_base", "no_such_variant"):
            pre.wait(name)
        s = pre.summary()
    finally:
        pre.close()
    assert s["train_last"]["ok"] and s["val_base"]["ok"], logs
    assert "fxgraph_cache_hit" in s["train_last"]  # the child's counters came back
    assert s["no_such_variant"]["ok"] is False
    assert any("no_such_variant: parallel compile failed" in ln and "compiling it here" in ln for ln in logs)


def test_children_of_a_ddp_rank_join_no_process_group(monkeypatch):
    """Under torchrun the children inherit RANK, WORLD_SIZE and MASTER_ADDR; they must build the
    rank's plan (its world size) without joining the group, or they would hang it."""
    import dataclasses
    from tr_hydra.config.plan_config import DistSpec
    for k, v in (("RANK", "1"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "1"), ("MASTER_ADDR", "127.0.0.1"),
                 ("MASTER_PORT", "1")):
        monkeypatch.setenv(k, v)
    pc = dataclasses.replace(small_config(train_size=80, val_size=40), world_size=2,
                             dist=DistSpec(mode="ddp", timeout_s=20))
    pre = pcm.Precompiler(pc, [("val_base", False)], workers=1, log=lambda *_: None)
    try:
        pre.wait("val_base")
        s = pre.summary()
    finally:
        pre.close()
    assert s["val_base"]["ok"], s


def test_a_variant_whose_child_has_not_started_is_compiled_in_the_main_process():
    pc = small_config(train_size=80, val_size=40)
    pre = pcm.Precompiler(pc, [("train_last", True), ("val_base", False)], workers=1, log=lambda *_: None)
    try:
        pre.wait("val_base")  # its child is still queued behind train_last's: not waited for
        assert pre.children[1].proc is None
        pre.wait("train_last")
        s = pre.summary()
    finally:
        pre.close()
    assert s["train_last"]["ok"] and s["val_base"]["ok"] is None
    assert pre.children[1].proc is None  # and never started afterwards


def test_precompile_first_sends_every_variant_to_a_child(tmp_path, monkeypatch):
    """runtime.precompile_first: the first variant is compiled (and autotuned) in a child too,
    and the main process waits for it like for the others."""
    import dataclasses
    import torch
    from tr_hydra.runtime.runner import Trainer
    assert pcm.requested_workers("auto", 6, 1, 64, first=True) == 6
    assert pcm.requested_workers("auto", 1, 1, 64, first=True) == 1    # one variant: still a child
    assert pcm.requested_workers("auto", 1, 1, 64) == 0
    assert pcm.requested_workers("auto", 6, 2, 64, first=True) == 0    # ddp: off unless asked for
    assert pcm.requested_workers(0, 6, 1, 64, first=True) == 0
    seen = {}

    class Fake:
        def __init__(self, pc, order, n, log=None, device_index=0, also=None, launcher=None, twins=(), saved=False,
                     share_training=True):
            seen.update(order=order, n=n, launcher=launcher, twins=twins, saved=saved)

    monkeypatch.setattr(pcm, "Precompiler", Fake)
    monkeypatch.setattr(pcm, "caches_enabled", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (100 * GiB, 141 * GiB))
    for first, want in ((False, [("train_last", True), ("val_base", False)]),
                        (True, [("train_base", True), ("train_last", True), ("val_base", False)])):
        pc = small_config(train_size=200, batch=32, val_size=64, val_batch=32)
        pc = dataclasses.replace(pc, runtime=dataclasses.replace(pc.runtime, precompile=8, precompile_first=first,
                                                                precompile_backward=True))
        tr = Trainer(pc, tmp_path / str(first), log=lambda *_: None, telemetry=False, source=False)
        tr.inductor = True  # as on CUDA with runtime.compile=auto
        assert isinstance(tr._precompiler(["train_base", "train_last"], ["val_base"]), Fake)
        assert seen["order"] == want and seen["n"] == len(want)
        # every training variant's backward gets a twin, the main process's own first one too
        assert seen["twins"] == ("train_base", "train_last")
        assert seen["saved"] is False  # runtime.precompile_saved is not used with twins


def test_the_training_process_compiles_a_validation_variant_while_each_other_has_a_child(tmp_path, monkeypatch):
    """runtime.precompile_own=auto: where every other variant gets a child of its own, the
    training process compiles a validation variant (a forward only) and a child takes the
    first training variant; it warms that variant up first. Otherwise, and with ``first``, it
    compiles the first variant as before."""
    import dataclasses
    import torch
    from tr_hydra.runtime.runner import Trainer, warm_up_order
    seen = {}

    class Fake:
        def __init__(self, pc, order, n, log=None, device_index=0, also=None, launcher=None, twins=(), saved=False,
                     share_training=True):
            seen.update(order=order, n=n, twins=twins, share_training=share_training)

    monkeypatch.setattr(pcm, "Precompiler", Fake)
    monkeypatch.setattr(pcm, "caches_enabled", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (100 * GiB, 141 * GiB))
    assert plan_config_from(compose([])).runtime.precompile_own == "auto"
    assert plan_config_from(compose(["runtime.precompile_own=first"])).runtime.precompile_own == "first"
    assert plan_config_from(compose(["runtime.precompile_own=validation"])).runtime.precompile_own == "validation"
    train, val = ["train_base", "train_last"], ["val_base", "val_last"]
    cases = [  # runtime overrides, validation variants -> (own, the children's order)
        (dict(precompile=8), val, ("val_base", [("train_base", True), ("train_last", True), ("val_last", False)])),
        # every validation variant here, one after another: a child for each training variant only
        (dict(precompile=8, precompile_own="validation"), val,
         ("val_base and val_last", [("train_base", True), ("train_last", True)])),
        (dict(precompile=3, precompile_own="validation"), val,
         ("val_base and val_last", [("train_base", True), ("train_last", True)])),
        (dict(precompile=2, precompile_own="validation"), val,  # a child for each training variant is enough
         ("val_base and val_last", [("train_base", True), ("train_last", True)])),
        (dict(precompile=1, precompile_own="validation"), val,  # too few children: the first, as with auto
         ("train_base", [("train_last", True), ("val_base", False), ("val_last", False)])),
        (dict(precompile=8, precompile_own="first"), val,
         ("train_base", [("train_last", True), ("val_base", False), ("val_last", False)])),
        # two children for three variants: the training process takes queued work as it is, so
        # it keeps the first (a training compile it would otherwise wait for)
        (dict(precompile=2), val, ("train_base", [("train_last", True), ("val_base", False), ("val_last", False)])),
        (dict(precompile=8), [], ("train_base", [("train_last", True)])),  # no validation variant
        # backward twins pair with training variants: the first stays here, with its twin
        (dict(precompile=8, precompile_backward=True), val,
         ("train_base", [("train_last", True), ("val_base", False), ("val_last", False)])),
        (dict(precompile=8, precompile_first=True), val,  # every variant in a child: none here
         (None, [("train_base", True), ("train_last", True), ("val_base", False), ("val_last", False)])),
    ]
    for i, (rt, val_v, (own, order)) in enumerate(cases):
        pc = small_config(train_size=200, batch=32, val_size=80, val_batch=32)
        pc = dataclasses.replace(pc, runtime=dataclasses.replace(pc.runtime, **rt))
        logs = []
        tr = Trainer(pc, tmp_path / str(i), log=logs.append, telemetry=False, source=False)
        tr.inductor = True  # as on CUDA with runtime.compile=auto
        seen.clear()
        assert isinstance(tr._precompiler(train, val_v), Fake), rt
        assert tr._own_first == (own.split(" and ")[0] if own else None) and seen["order"] == order, \
            (rt, tr._own_first, seen)
        assert seen["n"] == min(rt["precompile"], len(order)), (rt, seen)  # no more processes than children
        # the training children share cuDNN's search only in a run without validation variants
        assert seen["share_training"] == (not val_v)
        here = f"{own} here, " if own else ""
        assert any(ln.startswith(f"compiling {len(train) + len(val_v)} variants: {here}{len(order)} in ")
                   for ln in logs), logs
        if own == "val_base and val_last":  # the training process's own variants, compiled whole and kept
            assert tr._own_whole in ([], ["val_base", "val_last"])

    class Pre:  # every child done already: without ``own`` the first name would go first
        def next_ready(self, names):
            return names[0]
    shared = {v: v for v in train + val}
    assert warm_up_order(shared, Pre(), "val_base")(train + val) == "val_base"
    assert warm_up_order(shared, Pre(), "val_base")(train + ["val_last"]) == "train_base"  # done: the rest
    assert warm_up_order(shared, Pre())(train + val) == "train_base"


def test_a_child_is_timed_to_its_own_end_not_to_when_the_main_process_looks():
    """The main process only looks at the children between its own compiles; a child's time is
    when it finished, from its own report, with its phases (building the trainer, the step)."""
    import time
    pc = small_config(train_size=80, val_size=40)
    pre = pcm.Precompiler(pc, [("val_base", False)], workers=1, log=lambda *_: None)
    try:
        c = pre.children[0]
        c.proc.wait()
        finished = time.perf_counter() - c.started
        time.sleep(2.0)  # busy elsewhere
        pre.wait("val_base")
        s = pre.summary()["val_base"]
    finally:
        pre.close()
    assert s["ok"], s
    assert s["seconds"] <= finished + 0.1, (s, finished)
    assert s["trainer_s"] > 0 and s["step_s"] > 0
    assert s["import_s"] + s["trainer_s"] + s["step_s"] <= s["seconds"] + 0.1
    assert "done_at" not in s and isinstance(s["phases_s"], dict) and isinstance(s["timers_s"], dict)
    # runtime.compile_gc: the collector's time during its compiles
    assert set(s["gc"]) == {"seconds", "full", "full_seconds", "full_outside"}, s["gc"]


def test_timers_name_every_phase_over_the_floor_longest_first(monkeypatch):
    """A child reports every Dynamo/Inductor timer of 0.1 s or more (summed over its compiles),
    longest first, the named phases among them."""
    from torch._dynamo import utils
    fake = {"bytecode_tracing": [0.5, 0.75], "GraphLowering.run": [3.0], "Scheduler.codegen": [0.05, 0.04],
            "compile_fx_inner": [2.0, 2.5], "empty": []}
    monkeypatch.setattr(utils, "compilation_time_metrics", fake)
    t = pcm._timers()
    assert list(t.items()) == [("compile_fx_inner", 4.5), ("GraphLowering.run", 3.0), ("bytecode_tracing", 1.25)]
    assert pcm.phase_seconds() == {"trace": 1.25, "inductor": 4.5}
    assert list(pcm._timers(least=0.0, most=2)) == ["compile_fx_inner", "GraphLowering.run"]


def test_next_ready_picks_a_variant_whose_compile_is_done(tmp_path):
    """The warm-up takes the variants in the order their compiles finish: a finished child's
    variant before a running one's, a queued (never started) one at once, since the main process
    compiles it itself, and a variant with no child at all (the first) at once."""
    import subprocess
    import sys
    import time
    pc = small_config(train_size=80, val_size=40)
    pre = pcm.Precompiler(pc, [("train_last", True), ("val_base", False), ("val_last", False)],
                          workers=0, log=lambda *_: None)
    try:
        slow, fast, queued = pre.children
        for c, cmd in ((slow, ["sleep", "30"]), (fast, [sys.executable, "-c", "pass"])):
            pre._queue.remove(c)
            c.log_path = str(tmp_path / f"{c.name}.log")
            open(c.log_path, "w").close()
            c.started, c.started_wall = time.perf_counter(), time.time()
            c.proc = subprocess.Popen(cmd)
        t = time.perf_counter()
        assert pre.next_ready(["train_last", "val_base"]) == "val_base"
        assert pre.next_ready(["train_last", "val_last"]) == "val_last"
        assert pre.next_ready(["train_base", "train_last"]) == "train_base"
        assert time.perf_counter() - t < 10 and slow.ok is None
    finally:
        pre.close()


def test_with_dynamic_batch_only_one_variant_per_graph_goes_to_a_child_and_the_rest_follow_it(tmp_path):
    """runtime.dynamic_batch: the variants of one split and resolution share a graph, compiled
    once (a child each for the graphs after the first); a variant that shares one is warmed up
    only after the variant that compiles it, never in parallel with it."""
    import dataclasses
    from tr_hydra.runtime.runner import Trainer, warm_up_order
    pc = small_config(train_size=200, batch=32, val_size=64, val_batch=32, lowres_epochs=1, res=16, lowres_res=12)
    pc = dataclasses.replace(pc, runtime=dataclasses.replace(pc.runtime, dynamic_batch=True))
    tr = Trainer(pc, tmp_path, log=lambda *_: None, telemetry=False, source=False)
    assert tr.graph_of() == {v.name: v.name for v in pc.variants}  # no Inductor: nothing shared
    tr.inductor = True
    shared = tr.graph_of()
    assert shared == {"train_base": "train_base", "train_last": "train_base", "train_lowres": "train_lowres",
                      "train_lowres_last": "train_lowres", "val_base": "val_base"}, shared
    offered = []

    class Pre:  # the precompiler: the child of train_lowres still running, every other one done
        def next_ready(self, names):
            offered.append(list(names))
            return next(n for n in names if n != "train_lowres")
    pick = warm_up_order(shared, Pre())
    left = ["train_last", "train_lowres", "train_lowres_last", "val_base"]  # train_base is done
    assert pick(left) == "train_last" and offered[-1] == ["train_last", "train_lowres", "val_base"]
    left = ["train_lowres", "train_lowres_last"]
    with pytest.raises(StopIteration):  # only train_lowres is offered: its sibling waits for it
        pick(left)
    assert offered[-1] == ["train_lowres"]
    assert warm_up_order(shared)(["train_lowres_last", "train_lowres"]) == "train_lowres"  # no children


def test_a_child_steps_the_variants_that_share_its_graph_after_its_own():
    pc = small_config(train_size=80, val_size=40, val_batch=32)
    assert [v.name for v in pc.variants if not v.train] == ["val_base", "val_last"]
    pre = pcm.Precompiler(pc, [("val_base", False)], workers=1, log=lambda *_: None, also={"val_base": ["val_last"]})
    try:
        pre.wait("val_base")
        s = pre.summary()
    finally:
        pre.close()
    assert s["val_base"]["ok"] and s["val_base"]["variants"] == ["val_base", "val_last"], s


_KILLED_PARENT = r"""
import os, signal, sys, time
sys.path[:0] = [{root!r}]
from tests.helpers import small_config
from tr_hydra.runtime import precompile as pcm
pre = pcm.Precompiler(small_config(train_size=80, val_size=40), [("val_base", False)], workers=1,
                      log=lambda *_: None)
c = pre.children[0]
print(c.proc.pid, c.log_path, flush=True)
time.sleep({delay})
os.kill(os.getpid(), signal.SIGKILL)  # no close(), no finally: as the out-of-memory killer does
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return not any(ln.startswith("State:") and "Z" in ln.split()[1] for ln in f)
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not __import__("sys").platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
@pytest.mark.parametrize("delay", [0.0, 0.5])  # dead before the child links itself to it, and after (while it imports torch)
def test_a_child_ends_with_a_trainer_killed_outright(delay):
    """A trainer killed with SIGKILL leaves no compile running: its child ends without finishing
    its step (a child left alone runs it to the end and reports its counters, as the tests
    above check), whether the parent died before the child linked itself to it or after."""
    import os
    import subprocess
    import sys
    import time
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    p = subprocess.run([sys.executable, "-c", _KILLED_PARENT.format(root=root, delay=delay)],
                       capture_output=True, text=True, timeout=120, cwd=root)
    assert p.returncode == -9, p.stderr
    pid, log_path = p.stdout.split()
    deadline = time.time() + 60
    while _alive(int(pid)) and time.time() < deadline:
        time.sleep(0.1)
    assert not _alive(int(pid)), "the child outlived its killed parent"
    with open(log_path) as f:
        text = f.read()
    assert not [ln for ln in text.splitlines() if ln.startswith("{")], text  # it never finished its step
    os.remove(log_path)


# ---------------------------------------------------------------- runtime.precompile_start=fork

fork_only = pytest.mark.skipif(not pcm.fork_available(), reason="forked children need Linux")


@fork_only
def test_forked_children_run_each_variant_skip_the_import_and_a_failure_is_reported_not_raised():
    """The same children as above, forked from a launcher that imported PyTorch and the trainer
    once: each runs its variant and reports its counters; none imports again; a failing one is
    reported and left to the main process."""
    pc = small_config(train_size=80, val_size=40)
    logs = []
    pre = pcm.Precompiler(pc, [("train_last", True), ("val_base", False), ("no_such_variant", True)],
                          workers=2, log=logs.append, launcher=pcm.Launcher())
    launcher = pre.launcher
    try:
        for name in ("train_last", "val_base", "no_such_variant"):
            pre.wait(name)
        s = pre.summary()
        pids = [c.proc.pid for c in pre.children]
    finally:
        pre.close()
    assert s["train_last"]["ok"] and s["val_base"]["ok"], (s, logs)
    assert s["train_last"]["start"] == "fork" and launcher.ready_s is not None
    assert "fxgraph_cache_hit" in s["train_last"]
    for name in ("train_last", "val_base"):
        assert s[name]["import_s"] < 0.5, s[name]  # already imported in the launcher
        assert s[name]["start_s"] is not None and s[name]["start_s"] >= 0
    assert len(set(pids)) == 3 and launcher.proc.pid not in pids
    assert s["no_such_variant"]["ok"] is False
    assert any("no_such_variant: parallel compile failed" in ln and "compiling it here" in ln for ln in logs)
    assert launcher.proc.poll() == 0  # closed with the precompiler, after reaping its children
    from tr_hydra.cli.bench import _precompile_line  # what tr-bench prints of it
    line = _precompile_line(s, launcher.ready_s, launcher.error)
    assert line.startswith(f"parallel compiles (fork; the launcher could fork after {launcher.ready_s:.1f}s): ")
    assert "train_last " in line and "import 0.0s" in line and "no_such_variant" in line and "(failed)" in line


def test_spawned_children_report_their_start_too():
    pc = small_config(train_size=80, val_size=40)
    pre = pcm.Precompiler(pc, [("val_base", False)], workers=1, log=lambda *_: None)
    try:
        pre.wait("val_base")
        s = pre.summary()["val_base"]
    finally:
        pre.close()
    assert s["ok"] and s["start"] == "spawn" and s["start_s"] >= 0, s
    assert s["cudnn_share"] is None  # its share argument read (and nothing to share on the CPU)


@fork_only
def test_a_launcher_that_fails_starts_the_children_as_fresh_processes_at_once():
    """A launcher that cannot fork (here: an import fails; on a GPU host, a forked child that
    cannot use CUDA) says so once, and starts every child asked of it as a fresh process: those
    asked before it failed at once, without the training process looking (it is busy compiling
    its own first variant then), and those asked after."""
    import time
    pc = small_config(train_size=80, val_size=40)
    logs = []
    launcher = pcm.Launcher(preload=("torch", "tr_hydra_no_such_module"), log=logs.append)
    pre = pcm.Precompiler(pc, [("train_last", True), ("val_base", False), ("val_last", False)], workers=2,
                          log=logs.append, launcher=launcher)
    try:
        first = pre.children[0]
        assert first.proc.start == "fork" and first.proc.pid is None  # asked while the launcher imports
        assert not launcher.wait_ready(timeout=120) and "tr_hydra_no_such_module" in launcher.error
        deadline = time.time() + 60
        while first.proc.pid is None and time.time() < deadline:
            time.sleep(0.01)
        assert first.proc.start == "spawn" and first.proc.pid is not None  # started with nobody reaping
        for name in ("train_last", "val_base", "val_last"):
            pre.wait(name)  # val_last is asked for after the failure
        s = pre.summary()
    finally:
        pre.close()
    assert all(s[n]["ok"] and s[n]["start"] == "spawn" and s[n]["import_s"] > 0 for n in s), (s, logs)
    assert sum("the launcher failed" in ln and "tr_hydra_no_such_module" in ln for ln in logs) == 1, logs


@fork_only
def test_a_launcher_not_ready_in_time_is_stopped_and_its_children_start_fresh(tmp_path, monkeypatch):
    """A launcher whose imports (or CUDA check) hang is stopped after ``ready_timeout``; the
    children asked of it then start as fresh processes, so the run never waits on it for ever."""
    import os
    (tmp_path / "tr_hydra_slow_import.py").write_text("import time\ntime.sleep(120)\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    logs = []
    launcher = pcm.Launcher(preload=("tr_hydra_slow_import",), log=logs.append, ready_timeout=2)
    pre = pcm.Precompiler(small_config(train_size=80, val_size=40), [("val_base", False)], workers=1,
                          log=logs.append, launcher=launcher)
    try:
        pre.wait("val_base")
        s = pre.summary()["val_base"]
    finally:
        pre.close()
    assert s["ok"] and s["start"] == "spawn", (s, logs)
    assert launcher.error == "not ready after 2s" and launcher.proc.poll() is not None
    assert sum("the launcher failed (not ready after 2s)" in ln for ln in logs) == 1, logs


@fork_only
def test_waiting_for_a_forked_check_is_bounded():
    """The launcher's CUDA check waits for its forked child with a time limit: a child that
    hangs is killed and reaped, one that ends gives its status and what it wrote."""
    import os
    import time
    for code, timeout, want in (("os.write(w, b'no device'); os._exit(3)", 30, (3, "no device")),
                                ("time.sleep(30); os._exit(0)", 0.5, (None, ""))):
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            try:
                exec(code, {"os": os, "time": time, "w": w})
            finally:
                os._exit(1)
        os.close(w)
        t = time.perf_counter()
        assert pcm._wait_exit(pid, r, timeout) == want
        assert time.perf_counter() - t < timeout + 5
        try:
            os.kill(pid, 0)
            alive = True
        except ProcessLookupError:
            alive = False
        assert not alive  # reaped


@fork_only
def test_closing_a_launcher_still_importing_ends_it_at_once():
    import time
    launcher = pcm.Launcher()
    h = launcher.start(["/nonexistent.pkl", "val_base", "val", "0"], "/dev/null")
    t = time.perf_counter()
    launcher.close()
    assert time.perf_counter() - t < 10
    assert launcher.proc.poll() is not None and h.poll() is not None


def test_which_trainers_start_a_launcher(monkeypatch):
    import dataclasses
    monkeypatch.setattr(pcm, "caches_enabled", lambda: True)
    monkeypatch.setattr(pcm, "fork_available", lambda: True)
    base = small_config(train_size=200, batch=32, val_size=64, val_batch=32)  # three variants

    def rt(**kw):
        return dataclasses.replace(base, runtime=dataclasses.replace(base.runtime, **kw))
    assert base.runtime.precompile_start == "auto"
    assert pcm.launcher_wanted(rt(compile="auto"), "cuda", 16)  # the default: forked where fork is available
    assert not pcm.launcher_wanted(rt(compile="auto", precompile_start="spawn"), "cuda", 16)  # fresh processes
    pc = rt(compile="auto", precompile_start="fork")  # Inductor on CUDA, forked children
    assert pcm.launcher_wanted(pc, "cuda", 16)
    assert not pcm.launcher_wanted(pc, "cpu", 16)
    fork = dict(precompile_start="fork")
    assert pcm.launcher_wanted(rt(compile="inductor", **fork), "cuda", 16)
    assert not pcm.launcher_wanted(rt(compile="auto", precompile=0, **fork), "cuda", 16)
    assert not pcm.launcher_wanted(pc, "cuda", 2)            # auto: a third of the cores, none here
    assert not pcm.launcher_wanted(rt(compile="auto", cuda_graph=False, **fork), "cuda", 16)
    assert not pcm.launcher_wanted(rt(compile="none", **fork), "cuda", 16)
    assert not pcm.launcher_wanted(dataclasses.replace(pc, world_size=2), "cuda", 64)  # ddp: auto is off
    monkeypatch.setattr(pcm, "fork_available", lambda: False)
    assert pcm.start_method("fork") == "spawn" and pcm.start_method("auto") == "spawn"
    assert not pcm.launcher_wanted(pc, "cuda", 16)
    assert not pcm.launcher_wanted(rt(compile="auto"), "cuda", 16)
    monkeypatch.setattr(pcm, "caches_enabled", lambda: False)
    monkeypatch.setattr(pcm, "fork_available", lambda: True)
    assert pcm.start_method("fork") == "fork" and pcm.start_method("spawn") == "spawn"
    assert pcm.start_method("auto") == "fork"
    assert not pcm.launcher_wanted(pc, "cuda", 16)           # no Inductor caches: nothing to warm


def test_which_runs_start_a_launcher_before_importing_pytorch(monkeypatch):
    """precompile.start_early: tr-train and a cold mix's own process start the launcher before
    they import PyTorch where the trainer would start one: the same rules as launcher_wanted,
    with the device told by the driver's node and CUDA_VISIBLE_DEVICES, Inductor's cache by its
    variable, and TR_HYDRA_EARLY_LAUNCHER=off to leave it to the trainer."""
    import dataclasses
    monkeypatch.setattr(pcm, "fork_available", lambda: True)
    base = small_config(train_size=200, batch=32, val_size=64, val_batch=32)

    def rt(**kw):
        return dataclasses.replace(base, runtime=dataclasses.replace(base.runtime, **kw))
    pc = rt(compile="auto", device="auto")
    assert pcm.early_launcher_wanted(pc, 16, environ={}, gpu=True)
    assert pcm.early_launcher_wanted(rt(compile="auto", device="cuda"), 16, environ={}, gpu=True)
    assert not pcm.early_launcher_wanted(pc, 16, environ={}, gpu=False)           # no GPU here
    assert not pcm.early_launcher_wanted(rt(compile="auto", device="cpu"), 16, environ={}, gpu=True)
    assert not pcm.early_launcher_wanted(pc, 16, environ={pcm.EARLY_ENV: "off"}, gpu=True)
    assert pcm.early_launcher_wanted(pc, 16, environ={pcm.EARLY_ENV: "auto"}, gpu=True)
    assert not pcm.early_launcher_wanted(pc, 16, environ={"TORCHINDUCTOR_FX_GRAPH_CACHE": "0"}, gpu=True)
    assert not pcm.early_launcher_wanted(pc, 2, environ={}, gpu=True)            # auto: no child on 2 cores
    assert not pcm.early_launcher_wanted(rt(compile="none", device="auto"), 16, environ={}, gpu=True)
    assert not pcm.early_launcher_wanted(rt(compile="auto", precompile_start="spawn"), 16, environ={}, gpu=True)
    monkeypatch.setattr(pcm, "fork_available", lambda: False)
    assert not pcm.early_launcher_wanted(pc, 16, environ={}, gpu=True)
    # the GPU, without PyTorch
    monkeypatch.setattr(pcm.os.path, "exists", lambda p: p == "/dev/nvidiactl")
    assert pcm.gpu_visible({}) and pcm.gpu_visible({"CUDA_VISIBLE_DEVICES": "1"})
    assert not pcm.gpu_visible({"CUDA_VISIBLE_DEVICES": ""}) and not pcm.gpu_visible({"CUDA_VISIBLE_DEVICES": "-1"})
    monkeypatch.setattr(pcm.os.path, "exists", lambda p: False)
    assert not pcm.gpu_visible({})


def test_a_run_that_has_imported_pytorch_starts_no_early_launcher(monkeypatch):
    monkeypatch.setattr(pcm, "early_launcher_wanted", lambda *a, **k: True)
    started = []
    monkeypatch.setattr(pcm, "Launcher", lambda *a, **k: started.append(1))
    pc = small_config(train_size=80, val_size=40)
    assert not pcm.start_early(pc)  # PyTorch is imported in this process: no head start left to win
    assert not started and pcm.take_early() is None


@fork_only
def test_a_trainer_takes_the_launcher_started_before_it_and_hears_what_it_said(monkeypatch, tmp_path):
    """The launcher a command-line tool started early is the trainer's: no second one starts,
    its head start is kept, and a line it said before (here: its import failed) reaches the
    trainer's log. A trainer that wants none closes it."""
    import tr_hydra.runtime.runner as rn
    monkeypatch.setattr(pcm, "early_launcher_wanted", lambda *a, **k: True)
    real = pcm.Launcher
    made = []

    def spy(*a, **k):
        made.append(real(*a, **k) if a or k else real(preload=("tr_hydra_no_such_module",)))
        return made[-1]
    monkeypatch.setattr(pcm, "Launcher", spy)
    pc = small_config(train_size=80, val_size=40)
    try:
        assert pcm.start_early(pc, before_torch=False)
        early = made[0]
        assert not early.wait_ready(timeout=60)  # failed, with no one to tell yet
        monkeypatch.setattr(pcm, "launcher_wanted", lambda *a: True)
        logs = []
        tr = rn.Trainer(pc, tmp_path / "a", log=logs.append, telemetry=False, source=False)
        assert tr._launcher is early and len(made) == 1 and pcm.take_early() is None
        assert tr.launcher_head_start_s is not None and tr.launcher_head_start_s > 0
        assert any("the launcher failed" in ln and "tr_hydra_no_such_module" in ln for ln in logs), logs
        tr.capture()  # on the CPU: nothing to compile in parallel, so it is closed
        assert early.proc.poll() is not None

        assert pcm.start_early(pc, before_torch=False)
        early = made[-1]
        monkeypatch.setattr(pcm, "launcher_wanted", lambda *a: False)
        tr = rn.Trainer(pc, tmp_path / "b", log=lambda *_: None, telemetry=False, source=False)
        assert tr._launcher is None and tr.launcher_head_start_s is None
        early.proc.wait(timeout=30)  # closed by the trainer that did not want it
        assert pcm.take_early() is None
    finally:
        pcm.close_early()
        for launcher in made:
            launcher.close()


def test_default_start_is_auto_and_spawn_and_fork_are_accepted():
    # (a bad value is refused in one line: test_config.test_bad_override_exits_nonzero_with_one_line)
    assert plan_config_from(compose([])).runtime.precompile_start == "auto"
    assert plan_config_from(compose(["runtime.precompile_start=spawn"])).runtime.precompile_start == "spawn"
    assert plan_config_from(compose(["runtime.precompile_start=fork"])).runtime.precompile_start == "fork"


@fork_only
def test_a_trainer_that_fails_to_build_leaves_no_launcher(monkeypatch, tmp_path):
    import tr_hydra.runtime.runner as rn
    started = []

    class Spy(pcm.Launcher):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            started.append(self)

    def boom(*a, **k):
        raise RuntimeError("plan failed")
    monkeypatch.setattr(pcm, "Launcher", Spy)
    monkeypatch.setattr(pcm, "launcher_wanted", lambda *a: True)
    monkeypatch.setattr(rn, "compile_plan", boom)
    with pytest.raises(RuntimeError, match="plan failed"):
        rn.Trainer(small_config(train_size=80, val_size=40), tmp_path, log=lambda *_: None, telemetry=False)
    assert len(started) == 1 and started[0].proc.poll() is not None


@fork_only
def test_a_trainer_that_will_not_capture_closes_its_launcher(monkeypatch, tmp_path):
    """On the CPU a trainer captures nothing: a launcher it started (forced here) is closed at the
    capture, not left idle for the run."""
    import tr_hydra.runtime.runner as rn
    monkeypatch.setattr(pcm, "launcher_wanted", lambda *a: True)
    tr = rn.Trainer(small_config(train_size=80, val_size=40), tmp_path, log=lambda *_: None, telemetry=False,
                    source=False)
    launcher = tr._launcher
    assert launcher is not None
    tr.capture()
    assert tr._launcher is None and launcher.proc.poll() is not None
    tr2 = rn.Trainer(small_config(train_size=80, val_size=40), tmp_path, log=lambda *_: None, telemetry=False,
                     source=False, launcher=False)  # a parallel compile's own trainer
    assert tr2._launcher is None


_KILLED_PARENT_FORK = r"""
import os, signal, sys, time
sys.path[:0] = [{root!r}]
from tr_hydra.runtime import precompile as pcm
launcher = pcm.Launcher()
if {after}:  # a child forked and running: it waits, as a long compile would, on a pipe no one writes
    os.mkfifo({fifo!r})
    h = launcher.start([{fifo!r}, "val_base", "val", "0"], {log!r})
    while h.pid is None:
        time.sleep(0.01)
    print(h.pid, launcher.proc.pid, flush=True)
    time.sleep(0.5)
else:  # the launcher still importing
    print("-", launcher.proc.pid, flush=True)
    time.sleep(0.2)
os.kill(os.getpid(), signal.SIGKILL)
"""


@fork_only
@pytest.mark.parametrize("after", [False, True])
def test_a_launcher_and_its_children_end_with_a_trainer_killed_outright(after, tmp_path):
    """SIGKILL of the training process ends its launcher, whether it is still importing or has
    forked, and the launcher's end ends its children (each linked to it by PR_SET_PDEATHSIG)."""
    import os
    import subprocess
    import sys
    import time
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    log = str(tmp_path / "child.log")
    script = _KILLED_PARENT_FORK.format(root=root, after=after, fifo=str(tmp_path / "plan.fifo"), log=log)
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=240, cwd=root)
    assert p.returncode == -9, p.stderr
    child, launcher = p.stdout.split()
    for who, pid in (("launcher", launcher), ("child", child)):
        if pid == "-":
            continue
        deadline = time.time() + 60
        while _alive(int(pid)) and time.time() < deadline:
            time.sleep(0.1)
        assert not _alive(int(pid)), f"the {who} outlived the killed training process"
    if after:
        with open(log) as f:
            assert not [ln for ln in f if ln.startswith("{")]  # it never finished


def test_each_child_is_given_its_share_of_the_cudnn_search(tmp_path):
    """The children that share the main process's cuDNN search get a distinct share k/n each,
    after the arguments they had before."""
    pc = small_config(train_size=80, val_size=40)
    got = []

    class Proc:
        pid = 1

        def poll(self):
            return None

        def kill(self):
            pass

        def wait(self, timeout=None):
            return 0

    class Launcher:
        def start(self, argv, log_path):
            got.append(list(argv))
            return Proc()

        def close(self):
            pass

    pre = pcm.Precompiler(pc, [("train_last", True), ("val_base", False), ("train_lowres", True), ("val_last", False)],
                          workers=4, log=lambda *_: None, launcher=Launcher())
    pre.close()
    assert [a[1] for a in got] == ["train_last", "val_base", "train_lowres", "val_last"]
    # the validation children share the search (their compiles end first); the training children do not
    assert [a[4:] for a in got] == [[], [pcm.SHARE_FLAG + "0/2"], [], [pcm.SHARE_FLAG + "1/2"]]
    got.clear()
    pre = pcm.Precompiler(pc, [("train_last", True), ("train_lowres", True)], workers=2, log=lambda *_: None,
                          launcher=Launcher())
    pre.close()  # no validation child: every child shares
    assert [a[4:] for a in got] == [[pcm.SHARE_FLAG + "0/2"], [pcm.SHARE_FLAG + "1/2"]]


def test_a_childs_share_runs_on_cuda_only_with_the_driver_cache_and_a_search_to_share(monkeypatch):
    import torch
    from tr_hydra.runtime import cudnn_prime as cp
    from tests.unit.test_cudnn_prime import _distinct_calls
    calls = _distinct_calls(7)
    made = []

    class Job:
        def __init__(self, mine, device, after=None):
            made.append((mine, device, after))

    class Tr:
        device = torch.device("cuda", 0)

        def _prime_calls(self):
            return calls

    monkeypatch.setattr(cp, "ShareBeforeRun", Job)
    monkeypatch.setattr(cp, "can_search_ahead", lambda: True)
    monkeypatch.delenv("CUDA_CACHE_DISABLE", raising=False)
    assert isinstance(pcm._share_search(Tr(), (1, 3)), Job)
    mine, device, after = made[-1]
    assert mine == cp.share_of(calls, 1, 3) == [calls[5], calls[2]] and device == Tr.device
    was = torch.backends.cudnn.benchmark
    try:
        torch.backends.cudnn.benchmark = True
        after()  # at the end of the child's compile: its own step searches nothing
        assert torch.backends.cudnn.benchmark is False
    finally:
        torch.backends.cudnn.benchmark = was
    assert pcm._share_search(Tr(), None) is None
    monkeypatch.setenv("CUDA_CACHE_DISABLE", "1")
    assert pcm._share_search(Tr(), (1, 3)) is None
    monkeypatch.delenv("CUDA_CACHE_DISABLE")
    cpu = Tr()
    cpu.device = torch.device("cpu")
    assert pcm._share_search(cpu, (1, 3)) is None
    none = Tr()
    none._prime_calls = lambda: None  # runtime.prime_cudnn off, or deterministic
    assert pcm._share_search(none, (1, 3)) is None
    assert len(made) == 1


def test_bench_line_shows_each_childs_share_of_the_search():
    from tr_hydra.cli.bench import _precompile_line
    s = {"val_base": {"ok": True, "seconds": 30.0, "start": "fork", "step_s": 20.0,
                      "cudnn_share": {"calls": 40, "of": 41, "seconds": 12.44}},
         "val_last": {"ok": True, "seconds": 31.0, "start": "fork", "step_s": 21.0,
                      "cudnn_share": {"calls": 0, "of": 41, "seconds": 0.0, "error": "RuntimeError: no room"}},
         "train_last": {"ok": True, "seconds": 60.0, "start": "fork", "step_s": 50.0, "cudnn_share": None}}
    line = _precompile_line(s, 6.1)
    assert "val_base 30.0s (step 20.0s, cuDNN share 40/41 in 12.4s)" in line
    assert "cuDNN share 0/41 in 0.0s (RuntimeError: no room)" in line
    assert "train_last 60.0s (step 50.0s)" in line


def test_a_cold_mixs_own_process_for_tr_hydra_starts_the_launcher_before_importing_pytorch(monkeypatch):
    """tr-bench's cold epoch mix runs each mode in a process of its own; tr_hydra's starts its
    trainer's launcher right after composing the config (the bench's pid in the environment
    marks such a process; reading it takes it, so it is read first). Other processes do not."""
    import os
    from tr_hydra.cli import bench

    class Stop(Exception):
        pass
    calls = []

    def spy(pc, **k):
        calls.append(pc)
        raise Stop
    monkeypatch.setattr(pcm, "start_early", spy)
    monkeypatch.setattr(pcm, "die_with_parent", lambda var: os.environ.pop(var, None) is not None)
    mode = ["data=synthetic", "bench.modes=[]", "bench.epoch_mix=true", "bench.epoch_mix_modes=[tr]",
            "bench.cold=false"]
    monkeypatch.setenv(bench.COLD_PARENT_VAR, str(os.getppid()))
    with pytest.raises(Stop):
        bench.main(mode)
    assert len(calls) == 1 and calls[0].data.name == "synthetic"
    b = compose(mode).bench
    assert bench._tr_mix_process(b, True) and not bench._tr_mix_process(b, False)
    for other in (["bench.epoch_mix_modes=[eager]"], ["bench.modes=[eager]"], ["bench.cold=true"]):
        assert not bench._tr_mix_process(compose(mode + other).bench, True), other
