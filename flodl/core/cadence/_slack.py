"""Callback slack: room in a rank's window for the callback it runs (spec §10.5, §10.8).

Theory of operation
-------------------
Three callbacks each run on one rank: the user's epoch function on the epoch role, a
consensus checkpoint on the checkpoint role, a non-final eval on the eval role. While a
rank runs one it does not train, so a window sized from its pace alone would make
everyone else wait for it at the next reduce. Each kind's cost is smoothed with an EWMA
(``_roles.absorb_cost``; alpha 0.3, the first sample seeds it), fed by
``EpochFnElapsed``, ``CheckpointDone`` and ``EvalDone``. Before the window in which a
rank will pay for a callback, that cost is *staged* as slack: ElChe's next recompute
shortens the rank's count by ``ceil(slack_ms / ms_per_batch)`` batches (at least one
batch is left), bypassing the dead zone, and zeroes the slack -- it is consumed exactly
once (``ElChe.recompute_batch_counts``). The next recompute restores the count.

*Which* window differs from upstream on purpose. Upstream (§10.8) stages the slack at the
head before an epoch's last window: its epochs aggregate without waiting for a reduce,
so the window in which a rank crosses into the next epoch -- and fires its callbacks --
is that last window. Here an epoch aggregates only once every position is committed, so
it always ends on a round, and the callbacks run *between* epochs: the rank reads
``EpochAggregated`` / ``Checkpoint`` / ``ExecuteEval`` and only then the next epoch's
``StartEpoch`` (FIFO, ``_metrics`` -> ``_checkpointing`` -> ``_run`` -> dispatch). The
cost lands in the rank's *first* window of the next epoch, so that is the window we
shorten: Cadence's ``dispatch_epoch`` calls ``stage`` after the new pool exists (its
reservation spans stay proportional to pace) and before the first windows are sized.
Shortening the epoch's last window instead would only make the rank idle at the epoch
barrier and then pay the callback anyway.

The slack of epoch ``e``'s first window (``plan``), per rank, sums:

* the epoch-fn EWMA on the epoch role, when ``e - 1`` was aggregated in this run (the
  role runs its epoch function on ``EpochAggregated{e - 1}``);
* the checkpoint EWMA on the rank asked to save at this boundary (a pending save of the
  current ``version``: no round finished since it was asked);
* the eval EWMA on the rank asked to evaluate at this boundary (a pending non-final eval
  of epoch ``e - 1``).

Entries below ``max(5 % of the anchor's window wall, 100 ms)`` are dropped (noise
against a window; it also keeps the cut above ElChe's 5 % dead zone, so the next
recompute does restore the count). Nothing is staged without Cadence, before ElChe is
calibrated (no pace to convert ms into batches), or when nothing is left.
"""

from __future__ import annotations

import math
from typing import Optional

from .._commands import Command, Notice
from .._phases import ACTIVE
from .._state import CoordinatorState

__all__ = ["SLACK_FLOOR_MS", "SLACK_WALL_FRACTION", "threshold_ms", "plan", "stage"]

# A callback under 100 ms is noise against any real window: not worth a shorter one.
SLACK_FLOOR_MS = 100.0
# ... nor is one under 5 % of the anchor's window wall (ElChe's dead zone is 5 % too).
SLACK_WALL_FRACTION = 0.05


def threshold_ms(st: CoordinatorState) -> float:
    """The least slack worth staging: ``max(5 % x anchor wall, 100 ms)``."""
    return max(SLACK_WALL_FRACTION * st.cadence.elche.anchor_wall_ms(), SLACK_FLOOR_MS)


def _usable(ms: Optional[float]) -> bool:
    return ms is not None and math.isfinite(ms) and ms > 0.0


def plan(st: CoordinatorState, epoch: int) -> tuple[Optional[list[float]], str]:
    """Per-rank slack (ms) for ``epoch``'s first window, or None; and why."""
    cad = st.cadence
    if cad is None:
        return None, "no ElChe windows (not Cadence)"
    el = cad.elche
    if not el.calibrated:
        return None, "ElChe not calibrated: no pace to size slack with"
    ro, ws = st.roles, len(st.ranks)
    slack = [0.0] * ws

    def add(rank: Optional[int], ms: Optional[float]) -> None:
        if rank is not None and 0 <= rank < ws and st.ranks[rank].phase is ACTIVE and _usable(ms):
            slack[rank] += ms

    if epoch > 0 and st.metrics.last_aggregated == epoch - 1:
        add(ro.epoch_role, ro.epoch_fn_ewma_ms)
    version = st.rounds.version
    pending = st.checkpoints.pending.get(version)
    if pending is not None:
        add(pending[1][-1], ro.checkpoint_ewma_ms)
    for ev_epoch, rank in ro.pending_evals.values():
        if ev_epoch == epoch - 1:
            add(rank, ro.eval_ewma_ms)
    floor = threshold_ms(st)
    slack = [s if s >= floor else 0.0 for s in slack]
    if not any(slack):
        return None, f"no callback cost >= {floor:g} ms before epoch {epoch}"
    return slack, f"callback slack before epoch {epoch} (threshold {floor:g} ms)"


def stage(st: CoordinatorState, epoch: int, out: list[Command]) -> bool:
    """Apply ``plan`` to ElChe now (consumed by this recompute); True if anything moved
    into the counts. One ``Notice("callback_slack")`` says what and why."""
    slack, why = plan(st, epoch)
    if slack is None:
        return False
    el = st.cadence.elche
    slow = el.slow_ms()
    if slow <= 0.0:
        return False
    before = list(el.batch_counts)
    el.apply_callback_slack(slack)
    el.live = st.alive_mask()  # (the window cap counts these)
    el.recompute_batch_counts(slow)
    out.append(
        Notice(
            "callback_slack",
            {"epoch": epoch, "slack_ms": slack, "counts_before": before, "counts": list(el.batch_counts), "reason": why},
        )
    )
    return True
