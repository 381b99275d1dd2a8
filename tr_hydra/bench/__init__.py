"""tr-bench: PyTorch's best practice and tr_hydra side by side (``tr_hydra.cli.bench`` is the
command). ``baselines``: PyTorch's steps and end-to-end pipelines; ``modes``: each step mode
built, warmed up and timed; ``epoch_mix``: a whole schedule of variants, optionally each mode in
a cold process; ``end_to_end``: a JPEG folder; ``report``: tables, profiles and the JSON.

``tr_runner(...)`` and ``pytorch_runner(...)`` give one mode's step to call from other code."""
from __future__ import annotations

from tr_hydra.bench.baselines import compile_as, pytorch_runner
from tr_hydra.bench.modes import tr_runner

__all__ = ["compile_as", "pytorch_runner", "tr_runner"]
