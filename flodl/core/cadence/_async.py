"""Async policy (bus plane): Cadence windows with a bounded overshoot, streaming across epochs.

Theory of operation
-------------------
Async is Cadence (``cadence._dispatcher``) with two barriers relaxed (spec §2.1, §3.9, §4.4-4.5,
§5.6); the rank blends the consensus elastically instead of overwriting
(``flodl_worker.averaging``: EASGD ``theta <- theta + alpha (consensus - theta)`` when
``RunSpec.policy`` is Async and ``0 < easgd_alpha < 1``; ``easgd_alpha`` defaults to 0.5).
Everything else -- ElChe calibration and feedback (``_feedback``), the chunk pools and
their reservation spans, the firing gate, deaths -- is Cadence's, which is why ``ASYNC``
is the one :class:`~flodl.core.cadence._dispatcher.CadenceDispatcher`, composed with
this module's epoch streaming (``STREAMS``) and the policy's switches, and not a second
engine: the Cadence helpers read the switches for the two things that differ, so they
behave as Async here:

* **Reduce barrier** (``_overshoot.reduce_step_budget``): a rank may run
  ``counts[r] + max_overshoot`` steps past the last trigger (Cadence: ``counts[r]``);
  the look-ahead starts at 3 and moves with the guard's verdicts (Stable widens it by
  one up to 15, NudgeDown resets it, ``OvershootBudget``); while ElChe is uncalibrated
  it is at least two of the slowest batch yet seen, at the rank's pace
  (``_dispatcher._probe_look``). Only there is a rank held:
  never by a ``Throttle`` at a trigger (the policy is progressive), never to wait for
  a round to finish, never at an epoch end.
* **Chunk sizing** (``_chunk_pool.compute_chunk_batches`` with ``barrier_paced=False``):
  no final-window plan; an uncalibrated probe chunk, then a chunk proportional to the
  rank's share of what is left, floored at 4 batches, always capped to what is left of
  its budget -- so a chunk never crosses the reduce barrier. With less than a window
  left, a rank takes its window of what is left (the rest streams on into the next
  epoch), except in the run's last pool: there its share by count, rounded up, so the
  ranks end together instead of the first to ask holding the end (``_chunk_pool._share``).

The gate is Cadence's (every alive rank ran its window ``counts[r]`` since the last
trigger, or is throttled, or has no work left; no round open): the fast rank does not
wait for it, it keeps training into its overshoot while the slow rank finishes, and the
round overlaps the next window as under Cadence (at the trigger every idle rank gets its
next chunk, as a ``StartEpoch`` sent before its ``RequestParams``). Async does not fold
the next chunk into the ``Update`` (spec §5.4: atomic dispatch is Cadence's): nobody
waits for the ``Update``, so there is nothing to save.

**Streaming across epochs** (spec §2.1 "epochs are data-coverage labels, not sync
events", §4.5). An idle rank (nothing in flight, not at its reduce barrier, not
throttled) draws its next chunk from the *oldest* live epoch with work left -- a dead
rank's reclaimed holes in an older epoch go first -- and, when every live epoch is
handed out, from the next epoch, which it opens on the spot (``_open``: coverage,
ledgers and a pool with reservation spans from the current counts, a
``Notice("epoch_opened")``). Coverage stays exactly once per epoch because nothing about
commits changes: a position is committed when the round that folds its step finishes
(``_coverage``), and an epoch is aggregated -- in order, by ``_metrics`` -- only once
every one of its positions is committed; several epochs may be live at once, each with
its own pool and bitmap. A rank's current epoch (``dispatch.rank_epoch``) follows the
chunk it was last given, and may go back to an older epoch for a reclaimed hole; its
batches are checked against it as ever (a rank has one chunk in flight, so its batches
of one epoch are all reported before it is given another). ``_run.advance`` still
dispatches the run's first epoch (0, or the resumed one) through Cadence's
``dispatch_epoch``; later epochs are normally opened by streaming, so it finds them
dispatched already -- and if it does reach one, it is opened the same way (``_open``
then the wake), never by handing every rank a window past its reduce barrier.

Wake rule (why nothing deadlocks): after every batch, trigger, finished round and death
every alive rank that is idle is offered a chunk from the oldest epoch with work, else
from a new epoch (while ``num_epochs`` is not reached). A rank is therefore idle only at
its reduce barrier (its steps >= its count: it cannot block the gate, and the trigger
releases it) or when no epoch has work left (quiesced: it cannot block the gate either).

The round's exposed cost fed to ElChe (``CadenceState.barrier_at``) is Cadence's on
purpose: the moment every rank has run its window while the round is still open. A
rank is not idle yet then (it runs its look-ahead), but rounds slower than a window
leave the fastest rank -- whose look-ahead is the shortest in time -- waiting at its
budget, so the anchor should grow until a window hides the round, exactly as under
Cadence. (Measuring only the time when *no* rank can train was tried: it never grows
the anchor while the fast rank alone waits, and lost in the simulator.)

What is not done here (on purpose): callback slack is not staged for an epoch opened by
streaming (the callbacks of ``EpochAggregated`` land mid-window; Cadence's staging
assumes an epoch barrier). Checkpoints work as they are: the one taken when epoch ``e``
aggregates records the committed ranges of every epoch already streamed into (``e + 1``,
and ``e + 2`` when ``e + 1`` drained before ``e`` aggregated: epochs shorter than two
windows), which a resume dispatches only the holes of (``_checkpointing.apply_resume``).
"""

from __future__ import annotations

from typing import Optional

from .. import _coverage, _dispatch
from ._dispatcher import (
    CadenceDispatcher,
    _budget,
    _held,
    extend_in_window,
    live_epochs,
    new_pool,
    offer_chunk,
    source_epoch,
    top_up_pace,
    window_steps,
)
from ._views import absorb_released, drop_wake, rearm
from .._commands import Command, Notice
from .._phases import TRAINING
from .._state import CoordinatorState

__all__ = ["ASYNC", "STREAMS", "wake"]


def _open(st: CoordinatorState, epoch: int, rank: int, out: list[Command]) -> None:
    """Open ``epoch`` for streaming: what Cadence's ``dispatch_epoch`` sets up, minus the
    epoch barrier (no rank is moved, no window is started, older live epochs stay)."""
    cad, d = st.cadence, st.dispatch
    total = _dispatch.epoch_samples(st.total_samples, 1, epoch)
    _dispatch.announce_role(st, out)
    _coverage.open_epoch(st.coverage, epoch, total)
    d.assigned.setdefault(epoch, {})
    d.reported.setdefault(epoch, {})
    d.last_dispatched = epoch
    d.dispatched_at.setdefault(epoch, st.now)
    cad.elche.set_max_total_batches(total // st.config.batch_size)
    cov, current = st.coverage.epochs, {d.rank_epoch.get(r) for r in st.alive_ranks()}
    for old in [e for e in cad.pools if e in cov and cov[e].frozen and e not in current]:
        del cad.pools[old]  # aggregated, and nobody's current epoch any more
    cad.pools[epoch] = new_pool(st, epoch, total)
    rearm(st)  # a new epoch has work for whoever its predecessors had none for
    out.append(Notice("epoch_opened", {"epoch": epoch, "rank": rank, "live_epochs": live_epochs(st)}))


def _dispatch_next(st: CoordinatorState, rank: int, out: list[Command]) -> bool:
    """Give the idle rank its next chunk from ``source_epoch`` (see the module doc)."""
    if _held(st, rank) is not None:
        return False
    epoch = source_epoch(st)
    if epoch is None:
        return False
    if epoch not in st.cadence.pools:
        _open(st, epoch, rank, out)
    return offer_chunk(st, rank, epoch, st.cadence.pools[epoch], out)


def wake(st: CoordinatorState, out: list[Command]) -> None:
    """Offer every idle alive rank its next chunk (rank order: deterministic). Only the
    ranks in ``wakeable`` can take one (``_views``), and none while no epoch has work
    (``source_epoch`` is the same for every rank)."""
    if st.run.phase is not TRAINING or st.dispatch.last_dispatched is None:
        return
    cad = st.cadence
    assert cad is not None
    absorb_released(st)
    for r in sorted(cad.wakeable):
        if source_epoch(st) is None:
            return  # nobody could be given anything: they stay wakeable
        _dispatch_next(st, r, out)
        if _held(st, r) is not None:  # served (one chunk in flight) or held: out until released
            cad.wakeable.discard(r)
            drop_wake(cad, r)


class _Streams:
    """Async's part of the composed dispatcher (``_dispatcher.EpochStreams``)."""

    def open_epoch(self, st: CoordinatorState, epoch: int, out: list[Command]) -> None:
        # ``advance`` reaches a later epoch only when nobody streamed into it (every rank
        # was at its reduce barrier when the last epoch drained): open it like a stream,
        # so the barrier still holds whoever is at it.
        _open(st, epoch, -1, out)
        wake(st, out)

    def wake(self, st: CoordinatorState, out: list[Command]) -> None:
        wake(st, out)

    def round_epoch(self, st: CoordinatorState) -> Optional[int]:
        """The epoch a finished round is counted for: the oldest live one."""
        live = live_epochs(st)
        return live[0] if live else st.dispatch.last_dispatched

    def window_epoch(self, st: CoordinatorState, out: list[Command]) -> Optional[int]:
        return None  # a trigger only wakes: each idle rank is offered a chunk of its own

    def live_window_epoch(self, st: CoordinatorState) -> Optional[int]:
        return None

    def top_up(self, st: CoordinatorState, rank: int, unreported: int, out: list[Command]) -> None:
        """A rank about to run its chunk dry (``top_up_pace``) gets its next one now, as an
        extension, unless that chunk takes it to its reduce barrier (held there: the
        trigger's ``Update`` releases it). Asked for only once its chunk was done, every
        chunk cost it a turnaround with nothing to train (2-12 ms on a real 6-rank rig)."""
        cad = st.cadence
        if rank in cad.throttled or not top_up_pace(st, rank, unreported):
            return
        budget = _budget(st, rank)
        left = budget - window_steps(st, rank) - unreported if budget > 0 else 1  # (as ``offer_chunk``)
        if left > 0:
            extend_in_window(st, rank, left, out)


STREAMS = _Streams()
# Cadence with the overshoot budget and epoch streaming (see the module doc); the run's
# first (or resumed) epoch is dispatched as under Cadence.
ASYNC = CadenceDispatcher(barrier_paced=False, overshoot=True, atomic_dispatch=False, streams=STREAMS)
