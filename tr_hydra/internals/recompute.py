"""``runtime.recompute``: what the compiled step keeps for the backward.

With Inductor, AOTAutograd's min-cut partitioner decides which forward values are saved for the
backward and which are recomputed there. Its default keeps the output of every BatchNorm+ReLU
(the next convolution's input, which its weight gradient reads) beside the convolution's own
output (which BatchNorm's backward reads). ``pointwise`` lifts three of the partitioner's bans
(values used far apart, long fusible chains, values the backward materialises), so every
pointwise result (BatchNorm's normalisation, ReLU, the residual add) is recomputed from the saved
convolution outputs in the backward: about 40% less activation memory for one more
read-and-write pass over those tensors per step. Convolutions, matrix products, pooling and
reductions are never recomputed (the allowlist and the reduction ban stay).
"""
from __future__ import annotations

MODES = ("none", "pointwise")

# The min-cut options the partitioner itself switches to first when it is given an activation
# memory budget below 1 (``more_aggressive_options`` in torch/_functorch/partitioners.py).
_OPTIONS = {
    "none": {},
    "pointwise": {"ban_recompute_used_far_apart": False,
                  "ban_recompute_long_fusible_chains": False,
                  "ban_recompute_materialized_backward": False},
}


def partitioner_options(mode: str) -> dict:
    if mode not in _OPTIONS:
        raise ValueError(f"runtime.recompute: {mode!r}; choose from {', '.join(MODES)}")
    return dict(_OPTIONS[mode])


def with_recompute(forward, mode: str):
    """``forward`` (a torch.compile'd module) called with the partitioner options of ``mode``
    in force: the compile happens inside the first call of each shape, so that is where the
    options must be set. ``none`` returns ``forward`` itself."""
    opts = partitioner_options(mode)
    if not opts:
        return forward
    from torch._functorch import config as fconfig
    missing = [k for k in opts if not hasattr(fconfig, k)]
    if missing:  # a PyTorch without these knobs: say so rather than silently saving everything
        raise RuntimeError(f"runtime.recompute={mode}: this PyTorch has no partitioner option {missing[0]}")

    def call(*args, **kwargs):
        with fconfig.patch(**opts):
            return forward(*args, **kwargs)
    call.recompute = mode
    call.compiled = forward
    return call


_compiled_with: list = []  # (recompute mode, Inductor options) of this process's last compile


def fresh_compile_for(mode: str, options: dict | None = None, codes=()) -> bool:
    """Before a model is compiled: drop Dynamo's compiled code for ``codes`` (the code objects
    the trainer compiles: the model's forward, the loss) if this process compiled them under
    another recompute mode or other Inductor options (``runtime.inductor_options``). Dynamo
    guards a compiled forward on the module's structure, not on the partitioner options, so a
    second trainer in one process (a sweep's next job, a bench mode) would otherwise run the
    first one's partition: ``pointwise`` after ``none`` then kept exactly
    as much as ``none``. Only those code objects are cleared: ``torch.compiler.reset()``, used
    when no ``codes`` are given, also drops every other compiled function of the process and
    resets ``torch.compile``'s CUDA graph trees under a reduce-overhead step built before (that
    step then compiled and recorded again, and one such process crashed). Returns
    whether it cleared."""
    key = (mode, tuple(sorted((options or {}).items())))
    changed = bool(_compiled_with) and _compiled_with[-1] != key
    if changed:
        if codes:
            drop_compiled(codes)
        else:
            import torch
            torch.compiler.reset()
    _compiled_with[:] = [key]
    return changed


def drop_compiled(codes) -> int:
    """Drop Dynamo's compiled entries for each code object of ``codes``, and for the resume
    functions Dynamo made from them at graph breaks, so that their next call compiles anew.
    Returns how many code objects were cleared."""
    from torch._dynamo.eval_frame import reset_code
    codes = [c for c in codes if c is not None]
    targets = set(codes)
    try:  # the code objects Dynamo has run (input_codes) and made (output_codes)
        from torch._dynamo import convert_frame
        seen = [w for book in (convert_frame.input_codes, convert_frame.output_codes)
                for w in getattr(book, "seen", [])]
    except ImportError:
        seen = []
    for weak in seen:
        c = weak() if callable(weak) else weak
        if c is not None and any(c.co_filename == t.co_filename
                                 and c.co_name.startswith(f"torch_dynamo_resume_in_{t.co_name}_at_")
                                 for t in codes):
            targets.add(c)
    for c in targets:
        reset_code(c)
    return len(targets)
