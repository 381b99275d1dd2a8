"""Forwards: which compiled forward serves each variant's steps.

The model's traced forward (under ``torch.compile`` with Inductor, else the model itself) serves
every variant unless the variant has a whole compile (``internals.saved_compile``): one loaded
from a parallel compile's file or from the saved store (``load``, ``use``), or one a ``Recorder``
compiles on the variant's first step (``record``). A whole compile made for another input than
the step's (a kept file whose key missed a difference) is dropped at that step, and the traced
forward serves instead. ``report`` says what served each variant. The executor asks
``for_variant`` at each step; startup hands the compiles over through the other methods.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from tr_hydra.internals import saved_compile

LOADED = "loaded"            # a whole compile from a file (a parallel compile's, or the saved store's)
COMPILED = "compiled whole"  # a whole compile a recorder made in this process
TRACED = "traced"            # the traced forward


@dataclass
class ForwardsReport:
    served: dict[str, str]      # per variant that stepped: LOADED, COMPILED or TRACED (its latest step)
    saved: dict[str, str]       # per variant with a whole compile in place: LOADED or COMPILED
    mismatched: dict[str, str]  # per variant: how its whole compile's input differed (not used)
    compiled: dict[str, saved_compile.SavedForward]  # made whole here with no file (for the store), none mismatched
    errors: dict[str, str]      # per variant: why its whole compile failed (the traced forward serves)
    seconds: dict[str, float]   # per variant: its whole compile (and save)


class Forwards:
    """The forwards of one model's variants. ``traced``: the model's forward as the runtime
    compiled it (default: the model); ``options``: Inductor's options for whole compiles;
    ``dropped``: building ``traced`` dropped Dynamo's compiled code of an earlier runtime (so a
    compile is sure to come)."""

    def __init__(self, model: torch.nn.Module, traced: Callable | None = None, options: dict | None = None,
                 dropped: bool = False):
        self.model = model
        self.traced = traced if traced is not None else model
        self.options = options
        self.dropped = dropped
        self._saved: dict[str, tuple[Callable, str]] = {}  # per variant: (whole compile, LOADED or COMPILED)
        self._recorder: saved_compile.Recorder | None = None
        self._mismatched: dict[str, str] = {}
        self._served: dict[str, str] = {}

    def for_variant(self, variant: str, x: torch.Tensor) -> Callable:
        """The forward ``variant``'s step calls on ``x``: its whole compile where it has one,
        else the traced forward. Called under the step's grad mode and autocast."""
        f, how = self._saved.get(variant, (None, TRACED))
        if f is not None and getattr(f, "signature", None) is not None:
            why = f.signature.differs(saved_compile.Signature.of(self.model, x))
            if why:  # made for another input (a kept file whose key missed a difference): not used
                self._mismatched[variant] = why
                del self._saved[variant]
                f = None
        rec = self._recorder
        if f is None and rec is not None and variant in rec.paths:
            f = rec.forward(variant, self.model, x)  # None: it could not (kept in its report)
            if f is not None:
                how = COMPILED
                self._saved[variant] = (f, how)
        self._served[variant] = how if f is not None else TRACED
        return f if f is not None else self.traced

    def load(self, variant: str, path: str) -> None:
        """Use the whole compile saved in ``path`` (by a parallel compile's recorder) for
        ``variant``'s steps; raises what loading it raises."""
        self.use(variant, saved_compile.load(path, self.model, variant))

    def use(self, variant: str, f: Callable) -> None:
        """Use ``f``, a whole compile loaded elsewhere (the saved store's), for ``variant``'s steps."""
        self._saved[variant] = (f, LOADED)

    def saved(self, variant: str) -> Callable | None:
        """``variant``'s whole compile in place now, or None."""
        return self._saved.get(variant, (None, ""))[0]

    def record(self, paths: dict[str, str | None], on_compiled=None) -> saved_compile.Recorder:
        """From now on each variant of ``paths`` is compiled whole on its first step (see
        ``saved_compile.Recorder``: saved to its path, or kept here for a path of None); returns
        the recorder, whose ``report`` a parallel compile's child prints."""
        self._recorder = saved_compile.Recorder(paths, self.options, on_compiled=on_compiled)
        return self._recorder

    def report(self) -> ForwardsReport:
        rec = self._recorder
        compiled = {v: f for v, f in rec.compiled.items() if v not in self._mismatched} if rec else {}
        return ForwardsReport(served=dict(self._served), saved={v: how for v, (_, how) in self._saved.items()},
                              mismatched=dict(self._mismatched), compiled=compiled,
                              errors=dict(rec.errors) if rec else {}, seconds=dict(rec.seconds) if rec else {})
