"""The random streams a run trains with: PyTorch's default generators (the CPU one and the run's
CUDA device's), which dropout and stochastic depth draw from, eagerly, compiled by Inductor
(its ``inductor_seeds`` is a ``torch.randint`` on the default generator) and inside the captured
step alike. There is no generator of tr_hydra's own and no seed fixed at capture: a captured
graph reads the CUDA generator's seed and offset when it is replayed and advances the offset by
what its capture drew (PyTorch registers the default generator with every graph), so a replay
draws what the eager step would draw from the same state, and restoring the state (``set_state``
writes the seed and offset into the generator the graphs hold) steers the replays too.

Getting the variants ready draws from these generators: the warm-up steps run dropout eagerly,
cuDNN's algorithm search fills its probes with ``normal_`` (on a thread of its own while the
first variant compiles). How much is drawn depends on how startup went (the variants,
``runtime.warmup_steps``, whether the saved store held the compiles, whether cuDNN searched),
not on the training. So ``StartupDraws`` takes the state
before startup and puts it back once every graph is captured, as the arena is put back: a
fresh run's first step draws from the seed's stream right after the model's initialisation,
and a resumed run's first step from the checkpoint's state, which is the state the run that
never stopped had at that step. The other order (restoring a checkpoint only after the
capture) would make a resume right but leave a fresh run's masks depending on its startup
work, so that a rerun with a warm saved store, or another ``runtime.warmup_steps``, trained
with other masks.
"""
from __future__ import annotations

import torch


class StartupDraws:
    """The default generators' state, taken when made and put back (``put``): what runs
    in between draws nothing, as far as the training's stream is concerned."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cpu = torch.get_rng_state()
        cuda = device.type == "cuda" and torch.cuda.is_available()  # no driver: nothing to keep
        self.cuda = torch.cuda.get_rng_state(device) if cuda else None

    def put(self) -> None:
        """Back to the state taken (outside any capture: a generator's state cannot be set while
        a graph is being captured)."""
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state(self.cuda, self.device)
