"""The run's checkpoints and final weights, on every rank of the run: each call is a collective
(every rank makes it at the same point), and only rank 0 reads the run dir's choice or writes.

``save`` gathers every rank's input state, rank 0 writes the file (``checkpoint``'s format) and
prunes the old ones, and every rank raises the ``DiskError`` of a write that failed. ``resume``
picks the checkpoint (``resume=auto``: rank 0's newest valid one, broadcast; else the path
given), restores the arena, the source's augmentation state and the host's tallies, and says
where the run goes on. ``save_final`` checks that the ranks ended with the same weights and
writes ``model_final.pt``."""
from __future__ import annotations

from pathlib import Path

import torch

from tr_hydra.config.plan_config import PlanConfig, resume_choice
from tr_hydra.errors import DiskError
from tr_hydra.files import jsonable, make_dir
from tr_hydra.runtime.distributed import all_gather, broadcast, weights_agree
from tr_hydra.config.epochs import steps_before
from tr_hydra.train import checkpoint as ck
from tr_hydra.train import health, tally


class Checkpointer:
    """Checkpoints of ``pc``'s run in ``run_dir`` over the runtime ``rt``; ``tallies``: the
    host's counts, which a checkpoint carries and a resume restores."""

    def __init__(self, pc: PlanConfig, rt, run_dir: Path, tallies: tally.Tallies):
        self.pc, self.rt, self.run_dir, self.tallies = pc, rt, Path(run_dir), tallies

    # ------------------------------------------------------------------ resume
    def resume(self) -> tuple[int, int, list]:
        """(epoch, step, history) the run starts from; restores the arena when resuming."""
        pc, rt = self.pc, self.rt
        path = self._chosen()
        if path is None:
            return 0, 0, []
        state = ck.load(path)
        ck.check_compatible(state, rt.arena, pc.fingerprint(), pc.describe(), path)
        ck.restore(state, rt.arena)
        data = (state.get("extra") or {}).get("data")
        if data and len(data) == rt.dist.world_size and hasattr(rt.source, "restore"):
            rt.source.restore(data[rt.dist.rank])  # the input's augmentation state, per rank
        step = int(state["position"]["step"])
        epoch = 0
        while epoch < pc.trainer.epochs and steps_before(pc, epoch + 1) <= step:
            epoch += 1
        before, self.tallies.run_before = tally.from_extra(state["extra"])
        if before is not None and before.epoch == epoch - 1:
            epoch -= 1  # stopped after the epoch's last step, before its record: that record is next
        if before is not None and (before.epoch, before.step) != (epoch, step):
            before = None  # (not the epoch this resume goes on with)
        self.tallies.epoch_before = before
        rt.log(f"resumed from {path} at epoch {epoch + 1}, step {step}")
        return epoch, step, list(state["history"])

    def _chosen(self) -> Path | None:
        """The checkpoint to resume from; None to start afresh."""
        pc, rt = self.pc, self.rt
        if resume_choice(pc.resume) is None:  # a PlanConfig built in Python may spell it "none"
            return None
        if pc.resume != "auto":
            return Path(pc.resume)
        # rank 0 picks the checkpoint; every rank loads that same file (or stops with it, when
        # every checkpoint there is corrupt)
        found, why = None, None
        if rt.is_main:
            try:
                found = ck.newest_valid(self.run_dir, log=rt.log)
            except ck.CheckpointError as e:
                why = str(e)
        path, why = broadcast(rt.dist, (str(found) if found else None, why))
        if why is not None:
            raise ck.CheckpointError(why)
        if path is None:
            rt.log(f"resume=auto: no checkpoint in {self.run_dir / 'checkpoints'}; starting fresh")
            return None
        return Path(path)

    # ------------------------------------------------------------------ save
    def save(self, epoch: int, step: int, history: list) -> Path | None:
        """A checkpoint at ``step`` (``epoch``: the epochs completed); its path on rank 0, None
        on the others."""
        pc, rt = self.pc, self.rt
        rt.ex.sync_bn_stats()  # every rank: the collective needs them all
        # every rank's input state (where its train stream stands, its augmentation generators)
        data = all_gather(rt.dist, self._input_state())
        d = self.run_dir / "checkpoints"
        path, why = None, None
        if rt.is_main:
            try:
                make_dir(d, "checkpoint")
                path = ck.save(d / f"ckpt_e{epoch:04d}_s{step:08d}.pt", rt.arena,
                               position=ck.Position(epoch, step), fingerprint=pc.fingerprint(),
                               config=jsonable(pc.to_dict()), describe=pc.describe(),
                               history=jsonable(history),
                               extra=self.tallies.extra(step) | ({"data": data} if any(data) else {}))
                ck.prune(self.run_dir, pc.trainer.keep_checkpoints)
            except DiskError as e:
                why = str(e)
        why = broadcast(rt.dist, why)  # (every rank waits here for rank 0's write)
        if why is not None:
            raise DiskError(why)
        return path

    def _input_state(self):
        """The source's state for a checkpoint; a source that cannot give it (a pipeline broken by
        the error that stops the run) must not cost the checkpoint itself."""
        source = self.rt.source
        if not hasattr(source, "state"):
            return None
        try:
            return source.state()
        except Exception as e:  # noqa: BLE001 - the checkpoint matters more
            self.rt.log(f"checkpoint: the input state is not saved "
                        f"({str(e).splitlines()[0] if str(e) else type(e).__name__}); "
                        f"a run resumed from it draws fresh crops")
            return None

    # ------------------------------------------------------------------ final weights
    def final_state_dict(self) -> dict[str, torch.Tensor]:
        """The model's weights and BN statistics as they stand, as a ``state_dict``."""
        rt = self.rt
        return rt.arena.state_dict_from_arena(rt.model, int(rt.ex.scalar("step_count")))

    def save_final(self) -> Path:
        """``model_final.pt``, once every rank holds the same weights."""
        rt = self.rt
        if not weights_agree(rt.dist, rt.arena.span(*health.W_SPAN)):
            raise RuntimeError("data parallel: the ranks ended with different weights")
        if self.pc.world_size > 1:
            rt.log(f"weights identical on all {self.pc.world_size} ranks")
        rt.ex.sync_bn_stats()
        path = self.run_dir / "model_final.pt"
        if rt.is_main:
            make_dir(self.run_dir, "weights")
            ck.atomic_save(self.final_state_dict(), path, what="weights")
        return path
