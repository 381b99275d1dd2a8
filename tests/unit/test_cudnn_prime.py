"""cuDNN's search before the first step (startup.cudnn): the convolutions a step runs, found on
the meta device, against forward hooks on a real CPU run of the same model; their replay; and
the search ahead beside the first compile."""
import contextlib
from collections import Counter

import pytest
import torch
import torch.nn as nn
import torchvision

from tr_hydra.models.stem import ImageConv2d, fold_input, fold_weight, space_to_depth_stem
from tr_hydra.startup import cudnn as cp


def _hooked(model: nn.Module, x: torch.Tensor, train: bool):
    """(forward calls, backward calls) of every Conv2d as a real CPU run sees them."""
    seen = []

    def hook(mod, args, out):
        a = args[0]
        seen.append((tuple(a.shape), tuple(mod.weight.shape), mod.stride, mod.padding, mod.dilation,
                     mod.groups, mod.bias is not None, a.requires_grad))
    hs = [m.register_forward_hook(hook) for m in model.modules() if isinstance(m, nn.Conv2d)]
    model.train(train)
    try:
        if train:
            model(x)
        else:
            with torch.no_grad():
                model(x)
    finally:
        for h in hs:
            h.remove()
    fwd = Counter((s[:7]) for s in seen)
    bwd = Counter((s[:6] + ((s[7], True, s[6]),)) for s in seen) if train else Counter()
    return fwd, bwd


def _recorded(calls):
    fwd = Counter((c.x.shape, c.w.shape, c.stride, c.padding, c.dilation, c.groups, c.bias is not None)
                  for c in calls if not c.backward)
    bwd = Counter((c.x.shape, c.w.shape, c.stride, c.padding, c.dilation, c.groups, c.output_mask)
                  for c in calls if c.backward)
    return fwd, bwd


@pytest.mark.parametrize("train", [True, False])
def test_recorded_convolutions_match_a_real_run(train):
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=7)
    x = torch.randn(3, 3, 40, 40)
    ref_fwd, ref_bwd = _hooked(model, x, train)
    model.train()
    calls = cp.record(model, 3, 3, 40, torch.float32, train, channels_last=True)
    fwd, bwd = _recorded(calls)
    assert fwd == Counter({(k[0], k[1], k[2], k[3], k[4], k[5], k[6]): n for k, n in ref_fwd.items()})
    assert bwd == ref_bwd
    assert sum(fwd.values()) == 20 and sum(bwd.values()) == (20 if train else 0)
    # the image conv has no input gradient to compute
    assert [c.output_mask for c in calls if c.backward and c.x.shape[1] == 3] == ([(False, True, False)]
                                                                                 if train else [])
    # in the compute dtype and the step's layout (the weights as the model holds them)
    assert all(c.x.dtype == torch.float32 for c in calls)
    assert not any(p.device.type == "meta" for p in model.parameters())  # the model is untouched
    assert model.training


def test_recorded_dtype_and_channels_last_of_the_image_convolutions():
    model = torchvision.models.resnet18().to(memory_format=torch.channels_last)
    space_to_depth_stem(model, ["conv1"])
    calls = cp.record(model, 2, 3, 64, torch.bfloat16, True)
    assert {c.x.dtype for c in calls} == {torch.bfloat16} and {c.w.dtype for c in calls} == {torch.bfloat16}
    stem_fwd = calls[0]
    folded = fold_input(torch.empty(2, 3, 64, 64), 7, 3)
    assert stem_fwd.x.shape == tuple(folded.shape)
    assert stem_fwd.w.shape == tuple(fold_weight(model.conv1.weight.detach(), 3).shape)
    # the folded image is read channels-last, as on CUDA (not NCHW as on the CPU)
    assert stem_fwd.x.stride == tuple(folded.contiguous(memory_format=torch.channels_last).stride())
    cifar = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
                          nn.Conv2d(8, 8, 3, padding=1))
    cifar[0].__class__ = ImageConv2d
    c = cp.record(cifar, 4, 3, 8, torch.float16, True)
    assert c[0].x.stride == (192, 1, 24, 3) and c[0].x.dtype == torch.float16
    assert c[1].bias is not None and c[1].bias.shape == (8,)
    back = [k for k in c if k.backward]
    assert [k.output_mask for k in back] == [(True, True, True), (False, True, False)]
    assert back[0].bias_sizes == (8,)


def test_prime_replays_each_distinct_call_once_as_recorded():
    model = torchvision.models.resnet18(num_classes=5)
    calls = cp.record(model, 2, 3, 32, torch.float32, True)
    assert len(cp.unique(calls)) < len(calls)  # repeated blocks
    rec = cp._Recorder()
    with rec:
        rep = cp.prime(calls, torch.device("cpu"))
    # each backward once, through autograd (which runs its forward too: one of the forwards)
    assert [c for c in rec.calls if c.backward] == [c for c in cp.unique(calls) if c.backward]
    assert set(c for c in rec.calls if not c.backward) == set(c for c in calls if not c.backward)
    assert rep.calls == len(cp.unique(calls))
    assert rep.largest_bytes == max(sum(s.nbytes for s in (c.x, c.w, c.grad_out, c.bias) if s is not None)
                                    for c in calls)


def test_tensor_spec_bytes_cover_padded_strides():
    s = cp.TensorSpec((2, 3, 4, 5), (80, 1, 20, 4), torch.bfloat16)  # channels padded to 4
    assert s.nbytes == (1 + 1 * 80 + 2 * 1 + 3 * 20 + 4 * 4) * 2
    t = s.make(torch.device("cpu"))
    assert t.stride() == (80, 1, 20, 4) and torch.isfinite(t).all()


def _runtime(pc=None, logs=None):
    from tests.helpers import small_config
    from tr_hydra.runtime.build import Runtime
    return Runtime(pc or small_config(), log=logs.append if logs is not None else (lambda *_: None), source=False)


def test_no_search_on_cpu_or_when_deterministic(monkeypatch):
    import dataclasses
    from tests.helpers import small_config
    from tr_hydra.startup import get_ready
    assert not cp.searches(torch.device("cpu"))
    rt = _runtime()
    assert cp.calls_of(rt) is None and cp.search_now(rt) is None
    assert get_ready(rt, None, lambda *_: None).cudnn is None
    # on CUDA, cuDNN searches where the runtime turned its benchmark mode on: not when deterministic
    cuda = torch.device("cuda")
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: True)
    monkeypatch.setattr(torch.backends.cudnn, "enabled", True)
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", False)
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    assert not cp.searches(cuda)
    try:
        _runtime()
        assert cp.searches(cuda)
        pc = small_config()
        _runtime(dataclasses.replace(pc, runtime=dataclasses.replace(pc.runtime, deterministic=True)))
        assert not cp.searches(cuda)
    finally:
        torch.use_deterministic_algorithms(False)


def test_a_model_the_meta_device_cannot_run_leaves_the_search_to_the_steps(monkeypatch):
    logged = []
    rt = _runtime(logs=logged)
    h = rt.model.register_forward_pre_hook(lambda m, a: a[0].sum().item())  # no values on meta
    monkeypatch.setattr(cp, "searches", lambda device: True)
    phases = {}
    assert cp.search_now(rt, logged.append, phases) is None
    assert any("does not run on the meta device" in m and "cuDNN searches inside the first steps" in m
               for m in logged), logged
    assert phases["record_convs"] > 0
    h.remove()
    rep = cp.search_now(rt, logged.append)  # the same runtime, recordable: searched (on the CPU the runs just run)
    every = [c for v in rt.pc.variants for c in cp.record(rt.model, v.batch, 3, v.res, torch.float32, v.train)]
    assert rep is not None and rep.calls == len(cp.unique(every)) > 0
    assert logged[-1] == f"cuDNN searched {rep.calls} convolutions before the first step in {rep.seconds:.1f}s"


def _slow_prime(monkeypatch, seconds=0.8):
    """cudnn_prime.prime replaced by one that takes ``seconds``, noting the thread and end time."""
    import threading
    import time
    runs = []

    def prime(calls, device, stop=None):
        time.sleep(seconds)
        runs.append((threading.get_ident(), time.perf_counter()))
        return cp.PrimeReport(len(calls), seconds, 0)
    monkeypatch.setattr(cp, "prime", prime)
    return runs


def test_search_ahead_then_on_the_main_thread_before_the_compiled_code_runs(monkeypatch):
    """The thread searches while the main thread compiles; when Dynamo finishes the compile, the
    main thread waits for it and searches itself (its cache is the one the steps use), and only
    then does the compiled code run."""
    import threading
    import time
    assert cp.can_search_ahead()  # the PyTorch versions supported have the callback
    torch._dynamo.reset()
    # the thread's search takes longer than this tiny compile, however loaded the machine (a
    # 0.8 s search left 0.27 s to wait after a slow 0.53 s compile on a CI runner)
    runs = _slow_prime(monkeypatch, seconds=2.5)
    conv = nn.Conv2d(3, 4, 3)
    calls = cp.record(conv, 2, 3, 8, torch.float32, True, channels_last=False)
    main = []

    def main_search():
        main.append(threading.get_ident())
        return cp.prime(calls, torch.device("cpu"))
    ran = []

    def step(x):
        return conv(x).relu().sum()
    f = torch.compile(step, backend="eager", dynamic=False)
    job = cp.BeforeFirstRun(calls, torch.device("cpu"), None, main_search)
    out = f(torch.randn(2, 3, 8, 8))
    ran.append(time.perf_counter())
    f(torch.randn(2, 3, 8, 8))  # no second main search
    rep = job.close()
    assert torch.isfinite(out)
    assert len(runs) == 2 and runs[0][0] != threading.get_ident()  # the thread's, then the main one
    assert main == [threading.get_ident()] and runs[1][0] == threading.get_ident()
    assert runs[0][1] <= runs[1][1] <= ran[0]
    assert rep.calls == len(calls) and rep.ahead_seconds == 2.5 and rep.waited > 0.5, rep
    from torch._dynamo.callback import callback_handler
    assert job._cb not in callback_handler.end_callbacks  # later compiles do not search


def test_search_ahead_error_is_raised_at_close_not_inside_dynamo(monkeypatch):
    torch._dynamo.reset()
    _slow_prime(monkeypatch, seconds=0.1)

    def main_search():
        raise torch.cuda.OutOfMemoryError("no room for the workspace")
    job = cp.BeforeFirstRun([], torch.device("cpu"), None, main_search)
    f = torch.compile(lambda x: x * 2, backend="eager", dynamic=False)
    assert torch.equal(f(torch.ones(3)), torch.full((3,), 2.0))  # the compile itself is untouched
    with pytest.raises(torch.cuda.OutOfMemoryError, match="no room"):
        job.close()


def test_search_ahead_ignores_a_compile_on_another_thread(monkeypatch):
    import threading
    torch._dynamo.reset()
    _slow_prime(monkeypatch, seconds=0.1)
    main = []
    job = cp.BeforeFirstRun([], torch.device("cpu"), None, lambda: main.append(1))
    f = torch.compile(lambda x: x + 1, backend="eager", dynamic=False)
    t = threading.Thread(target=lambda: f(torch.ones(2)))
    t.start()
    t.join()
    assert main == []
    assert job.close() is None  # no compile on the main thread: no main search


def test_search_ahead_on_cuda_without_an_index_sets_the_owner_device_on_its_thread(monkeypatch):
    """``torch.device("cuda")`` carries no index and ``torch.cuda.set_device`` needs one: the
    thread takes the owner's current device (the first GPU form passed the bare device, the
    thread's search failed at once and nothing said so)."""
    import contextlib
    import threading
    torch._dynamo.reset()
    runs = _slow_prime(monkeypatch, seconds=0.05)
    set_to = []
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: set_to.append((threading.get_ident(), d)))
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    job = cp.BeforeFirstRun([], torch.device("cuda"), object(), lambda: cp.prime([], torch.device("cpu")))
    f = torch.compile(lambda x: x - 1, backend="eager", dynamic=False)
    f(torch.ones(2))
    rep = job.close()
    assert [d for _, d in set_to] == [3] and set_to[0][0] != threading.get_ident()
    assert rep.ahead_error == "" and rep.ahead_seconds == 0.05 and len(runs) == 2


def test_search_ahead_failure_on_the_thread_is_reported_and_the_main_search_still_runs(monkeypatch):
    import threading
    torch._dynamo.reset()
    owner = threading.get_ident()

    def prime(calls, device, stop=None):
        if threading.get_ident() != owner:
            raise ValueError("Expected a torch.device with a specified index\nsecond line")
        return cp.PrimeReport(len(calls), 0.2, 0)
    monkeypatch.setattr(cp, "prime", prime)
    job = cp.BeforeFirstRun([], torch.device("cpu"), None, lambda: cp.prime([], torch.device("cpu")))
    f = torch.compile(lambda x: x * 3, backend="eager", dynamic=False)
    f(torch.ones(2))
    rep = job.close()
    assert rep.seconds == 0.2 and rep.ahead_seconds == 0.0
    assert rep.ahead_error == "ValueError: Expected a torch.device with a specified index"


def test_prime_stops_between_convolutions_when_told():
    import threading
    calls = cp.record(nn.Conv2d(3, 4, 3), 2, 3, 8, torch.float32, True, channels_last=False)
    stop = threading.Event()
    stop.set()
    assert cp.prime(calls, torch.device("cpu"), stop=stop).calls == 0
    assert cp.prime(calls, torch.device("cpu")).calls == len(cp.unique(calls)) > 1


def test_closing_the_search_ahead_with_no_compile_stops_its_thread(monkeypatch):
    """When no compile comes (Dynamo reused one), the job is closed before the first CUDA graph
    capture: its thread must end there, after the convolution in progress, not run on into the
    capture."""
    import time
    torch._dynamo.reset()
    ran = []

    def slow_run(self, device):
        ran.append(time.perf_counter())
        time.sleep(0.1)
    monkeypatch.setattr(cp.ConvCall, "run", slow_run)
    calls = _distinct_calls(40)  # 4 s in all
    job = cp.BeforeFirstRun(calls, torch.device("cpu"), None, lambda: pytest.fail("no compile, no main search"))
    time.sleep(0.25)
    t = time.perf_counter()
    assert job.close() is None
    # running on would take the rest of the 4 s; the bounds leave room for a loaded machine
    assert time.perf_counter() - t < 1.5 and not job._thread.is_alive()
    assert 1 <= len(ran) <= 15, len(ran)


def _searchable(monkeypatch):
    """cuDNN searching and the capture stream as on CUDA (the searches run on the CPU), and no
    model forward compiled yet in this process."""
    import types
    from tr_hydra.runtime import graphs
    monkeypatch.setattr(cp, "_COMPILED_FORWARDS", set())
    monkeypatch.setattr(cp, "searches", lambda device: True)
    monkeypatch.setattr(graphs, "capture_stream", lambda device: types.SimpleNamespace(wait_stream=lambda s: None))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: None)


def _inductor_runtime(pc=None):
    rt = _runtime(pc)
    rt.inductor = True  # as on CUDA
    return rt


def test_a_later_runtime_of_the_same_model_searches_before_the_warm_up(monkeypatch):
    """Dynamo may reuse the first runtime's compiled forward (it guards on the module's
    structure), so a later runtime of the same model in the process (a sweep's next job) gets
    no compile to search at the end of: it searches before its warm-up instead."""
    import dataclasses
    from tests.helpers import small_config
    from tr_hydra.internals import recompute
    _searchable(monkeypatch)
    jobs = [cp.search_ahead(_inductor_runtime(), False) for _ in range(2)]
    assert isinstance(jobs[0], cp.BeforeFirstRun) and jobs[1] is None
    assert jobs[0].close() is None  # no compile came
    # a runtime that clears Dynamo's compiled code (another recompute mode) is sure to compile
    monkeypatch.setattr(recompute, "_compiled_with", [("none", ())])
    pc = small_config(compile="inductor")
    rt = _runtime(dataclasses.replace(pc, runtime=dataclasses.replace(pc.runtime, recompute="pointwise")))
    assert rt.forwards.dropped
    job = cp.search_ahead(rt, False)
    assert isinstance(job, cp.BeforeFirstRun)
    job.close()
    assert cp.search_ahead(_runtime(), True) is None  # no Inductor: no compile to end it


def test_a_whole_compile_ends_the_search_ahead_as_dynamos_callback_does(monkeypatch):
    """``aot_compile`` calls no compile-end callback: the recorder tells the job instead
    (``compiled()``), which runs the main search once, on the owner thread only."""
    import threading
    torch._dynamo.reset()
    runs = _slow_prime(monkeypatch, seconds=0.3)
    main = []
    job = cp.BeforeFirstRun([], torch.device("cpu"), None, lambda: main.append(threading.get_ident()) or
                            cp.prime([], torch.device("cpu")))
    other = threading.Thread(target=job.compiled)  # another thread's compile: not this job's
    other.start()
    other.join()
    assert main == []
    job.compiled()
    job.compiled()
    rep = job.close()
    assert main == [threading.get_ident()] and len(runs) == 2 and rep.waited > 0.1 and rep.in_first_compile


def test_a_whole_compile_of_the_first_variant_is_searched_at_even_for_a_forward_compiled_before(monkeypatch):
    """One compiled whole here (``whole_first``: the recorder tells the job) always comes, even
    for a model whose forward Dynamo compiled before."""
    _searchable(monkeypatch)
    cp.search_ahead(_inductor_runtime(), False).close()  # this model's forward: compiled from now on
    rt = _inductor_runtime()
    assert cp.search_ahead(rt, False) is None  # Dynamo may reuse it
    job = cp.search_ahead(rt, True)
    assert isinstance(job, cp.BeforeFirstRun)
    job.close()


class _Kept:
    """KeptCompiles as ``get_ready`` uses it: ``found``, and ``preloading`` (whether it is on)."""

    def __init__(self, found):
        self.found = dict.fromkeys(found, "kept.forward")
        self.loading = False

    @contextlib.contextmanager
    def preloading(self, model):
        self.loading = True
        try:
            yield
        finally:
            self.loading = False


@pytest.mark.parametrize("case", ["first kept", "own compiled whole", "first traced", "none ahead"])
def test_no_search_ahead_when_the_first_variant_loads_a_kept_compile(monkeypatch, case):
    """``get_ready``: the first variant warmed up loads a compile kept by an earlier run: no
    compile comes before its convolutions run, so the search is done before the warm-up (while
    the kept compiles load on a thread). One compiled here is searched at the end of its compile:
    whole (the recorder tells the job) or through Dynamo."""
    import types
    from tr_hydra import startup
    from tests.helpers import small_config
    from tr_hydra.runtime import graphs
    pc = small_config(train_size=200, batch=32, val_size=64, val_batch=32)  # train_base, train_last, val_base
    from tr_hydra.internals import saved_compile
    from tr_hydra.runtime.forwards import Forwards
    monkeypatch.setattr(saved_compile, "compile_forward",
                        lambda model, x, options=None, name="": saved_compile.SavedForward(None, model, None, name))
    captured = []
    rt = types.SimpleNamespace(pc=pc, device=torch.device("cuda"), inductor=True, model=None, ex=None,
                               forwards=Forwards(None), use_graphs=captured.append)
    own, whole, found = {"first kept": (None, [], ["train_base"]),
                         "own compiled whole": ("val_base", ["val_base"], ["train_base"]),
                         "first traced": (None, [], []),
                         "none ahead": (None, [], ["train_last"])}[case]
    events = []
    plan = types.SimpleNamespace(own=own, whole=whole, pre=None, kc=_Kept(found),
                                 load=lambda rt, v, rep, log: events.append(("load", v)),
                                 keep=lambda rt, rep, log: events.append("keep"))

    class Job:
        def compiled(self):
            events.append("compiled")

        def close(self):
            events.append("close")
            return cp.PrimeReport(3, 0.1, 0, in_first_compile=True)

    def search_ahead(rt_, whole_first, log=print, phases=None):
        assert rt_ is rt
        events.append(("ahead", whole_first))
        return None if case == "none ahead" else Job()

    def search_now(rt_, log=print, phases=None):
        events.append(("now", plan.kc.loading))
        return cp.PrimeReport(3, 0.1, 0)

    class Graphs:
        train, val, warmup_seconds, warmup_work, warmup_phases = [], [], {}, {}, {}
        graph_seconds = capture_seconds = 0.0
        peak_after_warmup = 0

        def __init__(self, ex):
            pass

        def capture(self, train_v, val_v, warmup_steps, before_variant, next_variant, before_capture):
            first = next_variant(train_v + val_v)
            before_variant(first)
            events.append(("warm up", first))
            if first in whole:  # recorded by get_ready: its whole compile ends, before its code runs
                rt.forwards.for_variant(first, torch.zeros(1))
            before_capture()
            events.append("capture")

    monkeypatch.setattr(startup, "_Plan", lambda rt, launcher, log: plan)
    monkeypatch.setattr(startup, "_flush_fit", lambda rt: contextlib.nullcontext())
    monkeypatch.setattr(cp, "search_ahead", search_ahead)
    monkeypatch.setattr(cp, "search_now", search_now)
    monkeypatch.setattr(graphs, "CudaGraphs", Graphs)
    rep = startup.get_ready(rt, None, lambda *_: None)
    first = own or "train_base"
    warm_up = [("load", first), ("warm up", first)]
    assert events == {
        "first kept": [("now", True)] + warm_up + ["capture", "keep"],
        "own compiled whole": [("ahead", True)] + warm_up + ["compiled", "close", "capture", "keep"],
        "first traced": [("ahead", False)] + warm_up + ["close", "capture", "keep"],
        "none ahead": [("ahead", False), ("now", True)] + warm_up + ["capture", "keep"]}[case], events
    assert rep.cudnn is not None and rep.cudnn.in_first_compile == (case in ("own compiled whole", "first traced"))
    assert len(captured) == 1 and isinstance(captured[0], Graphs)  # handed to the runtime


def test_settle_reports_the_search_ahead_or_why_the_steps_searched():
    class Job:
        def __init__(self, out):
            self.out = out

        def close(self):
            if isinstance(self.out, BaseException):
                raise self.out
            return self.out
    logs = []
    rep = cp.PrimeReport(12, 1.4, 0, in_first_compile=True, ahead_seconds=3.5, waited=0.3)
    assert cp.settle(Job(rep), logs.append) is rep
    assert logs == [("cuDNN searched 12 convolutions at the end of the first compile, after a thread's search "
                     "beside it (3.5s, waited 0.3s), in 1.4s")]
    assert cp.settle(Job(None), logs.append) is None
    assert logs[-1] == "cuDNN search: no compile came in the warm-up; cuDNN searched inside the first steps"
    assert cp.settle(Job(RuntimeError("\nCUDNN_STATUS_INTERNAL_ERROR\nmore")), logs.append) is None
    assert logs[-1] == ("cuDNN search: the search at the end of the first compile failed "
                        "(CUDNN_STATUS_INTERNAL_ERROR); cuDNN searched inside the first steps instead")
    with pytest.raises(torch.cuda.OutOfMemoryError, match="no room"):
        cp.settle(Job(torch.cuda.OutOfMemoryError("no room for the workspace")), logs.append)
    assert len(logs) == 3


def test_meta_runs_with_batchnorm_memoized_give_the_same_shapes_saved_bytes_and_convolutions():
    """MetaMemo (BatchNorm's meta kernels run once per distinct call) changes nothing the plan
    or the search uses: the activation bytes autograd saves, with and without recompute, the
    logits' shape, and the convolutions recorded, against plain meta runs; and it does skip
    repeated calls."""
    from tr_hydra.compiler.analysis import MetaMemo, propagate
    m = torchvision.models.resnet50(num_classes=10).to("meta").to(memory_format=torch.channels_last)
    for train in (True, False):
        for recompute in (False, True):
            assert (propagate(m, 4, 3, 64, torch.bfloat16, train, recompute, memo=True)
                    == propagate(m, 4, 3, 64, torch.bfloat16, train, recompute, memo=False))
        assert (cp.record(m, 4, 3, 64, torch.bfloat16, train, memo=True)
                == cp.record(m, 4, 3, 64, torch.bfloat16, train, memo=False))
    memo = MetaMemo()
    x = torch.empty(4, 3, 64, 64, device="meta")
    with torch.no_grad(), memo:
        m.eval()(x)
    assert memo.hits >= 20  # ResNet-50's 53 BatchNorms have few distinct shapes


def _distinct_calls(n: int):
    return [cp.ConvCall(False, cp.TensorSpec((1, c, 4, 4), (16 * c, 16, 4, 1), torch.float32),
                        cp.TensorSpec((c, c, 1, 1), (c, 1, 1, 1), torch.float32), (1, 1), (0, 0), (1, 1),
                        False, (0, 0), 1) for c in range(1, n + 1)]
