"""Getting every variant of a runtime's step compiled and captured before the first step.

``start(pc)`` begins as early as it can, before the runtime is built: the launcher of the
parallel compiles imports PyTorch and Inductor meanwhile. ``get_ready(rt, launcher)`` then
(on CUDA with captured graphs): finds the variants an earlier run kept in the saved store;
starts one child process per further variant (``children``), each compiling its variant whole;
compiles one variant in this process, whole, while cuDNN's search runs on a thread beside it
(``cudnn``); warms up each variant as its compile is ready (loading the child's file instead of
tracing it); captures every variant as CUDA graphs (``runtime.graphs``); and keeps this run's
compiles in the store. It returns a ``StartupReport``. Without captured graphs it only searches
cuDNN's algorithms; off CUDA it does nothing.
"""
from __future__ import annotations

import contextlib
import time
from typing import TYPE_CHECKING

# no PyTorch at import (``cudnn``, ``store`` and torch are imported where used): a child or
# the launcher (``python -m tr_hydra.startup.child``) imports this package first, and must link
# itself to its parent and time its own imports before PyTorch's (see ``launcher``)
from tr_hydra.startup.children import Precompiler, caches_enabled, cpu_count, launcher_wanted, memory_limited, \
    requested_workers
from tr_hydra.startup.launcher import Launcher
from tr_hydra.startup.report import StartupReport

if TYPE_CHECKING:
    import torch

__all__ = ["StartupReport", "build", "get_ready", "start"]


def start(pc, device: torch.device, log=print) -> Launcher | None:
    """The launcher of the parallel compiles ``get_ready`` will run, started now so that its
    imports overlap the runtime's build; None where none will be forked."""
    if not launcher_wanted(pc, device.type, cpu_count()):
        return None
    from tr_hydra import internals
    if pc.runtime.recompute == "none" and internals.is_open():  # every variant a child would compile kept by an earlier run: none
        from types import SimpleNamespace

        from tr_hydra.compiler.compile import inductor_wanted, instantiate_model
        from tr_hydra.compiler.tuning import resolve
        from tr_hydra.startup.store import KeptCompiles
        # runtime.tuning as the runtime will choose it
        pc, _ = resolve(pc, instantiate_model(pc, "meta"), device.type, inductor_wanted(pc, device.type))
        kc = KeptCompiles.open(SimpleNamespace(pc=pc, device=device), lambda *_: None)
        if kc is not None and all(kc.store.find(kc.key(v.name)) for v in pc.variants[1:]):
            return None
    try:
        return Launcher(log=log)
    except OSError as e:
        log(f"parallel compiles: no launcher ({e.strerror}); each starts as a fresh process")
        return None


def build(pc, log=print):
    """``(runtime, launcher)``: a ``Runtime`` of ``pc``, with the launcher of its parallel compiles
    (``start``) started before it so that the launcher's imports overlap the build; no launcher
    is left behind where the build fails."""
    from tr_hydra.runtime.build import Runtime, pick_device
    launcher = start(pc, pick_device(pc), log)
    try:
        return Runtime(pc, log), launcher
    except BaseException:
        if launcher is not None:
            launcher.close()
        raise


class _Plan:
    """Who compiles what: the variants an earlier run kept (``kc.found``: loaded), the one this
    process compiles itself (``own``), those it compiles whole to keep (``whole``), and the
    children's (``pre``)."""

    def __init__(self, rt, launcher: Launcher | None, log):
        self.kc = None
        self.own: str | None = None
        self.whole: list[str] = []
        self.pre: Precompiler | None = None
        train_v = [v.name for v in rt.pc.variants if v.train]
        val_v = [v.name for v in rt.pc.variants if not v.train]
        if not rt.inductor or not caches_enabled():
            return
        import torch
        from tr_hydra.startup.store import KeptCompiles
        every = [(v, True) for v in train_v] + [(v, False) for v in val_v]
        # a whole compile (saved_compile) does not go through runtime.recompute's partitioner
        # options: with them, the children only fill Inductor's caches and nothing is kept
        from tr_hydra import internals
        whole = rt.pc.runtime.recompute == "none" and internals.is_open()
        if not internals.is_open():
            log("saved store: not used with stock torch.compile; each variant is traced here and its code "
                "found in Inductor's caches")
        elif not whole:
            log(f"runtime.recompute={rt.pc.runtime.recompute}: no whole compiles (they would not recompute); "
                f"each variant is traced here and its code found in the caches")
        self.kc = KeptCompiles.open(rt, log) if whole else None
        found = self.kc.look_up([v for v, _ in every]) if self.kc else {}
        left = [(v, t) for v, t in every if v not in found]
        # what this process compiles itself it compiles whole, to keep; narrowed below to its
        # own variant when children take the others
        self.whole = [v for v, _ in left] if self.kc else []
        order = [(v, t) for v, t in every[1:] if v not in found]
        if not order:
            return
        want = requested_workers(rt.pc.runtime.precompile, len(order), rt.pc.world_size, cpu_count())
        from tr_hydra.runtime.guards import HEADROOM
        c = rt.compiled
        free, _ = torch.cuda.mem_get_info(rt.device)
        n = memory_limited(want, free, c.fixed_need, c.activation_bound, HEADROOM)
        if n < want:  # too few by eager autograd's count: count as the partition keeps
            n = memory_limited(want, free, c.fixed_need, c.activation_estimate, HEADROOM)
        if n == 0:
            if want:
                log("runtime.precompile: no room on the device for a parallel compile; compiling in turn")
            return
        mine = [v for v, _ in every[:1] if v not in found]
        val_children = [v for v, t in order if not t]
        if mine and val_children:
            # a validation variant's compile (a forward only) ends well before a training one's, so
            # the cuDNN search this process runs at the end of its own compile no longer comes
            # after the slowest compile; where every other variant still gets a child of its own
            rest = [(mine[0], True)] + [(v, t) for v, t in order if v != val_children[0]]
            if n >= len(rest):
                order, mine, n = rest, val_children[:1], len(rest)
        self.own = mine[0] if mine else None
        self.whole = mine if self.kc else []
        log(f"compiling {len(every) - len(found)} variants: " + (f"{self.own} here, " if self.own else "")
            + f"{len(order)} in {n} parallel process{'es' if n > 1 else ''}")
        self.pre = Precompiler(rt.pc, order, n, log=log, device_index=rt.device.index or 0, launcher=launcher,
                               saved=whole)

    def load(self, rt, v: str, rep: StartupReport, log) -> None:
        """Before ``v``'s warm-up: its whole compile, kept by an earlier run or saved by its
        child, put in place of the traced forward (one line if it does not load: the variant is
        then compiled here)."""
        if self.kc is not None and v in self.kc.found:
            secs = self.kc.load(rt.forwards, v)
            if secs is not None:
                rep.loaded_s[v] = secs
            return
        path = self.pre.saved_forward(v) if self.pre is not None else None
        if path is None:
            return
        t = time.perf_counter()
        try:
            rt.forwards.load(v, path)
        except Exception as e:  # noqa: BLE001 - Inductor's caches still hold its code
            log(f"  {v}: its saved compile did not load ({type(e).__name__}: {str(e)[:160]}); tracing it here")
            return
        rep.loaded_s[v] = time.perf_counter() - t

    def keep(self, rt, rep: StartupReport, log) -> None:
        """After the capture: keep this run's compiles in the store (see ``KeptCompiles.keep``)."""
        got = rt.forwards.report()
        for v, why in got.mismatched.items():
            log(f"  {v}: its saved compile was made for another input ({why}); compiled here instead")
            rep.loaded_s.pop(v, None)
            if self.kc is not None:
                self.kc.forget(v)
        if self.kc is None:
            return
        compiled = {}
        if self.whole:  # recorded by get_ready (``Forwards.record``)
            for v, why in got.errors.items():
                log(f"saved store: {v} could not be compiled whole here ({why.splitlines()[0]}); "
                    f"traced as usual, not kept")
            compiled = got.compiled
            rep.whole_compile_s = {v: t for v, t in got.seconds.items() if v in self.whole}
        files = {v: p for v in rep.loaded_s if self.pre is not None and (p := self.pre.saved_forward(v))}
        self.kc.keep(compiled, files)
        self.kc.trim()
        rep.from_store, rep.preloaded = list(self.kc.from_store), list(self.kc.preloaded)
        rep.kept, rep.store_write_s = list(self.kc.kept), self.kc.write_s


def _order(pre: Precompiler | None, own: str | None):
    """The warm-up's choice of the next variant among those left: ``own`` (the variant this
    process compiles itself, whose compile ends with cuDNN's search) while it is left, then with
    parallel compiles the first one ready, else the first."""
    def pick(names: list[str]) -> str:
        if own in names:
            return own
        return pre.next_ready(names) if pre is not None else names[0]
    return pick


def warm_up_hooks(beat, pick, pre: Precompiler | None, load):
    """The warm-up's ``(next_variant, before_variant)`` hooks (see ``CudaGraphs.capture``),
    telling ``beat`` (a ``progress.Heartbeat``) what the wait is: while ``pick`` (``_order``)
    waits for any parallel compile to finish; then for the chosen variant's own; then its
    warm-up, in which this process compiles it or loads the child's work (``load(v)``)."""
    def next_variant(names: list[str]) -> str:
        if pre is not None:
            beat.now("waiting for the parallel compiles")
        return pick(names)

    def before_variant(v: str) -> None:
        if pre is not None:
            beat.now(f"waiting for {v}'s parallel compile")
            pre.wait(v)
        load(v)
        beat.now(f"warming up {v}")
    return next_variant, before_variant


def get_ready(rt, launcher: Launcher | None = None, log=print) -> StartupReport:
    """Every variant of ``rt`` compiled and captured (see the module's text); ``rt``'s steps
    replay the graphs from then on (``Runtime.use_graphs``). ``launcher``: ``start``'s, taken
    over (closed here). The random generators end as they began: what the cuDNN search, the
    compiles and the warm-up draw does not shift the stream the steps draw their dropout and
    stochastic-depth masks from (``runtime.rng``), in a fresh run and a resumed one alike."""
    from tr_hydra.runtime.rng import StartupDraws
    draws = StartupDraws(rt.device)
    rep = _get_ready(rt, launcher, log)
    draws.put()
    return rep


def _get_ready(rt, launcher: Launcher | None, log) -> StartupReport:
    import torch
    from tr_hydra.startup import cudnn
    rep = StartupReport()
    t0 = time.perf_counter()
    pc = rt.pc
    if rt.device.type != "cuda" or not pc.runtime.cuda_graph:
        if launcher is not None:
            launcher.close()
        if rt.device.type == "cuda":
            rep.cudnn = cudnn.search_now(rt, log, rep.phases)
        return rep
    from tr_hydra.runtime.graphs import CudaGraphs
    from tr_hydra.runtime.progress import Heartbeat
    graphs = CudaGraphs(rt.ex)
    train_v = [v.name for v in pc.variants if v.train]
    val_v = [v.name for v in pc.variants if not v.train]
    try:
        plan = _Plan(rt, launcher, log)
    except BaseException:
        if launcher is not None:
            launcher.close()
        raise
    if launcher is not None and (plan.pre is None or plan.pre.launcher is not launcher):
        launcher.close()  # not used: no parallel compiles after all
    pre = plan.pre
    rep.own = plan.own
    rep.phases["start_children"] = time.perf_counter() - t0
    ahead = rec = None
    # a line every 30 s while the search, a variant's compile or the wait for a parallel one
    # goes on: the first compile alone takes most of a minute, and nothing else is said
    beat = Heartbeat(log, extra=pre.running_note if pre else None)
    try:
        first = plan.own or (train_v + val_v)[0]
        if plan.whole:  # compiled whole here, to be kept
            rec = rt.forwards.record({v: None for v in plan.whole},
                                     on_compiled=lambda: ahead is not None and ahead.compiled())
        if not (plan.kc and first in plan.kc.found):  # else no compile comes before its convolutions
            ahead = cudnn.search_ahead(rt, first in plan.whole, log, rep.phases)
        if ahead is None:
            with beat:
                beat.now("searching cuDNN's algorithms")
                # the compiles kept by an earlier run load on a thread meanwhile: the search runs
                # no compile and the loads no convolution
                with (plan.kc.preloading(rt.model) if plan.kc else contextlib.nullcontext()):
                    rep.cudnn = cudnn.search_now(rt, log, rep.phases)

        def settle() -> None:  # before the first capture, which must see no other thread's work
            nonlocal ahead
            beat.close()
            if ahead is not None:
                job, ahead = ahead, None
                rep.cudnn = cudnn.settle(job, log)

        next_variant, before_variant = warm_up_hooks(beat, _order(pre, plan.own), pre,
                                                     lambda v: plan.load(rt, v, rep, log))
        with _flush_fit(rt) as flush, beat:
            graphs.capture(train_v, val_v, pc.runtime.warmup_steps, before_variant=before_variant,
                           next_variant=next_variant, before_capture=settle)
        rt.use_graphs(graphs)
        plan.keep(rt, rep, log)
        _say_loads(rep, log)
        if flush is not None:
            rep.autotune_flush = flush
            if flush.benchmarks or not flush.supported:
                log(flush.line())
    except torch.cuda.OutOfMemoryError:
        from tr_hydra.runtime.guards import MemoryPlanError, capture_oom_message
        rt.use_graphs(None)
        torch.cuda.empty_cache()
        free, _ = torch.cuda.mem_get_info(rt.device)
        raise MemoryPlanError(capture_oom_message(rt.compiled, free, str(rt.device))) from None
    finally:
        if rec is not None:  # its callback holds this startup's search ahead
            rec.on_compiled = None
        if ahead is not None:  # the capture failed: its error is the one raised
            try:
                ahead.close()
            except Exception:  # noqa: BLE001
                pass
        if pre is not None:
            rep.children = pre.summary()
            if pre.launcher is not None:
                rep.launcher_ready_s, rep.launcher_error = pre.launcher.ready_s, pre.launcher.error
            pre.close()
    rep.warmup_seconds, rep.warmup_work = dict(graphs.warmup_seconds), dict(graphs.warmup_work)
    rep.warmup_phases, rep.graph_seconds = dict(graphs.warmup_phases), graphs.graph_seconds
    rep.capture_seconds, rep.peak_after_warmup = graphs.capture_seconds, graphs.peak_after_warmup
    rep.graphs = len(graphs.train) + len(graphs.val)
    rep.seconds = time.perf_counter() - t0
    log(f"captured {rep.graphs} CUDA graphs in {graphs.capture_seconds:.1f}s")
    return rep


def _say_loads(rep: StartupReport, log) -> None:
    own = [v for v in rep.kept if v in rep.whole_compile_s]
    kept = (f"kept for later runs: {', '.join(rep.kept)}"
            + (f" ({', '.join(own)} compiled whole here, written in {rep.store_write_s:.1f}s)" if own else "")
            if rep.kept else "")
    if rep.loaded_s:
        during = f", {', '.join(rep.preloaded)} on a thread during cuDNN's search" if rep.preloaded else ""
        log(f"loaded the saved compiles of {len(rep.loaded_s)} variants in {sum(rep.loaded_s.values()):.1f}s ("
            + ", ".join(f"{v} {s:.1f}s" for v, s in rep.loaded_s.items()) + during + ")"
            + (f"; {kept}" if kept else ""))
    elif kept:
        log(f"saved store: {kept}")


def _flush_fit(rt):
    """With Inductor: while every variant warms up, Triton's autotuning flushes L2 with at most
    the room under the memory high-water mark (``autotune_flush``); yields its report, or None."""
    from tr_hydra import internals
    if not rt.inductor or not internals.is_open():
        return contextlib.nullcontext()
    from tr_hydra.internals.autotune_flush import fit_under_peak
    return fit_under_peak(rt.device)
