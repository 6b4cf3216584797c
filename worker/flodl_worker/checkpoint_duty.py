"""flodl_worker.checkpoint_duty: a rank's answer to ``Checkpoint{version, path, cycle}``.

``cycle`` names the weights to save: 0 = what the rank holds now (ShutdownWithSave);
c = the consensus of averaging cycle c. That one is saved right after it is applied
(the save is *armed* when the command comes first), or at once if c is the last
consensus the rank applied -- even after steps since: the rank *holds* the consensus
arrays of its last applied cycle (the machine's ``held``; one parameter-sized
copy, dropped when the next consensus lands) and saves those parameters and f32
buffers (when that round averaged buffers), with the model's other state (integer
buffers) and the optimizer's state as they are now. That is the
normal case: the coordinator asks after the round finished (its acks committed the
batches the meta covers), and under Cadence the rank trains on meanwhile. A cycle older
than the last applied one is no longer held: the answer is an error naming it, and the
coordinator fails over to another rank (and reports the checkpoint missing if no rank
holds it). The file is written atomically by ``flodl_worker.checkpoint``; the answer is
``timing.checkpoint_result{version, sha256}`` (or ``error``).

Which weights, and whether to save now, later or not at all, is the rank machine's
decision (``flodl.rank``: arming, holding, refusing by name); it says ``SaveCheckpoint``
and this module does the torch part: the state dict, the file, the answer.
"""

from __future__ import annotations

import logging
import os
import time

from flodl.fsutil import describe_write_error, no_space
from flodl.rank import SaveCheckpoint
from flodl.wire import pb

from .checkpoint import save_model_file
from .params import as_tensor

__all__ = ["CheckpointDuty"]

log = logging.getLogger("flodl.rank")


class CheckpointDuty:
    """Executes ``SaveCheckpoint`` for the rank shell ``rank`` (model, optimizer, ``m``)."""

    def __init__(self, rank) -> None:
        self.rank = rank

    def save(self, cmd: SaveCheckpoint) -> None:
        self._save(cmd.command, params=cmd.params)

    def _consensus_state(self, arrays: list) -> dict:
        """The model's state dict with its parameters (then f32 buffers, when ``arrays``
        has them) replaced by ``arrays`` (CPU copies)."""
        r = self.rank
        by_id = {id(t): a for t, a in zip(list(r.params) + list(r.buffers), arrays)}
        out = {}
        for k, v in r.model.state_dict(keep_vars=True).items():
            a = by_id.get(id(v))
            out[k] = v.detach() if a is None else as_tensor(a).to(dtype=v.dtype).reshape(v.shape).clone()
        return out

    def _save(self, m: pb.Control.Checkpoint, params: list | None = None) -> None:
        r = self.rank
        t0 = time.perf_counter()
        try:
            state = self._consensus_state(params) if params is not None else None
            digest = save_model_file(
                m.path, r.model, r.optimizer, version=m.version, cycle=m.cycle, rank=r.cfg.rank,
                global_step=r.m.global_step, local_step=r.m.local_step, model_state=state,
            )  # fmt: skip
        except Exception as e:  # disk full, permissions, a user state_dict that raises
            # A full disk is named as such (torch.save hides it behind "unexpected pos").
            why = describe_write_error(e, os.path.dirname(m.path), "checkpoint") if no_space(e) else None
            self._failed(m, why or f"{type(e).__name__}: {e}", t0)
            return
        elapsed = (time.perf_counter() - t0) * 1e3
        log.info("checkpoint v%d saved to %s in %.0f ms", m.version, m.path, elapsed)
        r._timing(
            checkpoint_result=pb.Timing.CheckpointResult(
                version=m.version, elapsed_ms=elapsed, sha256=digest, cycle=m.cycle
            )
        )

    def _failed(self, m: pb.Control.Checkpoint, error: str, t0: float) -> None:
        log.warning("checkpoint v%d not saved: %s", m.version, error)
        self.rank._timing(
            checkpoint_result=pb.Timing.CheckpointResult(
                version=m.version, elapsed_ms=(time.perf_counter() - t0) * 1e3, error=error, cycle=m.cycle
            )
        )
