"""When training must stop on its numbers: repeated non-finite steps, or a collapsed fp16 loss
scale. Read at each metrics read, never per step: the counts are device scalars."""
from __future__ import annotations

import torch

from tr_hydra.memory.regions import Region
from tr_hydra.runtime.guards import NonFiniteError

W_SPAN = (Region.W_BN_BIAS, Region.W_DEEP_CONV)  # the master weights


def check(pc, rt, step: int) -> None:
    """Raise ``NonFiniteError`` (``step``: the run's steps so far) where training must stop. The
    step that reaches ``trainer.max_nonfinite`` makes the device skip every step after it as
    well, so the run stops with the weights it had then, and the message says which step that
    was and how many were skipped after it."""
    ex = rt.ex
    bad, limit = int(ex.scalar("nonfinite")), max(pc.trainer.max_nonfinite, 1)
    reached, since = ex.nonfinite_limit_state() if not ex.fp16 else (False, 0)
    if reached or bad >= limit:
        steps = (f"{bad} step{'s' if bad != 1 else ''} with non-finite loss, gradients or "
                 f"BatchNorm statistics")
        if reached:
            at = step - since
            after = (f", and so {'were' if since != 1 else 'was'} the {since} "
                     f"step{'s' if since != 1 else ''} after it, up to this check at step {step} "
                     f"(trainer.log_every={pc.trainer.log_every})" if since else "")
            raise NonFiniteError(
                f"training stopped: {steps} reached trainer.max_nonfinite={pc.trainer.max_nonfinite} "
                f"at step {at} ({ex.nonfinite_report()}); {'they were' if bad != 1 else 'it was'} "
                f"skipped{after}: {state_note(rt.arena)}")
        raise NonFiniteError(f"training stopped at step {step}: {steps} so far in this run "
                             f"(trainer.max_nonfinite={pc.trainer.max_nonfinite}), "
                             f"{ex.nonfinite_report()}; those steps were skipped: {state_note(rt.arena)}")
    if ex.fp16 and ex.scalar("loss_scale") < 2.0 ** -14:
        raise NonFiniteError(f"training stopped: the fp16 loss scale collapsed to "
                             f"{ex.scalar('loss_scale'):.3g} after {int(ex.scalar('skipped'))} "
                             f"skipped steps ({ex.nonfinite_report()}); try amp_dtype=bf16 or a lower lr")


def state_note(arena) -> str:
    """What the arena holds at a stop on non-finite steps, read (once) rather than assumed."""
    w_ok = bool(torch.isfinite(arena.span(*W_SPAN)).all())
    b_ok = not arena.plan.region_size[Region.B_PREV_MEAN] or bool(
        torch.isfinite(arena.span(Region.B_PREV_MEAN, Region.B_PREV_VAR)).all())
    if w_ok and b_ok:
        return "no skipped step changed the weights or the BatchNorm statistics, which are finite"
    bad = " and ".join(n for n, ok in (("the weights", w_ok), ("the BatchNorm statistics", b_ok)) if not ok)
    return (f"no skipped step changed the weights or the BatchNorm statistics, but {bad} "
            f"hold non-finite values from steps taken before")
