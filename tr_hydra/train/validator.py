"""Validation of the weights as they stand: the live ones, and with ``ema`` the EMA ones too,
BatchNorm folded into a per-channel affine where the plan says so (``plan.bn_folded``)."""
from __future__ import annotations

from tr_hydra.config.plan_config import PlanConfig
from tr_hydra.config.epochs import val_schedule


class Validator:
    """Runs ``pc``'s validation steps on the runtime ``rt`` (every rank: the BN statistics and
    the metrics are averaged and summed over the ranks)."""

    def __init__(self, pc: PlanConfig, rt):
        self.pc, self.rt = pc, rt

    def validate(self) -> dict[str, dict]:
        """``{"val": metrics}``, and ``"val_ema"`` with ``ema``; each the ``read_metrics`` of the
        executor (mean loss, top1, top5, sample count)."""
        pc, rt, ex = self.pc, self.rt, self.rt.ex
        steps = val_schedule(pc)
        ex.sync_bn_stats()
        ex.before_validation()  # (bn_folded: the affine folded from the live statistics)
        rt.validation(steps)
        out = {"val": ex.read_metrics("val")}
        if pc.ema:
            with ex.ema_weights():
                if pc.bn_folded:
                    ex.before_validation()  # the affine folded from the EMA weights and statistics
                rt.validation(steps)
            if pc.bn_folded:
                ex.before_validation()  # back to the live statistics' fold
            ex.move_metrics("val", "val_ema")
            out["val_ema"] = ex.read_metrics("val_ema")
        return out
