"""flodl_worker.run_progress: the run's progress on a rank, and LR schedules that follow it.

A rank's own step counter is the wrong clock for a scheduler: under Cadence or Async a
fast rank takes three times the steps of a slow one, so a per-step cosine counted
locally ends at three different learning rates. The run's clock is the coordinator's:
every averaging round's ``Update`` carries ``global_step`` and ``samples_committed``
(the cohort's optimizer steps folded so far, and the samples committed in the coverage
ledger, every epoch summed). Between rounds a rank adds its own unfolded work, the
reference's ``global_step + steps_since_avg``; the estimate never moves backwards.
After the final average every rank holds ``samples == total_samples``: ``fraction``
is 1.0 everywhere, so a schedule of the fraction ends at the same LR on every rank.

``run_rank(..., lr_schedule=fn)`` calls ``fn(progress) -> lr`` before every step and
again whenever the coordinator's progress arrives, and sets that LR on every parameter
group; the LR each step used is reported in ``Timing.Batch.lr`` (the reference's
``LrUpdate``: the coordinator's LR meta-controller reads it). ``flodl_worker.progress()``
returns the same ``Progress`` from anywhere inside the rank (a ``step_fn`` or a
scheduler of the user's own).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional, TextIO

__all__ = ["Progress", "progress", "ProgressClock", "LrScheduleError"]


@dataclass(frozen=True, slots=True)
class Progress:
    """Where the whole run is (not this rank)."""

    global_step: int  # the cohort's optimizer steps folded into the consensus, + this rank's since
    samples: int  # samples committed run-wide, + this rank's unfolded ones
    total_samples: int  # the run's samples: the dataset's total_samples x num_epochs
    epoch: float  # samples / total_samples per epoch: 2.5 = half way through the third epoch
    fraction: float  # samples / total_samples, in [0, 1]


class LrScheduleError(Exception):
    """``lr_schedule`` returned something that is not a finite LR >= 0."""


_current: Optional[Progress] = None


def progress() -> Progress:
    """The run's progress as this rank knows it now (inside ``run_rank``, once admitted)."""
    if _current is None:
        raise RuntimeError(
            "flodl_worker.progress() is only known inside run_rank once the coordinator admitted the rank"
        )
    return _current


class ProgressClock:
    """Computes ``Progress`` from the rank machine and applies ``schedule`` to the optimizer.

    ``machine``: ``flodl.rank.RankMachine`` (``spec``, ``global_step``,
    ``samples_committed``, ``steps_since_avg``, ``unfolded``, ``folded_step``);
    ``optimizer``: a callable returning the optimizer (built after admission); ``trace``:
    an open file getting ``global_step samples fraction lr`` for every LR set (tests audit
    it), or None.
    """

    def __init__(self, machine, optimizer: Callable[[], object], schedule=None, trace: TextIO | None = None):
        self.m = machine
        self.optimizer = optimizer
        self.schedule = schedule
        self.trace = trace
        self._steps = 0
        self._samples = 0
        self.lr: float | None = None

    def now(self) -> Progress:
        m = self.m
        per_epoch = max(int(m.spec.total_samples), 1)
        total = per_epoch * max(int(m.spec.num_epochs), 1)
        mine = sum(b.samples for b in m.unfolded if b.step_count > m.folded_step)
        # Never backwards: a consensus folds this rank's samples a moment before the
        # coordinator's count of them arrives.
        self._samples = max(self._samples, min(total, m.samples_committed + mine))
        self._steps = max(self._steps, m.global_step + m.steps_since_avg)
        return Progress(self._steps, self._samples, total, self._samples / per_epoch, self._samples / total)

    def tick(self) -> None:
        """Publish the progress and, with a schedule, set the LR it gives."""
        global _current
        p = _current = self.now()
        if self.schedule is None:
            return
        lr = self.schedule(p)
        try:
            lr = float(lr)
        except (TypeError, ValueError):
            raise LrScheduleError(f"lr_schedule returned {lr!r} at {p}: it must return a float LR") from None
        if not (math.isfinite(lr) and lr >= 0):
            raise LrScheduleError(f"lr_schedule returned {lr} at {p}: an LR must be finite and >= 0")
        if lr == self.lr:
            return
        for g in getattr(self.optimizer(), "param_groups", ()):
            g["lr"] = lr
        self.lr = lr
        if self.trace is not None:
            self.trace.write(f"{p.global_step} {p.samples} {p.fraction:.6f} {lr!r}\n")
            self.trace.flush()
