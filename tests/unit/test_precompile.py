"""Parallel precompilation: how many children, who compiles what (``startup._Plan``), and the
child processes themselves (on CPU the children run the eager step; on the GPU, tests/gpu
checks that the main process then loads Inductor's compiled code)."""
from __future__ import annotations

import pytest

from tr_hydra import startup
from tr_hydra.cli._common import compose
from tr_hydra.resolve import resolve
from tr_hydra.startup import children as pcm
from tr_hydra.startup import launcher as lch

from tests.helpers import small_config

GiB = 2**30


def test_requested_workers():
    # the variants left after the main process's own (five of six): at most one child each
    assert pcm.requested_workers("auto", 5, 1, 16) == 5
    assert pcm.requested_workers("auto", 5, 1, 7) == 2     # a third of the cores
    assert pcm.requested_workers("auto", 5, 1, 2) == 0
    assert pcm.requested_workers("auto", 5, 2, 64) == 0    # ddp: the ranks compile side by side
    assert pcm.requested_workers(3, 5, 2, 64) == 3         # unless asked for
    assert pcm.requested_workers(10, 5, 1, 2) == 5
    assert pcm.requested_workers(0, 5, 1, 16) == 0
    assert pcm.requested_workers("auto", 0, 1, 16) == 0    # nothing left for a child
    assert pcm.requested_workers(4, 0, 1, 16) == 0


def test_memory_limit_counts_each_child_and_the_main_activations():
    # child: (1 + 2) GiB * 1.1 + 0.75 GiB context = 4.05 GiB; the main process keeps 2.2 GiB
    assert pcm.memory_limited(5, 20 * GiB, 1 * GiB, 2 * GiB, 1.1) == 4   # 17.8 / 4.05
    assert pcm.memory_limited(3, 20 * GiB, 1 * GiB, 2 * GiB, 1.1) == 3
    assert pcm.memory_limited(5, 6 * GiB, 1 * GiB, 2 * GiB, 1.1) == 0    # 3.8 GiB spare < 4.05
    assert pcm.memory_limited(5, 2 * GiB, 1 * GiB, 2 * GiB, 1.1) == 0


def test_default_is_auto_and_counts_are_accepted():
    assert resolve(compose([])).runtime.precompile == "auto"
    assert resolve(compose(["runtime.precompile=3"])).runtime.precompile == 3


def test_children_run_each_variant_and_a_failure_is_reported_not_raised():
    pc = small_config(train_size=80, val_size=40)  # train_base, train_last, val_base, val_last
    logs = []
    pre = pcm.Precompiler(pc, [("train_last", True), ("val_base", False), ("no_such_variant", True)],
                          workers=2, log=logs.append, saved=False)
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
    from tr_hydra.config.specs import DistSpec
    for k, v in (("RANK", "1"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "1"), ("MASTER_ADDR", "127.0.0.1"),
                 ("MASTER_PORT", "1")):
        monkeypatch.setenv(k, v)
    pc = dataclasses.replace(small_config(train_size=80, val_size=40), world_size=2,
                             dist=DistSpec(mode="ddp", timeout_s=20))
    pre = pcm.Precompiler(pc, [("val_base", False)], workers=1, log=lambda *_: None, saved=False)
    try:
        pre.wait("val_base")
        s = pre.summary()
    finally:
        pre.close()
    assert s["val_base"]["ok"], s


def test_a_variant_whose_child_has_not_started_is_compiled_in_the_main_process():
    pc = small_config(train_size=80, val_size=40)
    pre = pcm.Precompiler(pc, [("train_last", True), ("val_base", False)], workers=1, log=lambda *_: None,
                          saved=False)
    try:
        pre.wait("val_base")  # its child is still queued behind train_last's: not waited for
        assert pre.children[1].proc is None
        pre.wait("train_last")
        s = pre.summary()
    finally:
        pre.close()
    assert s["train_last"]["ok"] and s["val_base"]["ok"] is None
    assert pre.children[1].proc is None  # and never started afterwards


def _runtime(monkeypatch, free=100 * GiB, cpus=16, **kw):
    """A CPU runtime that ``startup._Plan`` takes for one with Inductor on CUDA (free device
    memory ``free``, ``cpus`` cores), with the Precompiler replaced by a recorder of its
    arguments."""
    import dataclasses
    import torch
    from tr_hydra.runtime.build import Runtime
    seen = {}

    class Fake:
        def __init__(self, pc, order, n, log=None, device_index=0, launcher=None, saved=True):
            seen.update(order=order, n=n, launcher=launcher, saved=saved)
    monkeypatch.setattr(startup, "Precompiler", Fake)
    monkeypatch.setattr(startup, "caches_enabled", lambda: True)
    monkeypatch.setattr(startup, "cpu_count", lambda: cpus)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (free, 141 * GiB))
    runtime = kw.pop("runtime", {})
    pc = small_config(**kw)
    pc = dataclasses.replace(pc, runtime=dataclasses.replace(pc.runtime, **runtime))
    rt = Runtime(pc, log=lambda *_: None, source=False)
    rt.inductor = True  # as on CUDA with runtime.compile=auto
    return rt, seen, Fake


def test_the_training_process_compiles_a_validation_variant_while_each_other_has_a_child(tmp_path, monkeypatch):
    """Where every other variant gets a child of its own, the training process compiles a
    validation variant (a forward only) and a child takes the first training variant; it warms
    that variant up first. Otherwise it compiles the first variant. What it compiles itself it
    compiles whole, to keep, where the saved store is on."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "cache"))  # an empty store
    sizes = dict(train_size=200, batch=32, val_size=80, val_batch=32)  # train_base/last, val_base/last
    first = ("train_base", [("train_last", True), ("val_base", False), ("val_last", False)])
    swapped = ("val_base", [("train_base", True), ("train_last", True), ("val_last", False)])
    cases = [  # (runtime overrides, sizes, free device memory, cores) -> (own, the children's order, processes)
        (dict(precompile=8), sizes, 100 * GiB, 16, swapped + (3,)),
        (dict(precompile=3), sizes, 100 * GiB, 16, swapped + (3,)),   # just enough children
        (dict(precompile="auto"), sizes, 100 * GiB, 16, swapped + (3,)),  # 16 cores: 5 wanted, 3 needed
        # two children for three variants: the training process takes queued work as it is, so
        # it keeps the first (a training compile it would otherwise wait for)
        (dict(precompile=2), sizes, 100 * GiB, 16, first + (2,)),
        (dict(precompile=1), sizes, 100 * GiB, 16, first + (1,)),
        (dict(precompile="auto"), sizes, 100 * GiB, 7, first + (2,)),   # a third of 7 cores
        # room for two children only (each ~0.77 GiB: a context and this tiny plan): the first here
        (dict(precompile=8), sizes, 2 * GiB, 16, first + (2,)),
        (dict(precompile=8), dict(sizes, val_size=0), 100 * GiB, 16, ("train_base", [("train_last", True)], 1)),
    ]
    for i, (runtime, kw, free, cpus, (own, order, n)) in enumerate(cases):
        rt, seen, _ = _runtime(monkeypatch, free=free, cpus=cpus, runtime=runtime, **kw)
        logs = []
        plan = startup._Plan(rt, None, logs.append)
        assert plan.pre is not None and plan.own == own and seen["order"] == order and seen["n"] == n, \
            (runtime, cpus, free, plan.own, seen)
        assert seen["saved"] is True  # the children save their compiles for this process to load
        assert plan.whole == [own] and plan.kc is not None and plan.kc.found == {}
        total = len(rt.pc.variants)
        assert any(ln == f"compiling {total} variants: {own} here, {len(order)} in {n} parallel "
                   f"process{'es' if n > 1 else ''}" for ln in logs), logs

    # the saved store off: nothing compiled whole here, the same choice
    rt, seen, _ = _runtime(monkeypatch, runtime=dict(precompile=8, saved_store_gb=0), **sizes)
    plan = startup._Plan(rt, None, lambda *_: None)
    assert plan.own == "val_base" and plan.whole == [] and plan.kc is None and seen["order"] == swapped[1]
    # no room for any child: no children, the first compiled here in turn
    rt, seen, _ = _runtime(monkeypatch, free=GiB // 2, runtime=dict(precompile=8, saved_store_gb=0), **sizes)
    logs = []
    plan = startup._Plan(rt, None, logs.append)
    assert plan.pre is None and plan.own is None and not seen
    assert "runtime.precompile: no room on the device for a parallel compile; compiling in turn" in logs
    # no parallel compiles asked for, or no Inductor: no children, nothing said
    for runtime, inductor in ((dict(precompile=0, saved_store_gb=0), True), (dict(precompile=8), False)):
        rt, seen, _ = _runtime(monkeypatch, runtime=runtime, **sizes)
        rt.inductor = inductor
        logs = []
        plan = startup._Plan(rt, None, logs.append)
        assert plan.pre is None and plan.own is None and not seen and not logs, (runtime, logs)

    class Pre:  # every child done already: without ``own`` the precompiler picks (here: the last)
        def next_ready(self, names):
            return names[-1]
    train, val = ["train_base", "train_last"], ["val_base", "val_last"]
    assert startup._order(Pre(), "val_base")(train + val) == "val_base"
    assert startup._order(Pre(), "val_base")(train + ["val_last"]) == "val_last"  # done: the precompiler's pick
    assert startup._order(Pre(), None)(train + val) == "val_last"
    assert startup._order(None, None)(train + val) == "train_base"  # no children: in order


def test_a_child_is_timed_to_its_own_end_not_to_when_the_main_process_looks():
    """The main process only looks at the children between its own compiles; a child's time is
    when it finished, from its own report, with its phases (building the runtime, the step)."""
    import time
    pc = small_config(train_size=80, val_size=40)
    pre = pcm.Precompiler(pc, [("val_base", False)], workers=1, log=lambda *_: None, saved=False)
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


def test_timers_name_every_phase_over_the_floor_longest_first(monkeypatch):
    """A child reports every Dynamo/Inductor timer of 0.1 s or more (summed over its compiles),
    longest first, the named phases among them."""
    from torch._dynamo import utils
    from tr_hydra.internals.dynamo import compile_timers, phase_totals
    from tr_hydra.startup import child
    fake = {"bytecode_tracing": [0.5, 0.75], "GraphLowering.run": [3.0], "Scheduler.codegen": [0.05, 0.04],
            "compile_fx_inner": [2.0, 2.5], "empty": []}
    monkeypatch.setattr(utils, "compilation_time_metrics", fake)
    t = compile_timers(0.1, 30)  # as a child reports them
    assert list(t.items()) == [("compile_fx_inner", 4.5), ("GraphLowering.run", 3.0), ("bytecode_tracing", 1.25)]
    assert phase_totals() == {"trace": 1.25, "inductor": 4.5}
    assert list(compile_timers(least=0.0, most=2)) == ["compile_fx_inner", "GraphLowering.run"]


def test_next_ready_picks_a_variant_whose_compile_is_done(tmp_path):
    """The warm-up takes the variants in the order their compiles finish: a finished child's
    variant before a running one's, a queued (never started) one at once, since the main process
    compiles it itself, and a variant with no child at all (the first) at once."""
    import subprocess
    import sys
    import time
    pc = small_config(train_size=80, val_size=40)
    pre = pcm.Precompiler(pc, [("train_last", True), ("val_base", False), ("val_last", False)],
                          workers=0, log=lambda *_: None, saved=False)
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


def test_each_child_is_asked_for_with_its_variant_split_device_and_file():
    """What the precompiler asks of the launcher for each child, in the warm-up's order: the
    plan, the variant, its split, the device, and (saving) where to write its compile, as
    ``child.main`` reads them."""
    import os
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

    variants = [("train_last", True), ("val_base", False), ("val_last", False)]
    pre = pcm.Precompiler(pc, variants, workers=3, log=lambda *_: None, device_index=2, launcher=Launcher())
    tmp = pre._tmp.name
    pre.close()
    assert got == [[os.path.join(tmp, "plan.pkl"), n, "train" if t else "val", "2",
                    f"{pcm.SAVE_FLAG}{os.path.join(tmp, n + '.forward')}"] for n, t in variants]
    got.clear()
    pre = pcm.Precompiler(pc, variants, workers=2, log=lambda *_: None, launcher=Launcher(), saved=False)
    pre.close()
    assert [a[1:] for a in got] == [["train_last", "train", "0"], ["val_base", "val", "0"]]  # two at a time


_KILLED_PARENT = r"""
import os, signal, sys, time
sys.path[:0] = [{root!r}]
from tests.helpers import small_config
from tr_hydra.startup import children as pcm
pre = pcm.Precompiler(small_config(train_size=80, val_size=40), [("val_base", False)], workers=1,
                      log=lambda *_: None, saved=False)
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


def test_a_child_imports_no_pytorch_before_it_has_linked_itself_to_its_parent():
    """``python -m tr_hydra.startup.child`` imports the ``startup`` package first: that import
    takes no PyTorch, so a child (or the launcher) links itself to its parent before PyTorch's
    import, and a spawned child's ``import_s`` counts that import."""
    import subprocess
    import sys
    code = "import sys, tr_hydra.startup.child, tr_hydra.startup.launcher; print('torch' in sys.modules)"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.strip() == "False", (p.stdout, p.stderr)


# ---------------------------------------------------------------- children forked from a launcher

fork_only = pytest.mark.skipif(not lch.fork_available(), reason="forked children need Linux")


@fork_only
def test_forked_children_run_each_variant_skip_the_import_and_a_failure_is_reported_not_raised():
    """The same children as above, forked from a launcher that imported PyTorch and the runtime
    once: each runs its variant and reports its counters; none imports again; a failing one is
    reported and left to the main process."""
    pc = small_config(train_size=80, val_size=40)
    logs = []
    pre = pcm.Precompiler(pc, [("train_last", True), ("val_base", False), ("no_such_variant", True)],
                          workers=2, log=logs.append, launcher=lch.Launcher(), saved=False)
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


def test_spawned_children_report_their_start_too():
    pc = small_config(train_size=80, val_size=40)
    pre = pcm.Precompiler(pc, [("val_base", False)], workers=1, log=lambda *_: None, saved=False)
    try:
        pre.wait("val_base")
        s = pre.summary()["val_base"]
    finally:
        pre.close()
    assert s["ok"] and s["start"] == "spawn" and s["start_s"] >= 0, s
    assert s["variants"] == ["val_base"] and s["import_s"] > 0, s


@fork_only
def test_a_launcher_that_fails_starts_the_children_as_fresh_processes_at_once():
    """A launcher that cannot fork (here: an import fails; on a GPU host, a forked child that
    cannot use CUDA) says so once, and starts every child asked of it as a fresh process: those
    asked before it failed at once, without the training process looking (it is busy compiling
    its own first variant then), and those asked after."""
    import time
    pc = small_config(train_size=80, val_size=40)
    logs = []
    launcher = lch.Launcher(preload=("torch", "tr_hydra_no_such_module"), log=logs.append)
    pre = pcm.Precompiler(pc, [("train_last", True), ("val_base", False), ("val_last", False)], workers=2,
                          log=logs.append, launcher=launcher, saved=False)
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
    launcher = lch.Launcher(preload=("tr_hydra_slow_import",), log=logs.append, ready_timeout=2)
    pre = pcm.Precompiler(small_config(train_size=80, val_size=40), [("val_base", False)], workers=1,
                          log=logs.append, launcher=launcher, saved=False)
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
        assert lch._wait_exit(pid, r, timeout) == want
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
    launcher = lch.Launcher()
    h = launcher.start(["/nonexistent.pkl", "val_base", "val", "0"], "/dev/null")
    t = time.perf_counter()
    launcher.close()
    assert time.perf_counter() - t < 10
    assert launcher.proc.poll() is not None and h.poll() is not None


def test_which_runs_start_a_launcher(monkeypatch):
    """A launcher where the start-up will run forked parallel compiles: CUDA, captured graphs,
    Inductor, children wanted, fork available, Inductor's caches on. ``startup.start`` starts
    one only then (and none where it cannot: the children then start as fresh processes)."""
    import dataclasses
    import torch
    monkeypatch.setattr(pcm, "caches_enabled", lambda: True)
    monkeypatch.setattr(pcm, "fork_available", lambda: True)
    base = small_config(train_size=200, batch=32, val_size=64, val_batch=32)  # three variants

    def rt(**kw):
        return dataclasses.replace(base, runtime=dataclasses.replace(base.runtime, **kw))
    pc = rt(compile="auto")  # Inductor on CUDA, forked children
    assert pcm.launcher_wanted(pc, "cuda", 16)
    assert not pcm.launcher_wanted(pc, "cpu", 16)
    assert pcm.launcher_wanted(rt(compile="inductor"), "cuda", 16)
    assert not pcm.launcher_wanted(rt(compile="auto", precompile=0), "cuda", 16)
    assert pcm.launcher_wanted(rt(compile="auto", precompile=1), "cuda", 2)  # a count: whatever the cores
    assert not pcm.launcher_wanted(pc, "cuda", 2)            # auto: a third of the cores, none here
    assert not pcm.launcher_wanted(rt(compile="auto", cuda_graph=False), "cuda", 16)
    assert not pcm.launcher_wanted(rt(compile="none"), "cuda", 16)
    assert not pcm.launcher_wanted(dataclasses.replace(pc, world_size=2), "cuda", 64)  # ddp: auto is off
    one = small_config(train_size=32, batch=32, val_size=32, val_batch=32)  # one variant of each split
    assert len(one.variants) == 2 and pcm.launcher_wanted(
        dataclasses.replace(one, runtime=dataclasses.replace(one.runtime, compile="auto")), "cuda", 16)

    started = []

    class Spy:
        def __init__(self, log=None):
            started.append(log)
    monkeypatch.setattr(startup, "Launcher", Spy)
    monkeypatch.setattr(startup, "cpu_count", lambda: 16)
    pc = rt(compile="auto", saved_store_gb=0)  # no store to look in (its key asks the GPU's name)
    logs = []
    assert isinstance(startup.start(pc, torch.device("cuda"), logs.append), Spy) and started == [logs.append]
    assert startup.start(pc, torch.device("cpu"), logs.append) is None and len(started) == 1
    monkeypatch.setattr(startup, "cpu_count", lambda: 2)  # auto: no child on two cores
    assert startup.start(pc, torch.device("cuda"), logs.append) is None and len(started) == 1
    monkeypatch.setattr(startup, "cpu_count", lambda: 16)

    def no_process(log=None):
        raise OSError(11, "Resource temporarily unavailable")
    monkeypatch.setattr(startup, "Launcher", no_process)
    assert startup.start(pc, torch.device("cuda"), logs.append) is None
    assert logs == ["parallel compiles: no launcher (Resource temporarily unavailable); "
                    "each starts as a fresh process"]

    monkeypatch.setattr(pcm, "fork_available", lambda: False)
    assert not pcm.launcher_wanted(pc, "cuda", 16)  # not Linux: fresh processes
    monkeypatch.setattr(pcm, "caches_enabled", lambda: False)
    monkeypatch.setattr(pcm, "fork_available", lambda: True)
    assert not pcm.launcher_wanted(pc, "cuda", 16)  # no Inductor caches: nothing to warm


@fork_only
def test_a_trainer_that_fails_to_build_leaves_no_launcher(monkeypatch, tmp_path):
    from tr_hydra.runtime import build
    from tr_hydra.train.trainer import Trainer
    started = []

    class Spy(lch.Launcher):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            started.append(self)

    def boom(*a, **k):
        raise RuntimeError("plan failed")
    monkeypatch.setattr(startup, "Launcher", Spy)
    monkeypatch.setattr(startup, "launcher_wanted", lambda *a: True)
    monkeypatch.setattr(build, "compile_plan", boom)
    with pytest.raises(RuntimeError, match="plan failed"):
        Trainer(small_config(train_size=80, val_size=40), tmp_path, log=lambda *_: None, telemetry=False)
    assert len(started) == 1 and started[0].proc.poll() is not None


@fork_only
def test_a_trainer_that_will_not_capture_closes_its_launcher(monkeypatch, tmp_path):
    """On the CPU a trainer captures nothing: a launcher it started (forced here) is closed when
    it gets ready, not left idle for the run."""
    from tr_hydra.train.trainer import Trainer
    monkeypatch.setattr(startup, "launcher_wanted", lambda *a: True)
    tr = Trainer(small_config(train_size=80, val_size=40), tmp_path, log=lambda *_: None, telemetry=False)
    try:
        launcher = tr._launcher
        assert launcher is not None and launcher.proc.poll() is None
        rep = tr.get_ready()
        assert tr._launcher is None and launcher.proc.poll() is not None
        assert rep.children is None and rep.graphs == 0
    finally:
        tr.close()


_KILLED_PARENT_FORK = r"""
import os, signal, sys, time
sys.path[:0] = [{root!r}]
from tr_hydra.startup.launcher import Launcher
launcher = Launcher()
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
