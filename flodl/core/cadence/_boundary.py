"""Cadence across an epoch boundary: windows run on into the next epoch.

Theory of operation
-------------------
Behind an epoch barrier (what Cadence did first) a rank that finished its share of epoch
``e`` waits: for the others' last chunks of ``e``, for the round that commits them, for
``e`` to aggregate and only then for ``e + 1``'s ``StartEpoch``. When ElChe's windows grow
to most of an epoch (many unequal ranks: the fastest runs ``speed ratio x anchor``
batches) that wait is a large part of every epoch -- 6.5-10 % of the run on a
1,1,2,3,5,8 rig. So Cadence streams the boundary, as Async streams every epoch
(``_async``), but keeps its own windows:

* **A window is counted in steps, not in epochs.** A rank whose chunk of ``e`` was the
  last one ``e`` had (its window not run out) is handed the rest of its window from
  ``e + 1``, which is opened on the spot (``_async._open``: coverage, ledgers, a pool
  with reservation spans from the current counts, ``Notice("epoch_opened")``). The reduce
  barrier, the gate and the throttle read steps since the trigger exactly as before, so
  every rank still runs ``counts[r]`` batches per window and they reach the reduce
  together; only the epoch label of some of those batches changes.
* **Oldest epoch first.** Windows handed out at a trigger or in an ``Update`` draw from
  the oldest live epoch with work (a dead rank's reclaimed holes included), else from
  the next (``window_epoch``); an idle rank is woken the same way (``_async.wake``). A
  rank has one chunk in flight, so its batches of one epoch are all reported before it
  gets a chunk of another (``check_batch`` follows ``dispatch.rank_epoch``).
* **Coverage and aggregation do not change.** A position is committed when the round
  that folds its step finishes (``_coverage``, per epoch), and an epoch aggregates --
  in order, by ``_metrics`` -- once all its positions are committed, whatever else is in
  flight. ``_run`` finds the next epoch dispatched already and lets it run.
* **The last epoch still ends at a barrier.** Nothing takes over after it, so its last
  window keeps the final-window plan (``_chunk_pool.final_window_alloc``: no rank ends on
  a lone batch). Earlier epochs need none: their last window continues into the next.
  ``_dispatcher.ends_at_a_barrier`` is that rule.
* **Callback slack follows the callbacks.** ``EpochAggregated{e}`` (the epoch function),
  a boundary checkpoint and eval now reach the ranks while they train ``e + 1``: the
  slack is staged when ``e`` aggregates (``CadenceDispatcher.on_epoch_aggregated``), so
  the role rank's *current* window is the shorter one (upstream's regime, §10.8: its
  epochs also aggregate mid-window). A rank that already ran past the shortened count
  just reaches the gate; its chunk in flight is the start of its next window.

Checkpoints and resume are Async's: the save taken when ``e`` aggregates records the
committed ranges of ``e + 1``, which a resume dispatches only the holes of.
"""

from __future__ import annotations

from typing import Optional

from . import _async, _slack
from ._dispatcher import CadenceDispatcher, window_steps
from .._commands import Command
from .._phases import TRAINING
from .._state import CoordinatorState

__all__ = ["CADENCE", "BOUNDARY_STREAMS"]


class _BoundaryStreams:
    """Cadence's part of the composed dispatcher (``_dispatcher.EpochStreams``)."""

    def open_epoch(self, st: CoordinatorState, epoch: int, out: list[Command]) -> None:
        # ``advance`` reaches an epoch nobody streamed into (every rank sat at its reduce
        # barrier when the last one drained): open it and stage the slack behind it.
        _async._open(st, epoch, -1, out)
        _slack.stage(st, epoch, out)
        _async.wake(st, out)

    def wake(self, st: CoordinatorState, out: list[Command]) -> None:
        if st.run.phase is not TRAINING or st.dispatch.last_dispatched is None:
            return
        for r in st.alive_ranks():
            if not leaves_the_tail(st, r):
                _async._dispatch_next(st, r, out)

    def round_epoch(self, st: CoordinatorState) -> Optional[int]:
        """The epoch a finished round is counted for: the oldest live one."""
        live = _async.live_epochs(st)
        return live[0] if live else st.dispatch.last_dispatched

    def window_epoch(self, st: CoordinatorState, out: list[Command]) -> Optional[int]:
        epoch = _async.source_epoch(st)
        cad = st.cadence
        if epoch is not None and cad is not None and epoch not in cad.pools:
            _async._open(st, epoch, -1, out)
        return epoch


def leaves_the_tail(st: CoordinatorState, rank: int) -> bool:
    """In the run's last window (a final-window plan is pinned), a rank that ran its
    share of it leaves what is left to a rank still training: that one asks when its
    chunk is done, and whoever asks first finishes first. Spans drift once windows
    straddle epochs, so takes can come back short and leave fragments; handed to the
    first idle rank -- often the slowest, whose share is smallest -- they would end the
    run one slow chunk late. The last rank training (a chunk in flight, not throttled:
    a throttled rank waits for the round this one may be holding up) always takes them,
    so nothing deadlocks."""
    cad = st.cadence
    if cad is None:
        return False
    plan = cad.final_plan
    if plan is None or rank in cad.in_flight or st.dispatch.rank_epoch.get(rank) != plan.epoch:
        return False
    if window_steps(st, rank) < plan.alloc[rank]:
        return False
    return any(r in cad.in_flight and r not in cad.throttled for r in st.alive_ranks() if r != rank)


BOUNDARY_STREAMS = _BoundaryStreams()
# Cadence: barrier-paced windows, the next window folded into the Update, and windows
# that run on across an epoch boundary (see the module doc).
CADENCE = CadenceDispatcher(streams=BOUNDARY_STREAMS)
