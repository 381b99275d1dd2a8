"""CUDA: cuDNN's search before the first step (startup.cudnn) leaves no algorithm search for the
steps (seen in the caching allocator's history: the search's workspace is allocated from
``generate_and_filter_plans``)."""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import small_config
from tr_hydra.startup import cudnn as cp
from tr_hydra.train.trainer import Trainer

pytestmark = pytest.mark.cuda


def search_allocations(fn) -> list[tuple[int, str]]:
    """(size, which convolution) of the blocks cuDNN's plan search allocates while ``fn`` runs."""
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="all")
    try:
        fn()
        torch.cuda.synchronize()
    finally:
        snap = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
    def which(frames):
        return next((f["name"][:120] for f in frames if "raw_cudnn_convolution" in f["name"]
                     or "cudnn_convolution" in f["name"]), "?")
    return [(e["size"], which(e["frames"])) for trace in snap["device_traces"] for e in trace
            if e["action"] == "alloc"
            and any("generate_and_filter_plans" in f["name"] for f in e.get("frames", ()))]


@pytest.fixture(autouse=True)
def _benchmark():
    was = torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic
    torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic = True, False
    yield
    torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic = was


def test_a_primed_convolution_does_not_search_again():
    dev = torch.device("cuda")
    w = torch.randn(40, 24, 3, 3, device=dev, dtype=torch.bfloat16).to(memory_format=torch.channels_last)
    conv = torch.nn.Conv2d(24, 40, 3, padding=1, bias=False)
    conv.weight.data = w
    calls = cp.record(conv, 7, 24, 19, torch.bfloat16, True)
    assert [c.backward for c in calls] == [False, True]
    primed = search_allocations(lambda: cp.prime(calls, dev))
    assert primed, "the search was not seen (is cudnn.benchmark on?)"

    def step():
        # an image: no gradient wanted for it, as recorded
        x = torch.randn(7, 24, 19, 19, device=dev, dtype=torch.bfloat16).contiguous(
            memory_format=torch.channels_last)
        ww = w.detach().requires_grad_(True)
        F.conv2d(x, ww, padding=1).float().square().sum().backward()
    assert search_allocations(step) == []
    # a shape not primed searches (the check above can fail)
    w2 = w[:, :16].contiguous(memory_format=torch.channels_last)
    x2 = torch.randn(7, 16, 19, 19, device=dev, dtype=torch.bfloat16).contiguous(memory_format=torch.channels_last)
    assert search_allocations(lambda: F.conv2d(x2, w2, padding=1))


@pytest.mark.parametrize("compile", ["none", "inductor"])
def test_trainer_warm_up_finds_every_plan_primed(tmp_path, compile, monkeypatch):
    """What the meta-device recording finds is what the step runs, eager or through Inductor:
    after the search, the warm-up and capture of every variant search nothing."""
    batch = 24 if compile == "none" else 20  # shapes of their own: cuDNN's cache is per process
    pc = small_config(device="cuda", compile=compile, amp=True, batch=batch, val_batch=batch,
                      train_size=3 * batch + 5, val_size=batch + 3, lowres_epochs=1, max_steps=2)
    tr = Trainer(pc, tmp_path, log=lambda *_: None)
    rep = cp.search_now(tr.rt)
    assert rep is not None and rep.calls > 10
    # get_ready searches again before the warm-up (its plans cached now: no new search). Not
    # ahead on a thread beside the first compile: cuDNN caches its plans per thread, so that
    # thread would search anew (the next test covers the search ahead)
    monkeypatch.setattr(cp, "search_ahead", lambda *a, **k: None)
    assert search_allocations(tr.get_ready) == []
    assert len(tr.graphs.train) == 2 * 4  # the four training variants, both buffers
    assert tr.startup.cudnn is not None and tr.startup.cudnn.calls == rep.calls  # get_ready's own search
    tr.fit()

    # with get_ready's search taken away, the same kind of trainer searches during its warm-up
    # (the check above can fail)
    monkeypatch.setattr(cp, "search_now", lambda *a, **k: None)
    other = small_config(device="cuda", compile=compile, amp=True, batch=batch + 2, val_batch=batch + 2,
                         train_size=3 * batch + 9, val_size=batch + 5, max_steps=2)
    tr2 = Trainer(other, tmp_path / "off", log=lambda *_: None)
    assert search_allocations(tr2.get_ready)
    assert tr2.startup.cudnn is None


def test_with_inductor_the_search_starts_beside_the_first_compile_and_ends_before_any_step(tmp_path, monkeypatch):
    """No explicit search: get_ready() starts the search on a thread while the first variant
    compiles (whole, to be kept in the saved store), and the main thread searches at the end of
    that compile. Every search allocation (either thread's) comes before the compiled step's
    first allocation: none in a warm-up step."""
    batch = 18  # shapes of their own: cuDNN's cache is per process
    monkeypatch.setattr(cp, "_COMPILED_FORWARDS", set())  # other tests' runtimes: a compile must come
    # an empty store: the first variant is compiled here, not loaded from an earlier run's
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "cache"))
    torch._dynamo.reset()
    pc = small_config(device="cuda", compile="inductor", amp=True, batch=batch, val_batch=batch,
                      train_size=3 * batch + 7, val_size=batch + 1, lowres_epochs=1, max_steps=2)
    tr = Trainer(pc, tmp_path, log=lambda *_: None)
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="all")
    try:
        tr.get_ready()
        torch.cuda.synchronize()
    finally:
        snap = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
    from torch._inductor.runtime.cache_dir_utils import cache_dir
    allocs = [e for trace in snap["device_traces"] for e in trace if e["action"] == "alloc"]
    search_at = [i for i, e in enumerate(allocs)
                 if any("generate_and_filter_plans" in f["name"] for f in e.get("frames", ()))]
    assert search_at, "no search seen (is cudnn.benchmark on?)"
    # the compiled code's own buffers (Inductor's generated module, in its cache folder)
    compiled = [i for i, e in enumerate(allocs)
                if any(f["filename"].startswith(cache_dir()) for f in e.get("frames", ()))]
    assert compiled, "the compiled step's allocations were not seen"
    assert max(search_at) < compiled[0], (max(search_at), compiled[0])
    rep = tr.startup.cudnn
    assert tr.startup.from_store == [] and rep is not None and rep.in_first_compile and rep.calls > 10
    assert rep.ahead_error == "" and rep.ahead_seconds > 0, rep
    tr.fit()


def test_with_no_compile_in_the_warm_up_the_search_thread_ends_before_the_capture(tmp_path, monkeypatch):
    """A second trainer of the same model and shapes in one process: Dynamo may reuse the first
    one's compiled forward, so no compile comes to end the search ahead. Forced to search ahead
    anyway (the guard against it cleared), its thread must be stopped before the first capture
    (a capture must see no other thread's work: this failed the capture before). No store and
    no parallel compiles: every variant traced here through Dynamo, none compiled whole."""
    batch = 22
    pc = small_config(device="cuda", compile="inductor", amp=True, batch=batch, val_batch=batch,
                      train_size=3 * batch + 1, val_size=batch + 1, lowres_epochs=1, max_steps=2)
    pc = dataclasses.replace(pc, runtime=dataclasses.replace(pc.runtime, saved_store_gb=0, precompile=0))
    Trainer(pc, tmp_path / "a", log=lambda *_: None).fit()
    monkeypatch.setattr(cp, "_COMPILED_FORWARDS", set())
    logs = []
    tr = Trainer(pc, tmp_path / "b", log=logs.append)
    res = tr.fit()  # gets ready, then trains
    assert res.capture_seconds > 0 and len(tr.graphs.train) == 2 * 4, logs
    if tr.startup.cudnn is None:  # Dynamo reused the compile
        assert any("no compile came in the warm-up" in str(ln) for ln in logs), logs
