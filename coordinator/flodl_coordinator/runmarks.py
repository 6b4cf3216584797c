"""The run's timeline: when it started training, committed nearly all of it, and ended.

The summary's ``timeline_s`` (seconds since this process started) has one entry per mark
reached, in this order::

    first_batch       the first batch any rank reported
    committed_99pct   99 % of the run's samples (every epoch) committed by a consensus
    last_batch        the last batch any rank reported
    epochs_done       the last epoch aggregated (every sample committed)
    shutdown          Shutdown sent to the ranks
    run_finished      every rank left (or the run failed or stopped)

``committed_99pct`` and ``last_batch`` come in either order (a healthy run trains its last
batch, then the last round commits it); the others follow them, in order. A healthy run
goes from the later of those two to ``run_finished`` in about one round and a round trip. A gap there is the run waiting on something -- the last window's tail, a slow
final round, ranks slow to leave -- and the marks either side of it say which.
"""

from __future__ import annotations

from typing import Any, Optional

__all__ = ["RunMarks", "MARKS", "COMMITTED_SHARE"]

MARKS = ("first_batch", "committed_99pct", "last_batch", "epochs_done", "shutdown", "run_finished")
COMMITTED_SHARE = 0.99


class RunMarks:
    """Marks in ``time.monotonic()`` seconds; ``born`` is the process start on that clock."""

    def __init__(self, born: float) -> None:
        self.born = born
        self.at: dict[str, float] = {}
        self.last_batch: Optional[float] = None  # kept apart: set on every batch frame (hot path)

    def batch(self, t: float) -> None:
        """A batch frame arrived (one or several batches)."""
        if self.last_batch is None:
            self.at["first_batch"] = t
        self.last_batch = t

    def mark(self, name: str, t: float) -> None:
        """The first time ``name`` happened (later ones do not move it)."""
        self.at.setdefault(name, t)

    def watch_commits(self, state: Any, t: float) -> None:
        """Per tick until reached: 99 % of the run's samples committed? O(epochs)."""
        if "committed_99pct" in self.at:
            return
        expected = state.total_samples * state.config.num_epochs
        if expected > 0 and sum(ec.unique for ec in state.coverage.epochs.values()) >= COMMITTED_SHARE * expected:
            self.at["committed_99pct"] = t

    def timeline(self) -> dict[str, float]:
        """``{mark: seconds since the process started}``, in ``MARKS`` order."""
        at = dict(self.at)
        if self.last_batch is not None:
            at["last_batch"] = self.last_batch
        return {k: round(at[k] - self.born, 3) for k in MARKS if k in at}

    def describe(self) -> str:
        """One line for the log: each mark and the gap since the one before it."""
        parts, prev = [], None
        for k, t in self.timeline().items():
            parts.append(f"{k} {t:.2f}s" + ("" if prev is None else f" ({t - prev:+.2f})"))
            prev = t
        return "timeline: " + ", ".join(parts) if parts else "timeline: no batch"
