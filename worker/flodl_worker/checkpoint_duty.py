"""flodl_worker.checkpoint_duty: a rank's answer to ``Checkpoint{version, path, cycle}``.

``cycle`` names the weights to save: 0 = what the rank holds now (ShutdownWithSave);
c = the consensus of averaging cycle c. That one is saved right after it is applied
(the save is *armed* when the command comes first), at once if the rank applied it and
has not stepped since, else the answer is an error and the coordinator fails over to
another rank. The file is written atomically by ``flodl_worker.checkpoint``; the answer
is ``timing.checkpoint_result{version, sha256}`` (or ``error``).
"""

from __future__ import annotations

import logging
import time

from flodl.wire import pb

from .checkpoint import save_model_file

__all__ = ["CheckpointDuty"]

log = logging.getLogger("flodl.rank")


class CheckpointDuty:
    def __init__(self, rank) -> None:
        self.rank = rank
        # The last consensus applied and the local step count right after it.
        self.applied_cycle = 0
        self.applied_at_step = 0
        self.armed: dict[int, pb.Control.Checkpoint] = {}  # cycle -> command, saved on apply

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
        for c in sorted(k for k in self.armed if k <= cycle):
            m = self.armed.pop(c)
            if c == cycle:
                self._save(m)
            else:
                self._failed(m, f"the consensus of cycle {c} never reached this rank")

    def _save(self, m: pb.Control.Checkpoint) -> None:
        r = self.rank
        t0 = time.perf_counter()
        try:
            digest = save_model_file(
                m.path, r.model, r.optimizer, version=m.version, cycle=m.cycle, rank=r.cfg.rank,
                global_step=r.global_step, local_step=r.local_step,
            )  # fmt: skip
        except Exception as e:  # disk full, permissions, a user state_dict that raises
            self._failed(m, f"{type(e).__name__}: {e}", t0)
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
