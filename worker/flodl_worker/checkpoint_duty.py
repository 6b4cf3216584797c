"""flodl_worker.checkpoint_duty: a rank's answer to ``Checkpoint{version, path, cycle}``.

``cycle`` names the weights to save: 0 = what the rank holds now (ShutdownWithSave);
c = the consensus of averaging cycle c. That one is saved right after it is applied
(the save is *armed* when the command comes first), or at once if c is the last
consensus the rank applied -- even after steps since: the rank *holds* the consensus
arrays of its last applied cycle (``hold``, called by the averager; one parameter-sized
copy, dropped when the next consensus lands) and saves those parameters, with the
model's other state (buffers) and the optimizer's state as they are now. That is the
normal case: the coordinator asks after the round finished (its acks committed the
batches the meta covers), and under Cadence the rank trains on meanwhile. A cycle older
than the last applied one is no longer held: the answer is an error naming it, and the
coordinator fails over to another rank (and reports the checkpoint missing if no rank
holds it). The file is written atomically by ``flodl_worker.checkpoint``; the answer is
``timing.checkpoint_result{version, sha256}`` (or ``error``).
"""

from __future__ import annotations

import logging
import os
import time

from flodl.fsutil import describe_write_error, no_space
from flodl.wire import pb

from .checkpoint import save_model_file
from .params import as_tensor

__all__ = ["CheckpointDuty"]

log = logging.getLogger("flodl.rank")


class CheckpointDuty:
    def __init__(self, rank) -> None:
        self.rank = rank
        # The last consensus applied and the local step count right after it.
        self.applied_cycle = 0
        self.applied_at_step = 0
        self.armed: dict[int, pb.Control.Checkpoint] = {}  # cycle -> command, saved on apply
        self.held: tuple[int, list] | None = None  # (cycle, consensus arrays) of the last applied round

    def hold(self, cycle: int, arrays: list | None) -> None:
        """The averager applied ``arrays`` as the consensus of ``cycle`` (None: this
        rank's weights are not in a consensus; it kept its own, nothing to hold)."""
        self.held = (cycle, list(arrays)) if arrays is not None else None

    def on_command(self, m: pb.Control.Checkpoint) -> None:
        r = self.rank
        if not m.path:
            self._failed(m, "no path in the Checkpoint command (the coordinator has no checkpoint_dir)")
        elif m.cycle == 0:
            self._save(m)
        elif m.cycle > self.applied_cycle:
            armed = pb.Control.Checkpoint()
            armed.CopyFrom(m)
            self.armed[m.cycle] = armed
        elif m.cycle == self.applied_cycle and self.held is not None and self.held[0] == m.cycle:
            self._save(m, params=self.held[1])
        elif m.cycle == self.applied_cycle and r.local_step == self.applied_at_step:
            self._save(m)
        else:
            moved = r.local_step - self.applied_at_step
            self._failed(
                m,
                f"the consensus of cycle {m.cycle} is no longer held (last applied cycle "
                f"{self.applied_cycle}, {moved} step(s) since)",
            )

    def after_consensus(self, cycle: int) -> None:
        """The consensus of ``cycle`` was just applied: save what was armed for it."""
        self.applied_cycle, self.applied_at_step = cycle, self.rank.local_step
        if self.held is not None and self.held[0] != cycle:
            self.held = None  # an older round's consensus: no longer what this rank holds
        for c in sorted(k for k in self.armed if k <= cycle):
            m = self.armed.pop(c)
            if c == cycle:
                self._save(m, params=self.held[1] if self.held is not None else None)
            else:
                self._failed(m, f"the consensus of cycle {c} never reached this rank")

    def _consensus_state(self, arrays: list) -> dict:
        """The model's state dict with its parameters replaced by ``arrays`` (CPU copies)."""
        r = self.rank
        by_id = {id(p): a for p, a in zip(r.params, arrays)}
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
                global_step=r.global_step, local_step=r.local_step, model_state=state,
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

    def _failed(self, m: pb.Control.Checkpoint, error: str, t0: float | None = None) -> None:
        log.warning("checkpoint v%d not saved: %s", m.version, error)
        elapsed = (time.perf_counter() - t0) * 1e3 if t0 is not None else 0.0
        self.rank._timing(
            checkpoint_result=pb.Timing.CheckpointResult(
                version=m.version, elapsed_ms=elapsed, error=error, cycle=m.cycle
            )
        )
