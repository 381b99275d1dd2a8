"""The step's ``torch.compile``: the options it gets and the compiled forward, through the gate.

Open, the forward is compiled with the graph pass that keeps 16-bit gradients in 16 bits
(``upcast_per_use``), ``runtime.recompute``'s partitioner options (``recompute``), and Dynamo's
compiled code for it dropped where this process compiled it before under other options. Closed
(see the package), it is plain ``torch.compile(model, dynamic=False, options=...)`` with the
user's ``runtime.inductor_options`` only.
"""
from __future__ import annotations

import torch

from tr_hydra import internals
from tr_hydra.internals import recompute

RECOMPILE_LIMIT = 64  # Dynamo's recompiles a forward may take: one per variant and mode


def inductor_map(runtime) -> dict:
    """The options the step's ``torch.compile`` gets: ``runtime.inductor_options``, with the gate
    open the graph pass that keeps 16-bit gradients in 16 bits, and with ``runtime.tuning=full``
    (as chosen) coordinate descent."""
    options = dict(runtime.inductor_options)
    if internals.is_open():
        from tr_hydra.internals.upcast_per_use import PASS
        options["post_grad_custom_post_pass"] = PASS
    if runtime.tuning == "full":
        options["coordinate_descent_tuning"] = True
    return options


def compile_forward(model: torch.nn.Module, runtime, codes=(), log=print):
    """``(forward, dropped)``: ``model`` under ``torch.compile`` (Inductor, static shapes) with
    ``inductor_map(runtime)`` and ``runtime.recompute``; ``dropped``: whether Dynamo's compiled
    code for ``codes`` (the code objects the step compiles) was dropped first, so that a compile
    will come. A closed gate says so here, once a process."""
    gate = internals.state()
    options = inductor_map(runtime)
    if not gate.open:
        internals.announce(log)
        if runtime.recompute != "none":
            log(f"runtime.recompute={runtime.recompute}: not applied with stock torch.compile; "
                f"every activation is kept")
        # Dynamo's compiled code dropped whole (PyTorch's public reset) where options changed
        dropped = recompute.fresh_compile_for(runtime.recompute, options)
        return torch.compile(model, dynamic=False, options=options), dropped
    import torch._dynamo as dynamo
    dynamo.config.recompile_limit = max(dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    dropped = recompute.fresh_compile_for(runtime.recompute, options, codes)
    forward = torch.compile(model, dynamic=False, options=options)
    if runtime.recompute != "none":
        forward = recompute.with_recompute(forward, runtime.recompute)
    return forward, dropped

