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
  rank's chunks in flight are of one epoch, so its batches of one epoch are all reported before it
  gets a chunk of another (``check_batch`` follows ``dispatch.rank_epoch``).
* **Coverage and aggregation do not change.** A position is committed when the round
  that folds its step finishes (``_coverage``, per epoch), and an epoch aggregates --
  in order, by ``_metrics`` -- once all its positions are committed, whatever else is in
  flight. ``_run`` finds the next epoch dispatched already and lets it run.
* **The last epoch still ends at a barrier.** Nothing takes over after it, so its last
  window keeps a final-window plan, split by time (``_chunk_pool.balance_last_window``:
  it ends as early as any split could, the batches a rank still holds counted; the
  reference's split by counts, with no lone batch, protects a next window's sizing that
  the run's last window does not have). Earlier epochs need none: their last window
  continues into the next. ``_dispatcher.ends_at_a_barrier`` is that rule.
* **Callback slack follows the callbacks.** ``EpochAggregated{e}`` (the epoch function),
  a boundary checkpoint and eval now reach the ranks while they train ``e + 1``: the
  slack is staged when ``e`` aggregates (``CadenceDispatcher.on_epoch_aggregated``), so
  the role rank's *current* window is the shorter one (upstream's regime, §10.8: its
  epochs also aggregate mid-window). A rank that already ran past the shortened count
  just reaches the gate; its chunk in flight is the start of its next window.

* **No wait at the reduce barrier either** (``run_ahead``, on by default; a round then
  folds up to two windows, so epochs shorter than that can aggregate at one consensus,
  each still with its own checkpoint of that one save, ``_checkpointing``). Integer windows
  never end together -- the probe window not at all -- so a rank that ran its window
  used to idle until the slowest ended its own. Now, while the gate still waits for a
  rank that is training (or for an open round), an idle rank at its barrier is handed
  more batches: as many as fit in the wait at its pace (``gate_wait_ms``, ElChe's smoothed
  paces; one batch while they are unknown), at most one more window in all, or two of
  the slowest batch yet seen when that is longer (``run_ahead_room``); a wait that
  outlasts what it ran ahead so far (the gate later than its wall) gets as much again.
  The chunk goes out before the rank runs dry: a report that leaves no more of a
  chunk than its next report and a turnaround extends that chunk (``top_up``) -- with
  the window's next chunk, or past the window's end with a run-ahead one. A batch
  reported before the trigger is one more step of this
  window (folded by the round, weighted by steps like any other); one reported after it
  is the next window's first (the mark moves to the last step reported): the gate, the
  sizing and the folding count them exactly as before. Once the run's last window is pinned,
  its plan splits all that is left (nothing more is run ahead); a chunk run ahead into
  it before the pin is work the plan counts as held. The split is by time over what each
  rank may run with run-ahead (``run_ahead_limit``), not over what its budget leaves it,
  and a rank's reduce barrier is where its share ends (``FinalWindowPlan.ends``): a fast
  rank that had run ahead into the last window would otherwise have no room there, and
  idle at its barrier while slower ranks trained the rest. In the run's last pool with no
  plan pinned (the ranks ran ahead past what the budgets would split), a rank takes its
  share of what is left by count (``_chunk_pool._share``), not a whole window.
* **The last window's fragments go to whoever is still training** (``leaves_the_tail``).

Checkpoints and resume are Async's: the save taken when ``e`` aggregates records the
committed ranges of every later epoch streamed into (all of one that aggregated at the
same consensus), which a resume dispatches only the holes of.
"""

from __future__ import annotations

from typing import Optional

from . import _async, _slack
from ._dispatcher import (
    CadenceDispatcher,
    _batches,
    _budget,
    _send_extensions,
    _send_plan,
    _take_window,
    extend_in_window,
    live_epochs,
    run_ahead_limit,
    source_epoch,
    top_up_pace,
    window_steps,
    windows_done,
)
from ._views import absorb_released, counts_changed, drop_wake, rearm
from .._commands import Command
from .._phases import ACTIVE, PENDING, TRAINING
from .._state import CadenceState, CoordinatorState

__all__ = ["CADENCE", "BOUNDARY_STREAMS"]


class _BoundaryStreams:
    """Cadence's part of the composed dispatcher (``_dispatcher.EpochStreams``)."""

    def open_epoch(self, st: CoordinatorState, epoch: int, out: list[Command]) -> None:
        # ``advance`` reaches an epoch nobody streamed into (every rank sat at its reduce
        # barrier when the last one drained): open it and stage the slack behind it.
        _async._open(st, epoch, -1, out)
        if _slack.stage(st, epoch, out):
            counts_changed(st)
            rearm(st, unpark=False)  # a count that rose may make a rank block the gate again
        self.wake(st, out)

    def wake(self, st: CoordinatorState, out: list[Command]) -> None:
        if st.run.phase is not TRAINING or st.dispatch.last_dispatched is None:
            return
        cad = st.cadence
        assert cad is not None
        absorb_released(st)
        parked: list[int] = []
        if cad.final_plan is not None and not training(cad):
            # The tail was left to a rank that trains no more: it is anyone's now. The
            # ranks parked for leaving it are looked at below, in order, only until one
            # trains again (from then on every one of them leaves it again: parked).
            rearm(st, unpark=False)
            parked = sorted(cad.parked)
        if source_epoch(st) is None:
            # No epoch has work and none is left to open: neither a chunk nor a run-ahead
            # can be handed to anyone (they stay wakeable). In the run's last epoch every
            # round rearms every rank, and every chunk's end wakes: no sort, no walk.
            return
        self._look(st, sorted(cad.wakeable), parked, out)

    def _look(self, st: CoordinatorState, woken: list[int], parked: list[int], out: list[Command]) -> None:
        """Look at ``woken`` and ``parked`` merged in rank order, as one walk over every
        rank of both would: each leaves ``wakeable``; one that leaves the tail is parked.
        A parked rank leaves the tail exactly while some rank trains (what else it
        depends on moves only with a rearm, which unparks it), so once one trains the
        rest of ``parked`` is skipped: the tail's wakes cost what they serve, not O(N)."""
        cad = st.cadence
        assert cad is not None
        in_flight = cad.in_flight
        busy = [r for r in woken if r in in_flight]
        if busy:
            # Held (a chunk in flight) whatever the others take, and never parked: each
            # would only leave the views, so they leave in bulk (after a window's start
            # that is every rank), as the flat wake does.
            cad.wakeable.difference_update(busy)
            cad.parked.difference_update(busy)
            cad.dropped_wake.update(busy)  # drop_wake
            woken = [r for r in woken if r not in in_flight]
        waiting: Optional[float] = None  # the ms until the gate can fire, worked out once
        i = j = 0
        while i < len(woken) or j < len(parked):
            if j < len(parked) and (i == len(woken) or parked[j] < woken[i]):
                r = parked[j]
                j += 1
                if r not in cad.parked:
                    continue  # woken since by another path (it is in ``woken``), or unparked
                if training(cad):
                    j = len(parked)  # every parked rank leaves the tail again: they stay parked
                    continue
                cad.parked.discard(r)
                if st.ranks[r].phase is not ACTIVE:
                    continue  # a rearm would not have put it back
            else:
                r = woken[i]
                i += 1
                cad.parked.discard(r)
            cad.wakeable.discard(r)
            if leaves_the_tail(st, r):
                cad.parked.add(r)
                continue
            drop_wake(cad, r)
            if _async._dispatch_next(st, r, out):
                continue
            if st.config.run_ahead and at_reduce_barrier(st, r):
                if waiting is None:
                    waiting = gate_wait_ms(st)
                if waiting != 0.0:  # -1: a wait of unknown length
                    run_ahead(st, r, waiting, out)

    def round_epoch(self, st: CoordinatorState) -> Optional[int]:
        """The epoch a finished round is counted for: the oldest live one."""
        live = live_epochs(st)
        return live[0] if live else st.dispatch.last_dispatched

    def window_epoch(self, st: CoordinatorState, out: list[Command]) -> Optional[int]:
        epoch = source_epoch(st)
        cad = st.cadence
        if epoch is not None and cad is not None and epoch not in cad.pools:
            _async._open(st, epoch, -1, out)
        return epoch

    def top_up(self, st: CoordinatorState, rank: int, unreported: int, out: list[Command]) -> None:
        top_up(st, rank, unreported, out)

    def live_window_epoch(self, st: CoordinatorState) -> Optional[int]:
        epoch = source_epoch(st)
        return epoch if st.cadence is not None and epoch in st.cadence.pools else None


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
    steps = max(0, st.ranks[rank].last_step - cad.window_mark.get(rank, 0))  # window_steps
    if plan.share_steps(rank, steps) < plan.alloc[rank]:
        return False
    return training(cad)  # the rank itself has nothing in flight


def training(cad: CadenceState) -> bool:
    """Whether a rank trains: a chunk in flight and not throttled. A wake asks it per rank
    it looks at, so it must not walk the throttled (hundreds of them under a tight
    ``max_batch_diff``: a 1,024-rank run spent 62 % of its core time here): more chunks in
    flight than throttled ranks settles it; else one C-level subset test over the chunks
    in flight, the fewer."""
    in_flight, throttled = cad.in_flight, cad.throttled
    if len(in_flight) > len(throttled):
        return True  # (one of them at least is not throttled; no throttle at all, as a rule)
    return not in_flight.keys() <= throttled


def at_reduce_barrier(st: CoordinatorState, rank: int) -> bool:
    """Idle at its reduce barrier: it ran its window and waits for the next trigger."""
    cad = st.cadence
    if cad is None or rank in cad.in_flight or rank in cad.throttled:
        return False
    budget = _budget(st, rank)
    return budget > 0 and window_steps(st, rank) >= budget and st.unfolded(rank) > 0


def run_ahead_room(st: CoordinatorState, rank: int) -> int:
    """Batches the rank may still run past its window before the trigger: up to one more
    window (``2 x max(budget, anchor)`` in all: the probe window's budget is 1), so a rank
    that hangs mid-window lets the others run at most a window ahead until it is declared
    dead -- and at least ``round_wait_batches`` past its budget (two of the slowest batch
    yet seen: the probe's windows are far shorter than a round's wait for them)."""
    assert st.cadence is not None
    return max(0, run_ahead_limit(st, rank) - window_steps(st, rank))


def gate_wait_ms(st: CoordinatorState) -> float:
    """How long the next trigger is still away: 0 when the gate could fire now, else what
    is left of the intended window wall (``anchor x slow ms`` since the last trigger), or
    -1 when that is unknown or already past (uncalibrated, a straggler, an open round):
    some wait, of unknown length. O(1) amortised: the gate's own heap says whether
    anyone still holds it, ElChe's anchor wall how long a window is meant to last."""
    open_round = st.rounds.phase is PENDING
    if not open_round and windows_done(st)[0]:
        return 0.0  # nobody the gate waits for: the trigger is due now
    cad = st.cadence
    assert cad is not None
    wall = cad.elche.anchor_wall_ms()
    left = st.rounds.opened_at * 1e3 + wall - st.now * 1e3 if wall > 0.0 else 0.0
    return left if left > 0.0 else -1.0


def run_ahead(st: CoordinatorState, rank: int, waiting_ms: float, out: list[Command]) -> bool:
    """Fill a wait at the reduce barrier: hand the rank more batches now, as many as fit
    in ``waiting_ms`` at its pace (one when the wait or the pace is unknown), within
    ``run_ahead_room``. Nothing is lost or counted twice: a batch reported before the
    trigger is one more step of this window (folded by the round, its weight counted in
    steps), one reported after it is the next window's first (the mark moves to the
    last step reported). The rank trains instead of idling at the barrier."""
    return _run_ahead(st, rank, waiting_ms, 0, out)


def top_up(st: CoordinatorState, rank: int, unreported: int, out: list[Command]) -> bool:
    """More work before the rank runs dry, once it is due (``top_up_pace``: the
    ``unreported`` batches of its chunk in flight last no longer than its next report and
    a turnaround): the window's next chunk when the chunk ends inside its window
    (``_dispatcher.extend_in_window``, ``run_ahead`` or not); a run-ahead
    chunk when it ends the window: what fills the gate's wait from then, and at least what
    covers the rank's turnaround when the trigger is due first (by the window's intended
    wall: a trigger later than that found the rank dry, a turnaround idle at every
    window's end, ``tests/unit/core/test_plan_wait.py``). It goes out
    as an extension of the chunk the rank trains; handed out once it had run dry (its
    last report, the plan back), every chunk cost the rank a turnaround with nothing to
    train -- at 256 ranks 2-3 such waits of 7-20 ms a window."""
    cad = st.cadence
    assert cad is not None
    if rank in cad.throttled or cad.final_plan is not None:
        return False
    budget = _budget(st, rank)
    if budget <= 0:
        return False
    ms = top_up_pace(st, rank, unreported)
    if not ms:
        return False  # not due yet: a later report is still in time
    ahead = window_steps(st, rank) + unreported
    if ahead < budget:
        return extend_in_window(st, rank, budget - ahead, out)
    if not st.config.run_ahead:
        return False  # it waits at its reduce barrier
    waiting = gate_wait_ms(st)
    if waiting >= 0.0:
        waiting = max(0.0, waiting - unreported * ms)  # from the chunk's end
    return _run_ahead(st, rank, waiting, unreported, out, extend_epoch=cad.in_flight[rank][0])


def _run_ahead(st: CoordinatorState, rank: int, waiting_ms: float, pending: int, out: list[Command],
               extend_epoch: Optional[int] = None) -> bool:  # fmt: skip
    """``pending``: batches the rank still holds (counted against the room); with
    ``extend_epoch``, the chunk goes out as an extension of the one it holds, which is
    of that epoch, or not at all."""
    cad = st.cadence
    assert cad is not None
    room = run_ahead_room(st, rank) - pending
    if room <= 0 or cad.final_plan is not None:
        return False  # (the run's last window is pinned: its plan splits all that is left)
    epoch = source_epoch(st)
    if epoch is None or (extend_epoch is not None and epoch != extend_epoch):
        return False
    if epoch not in cad.pools:
        _async._open(st, epoch, rank, out)
    # A chunk run ahead into what the run's last window will split is not lost to its
    # plan: the pin counts it as held (``FinalWindowPlan.base``) and splits the rest by
    # time around it. (Refused before, when windows were most of an epoch the whole last
    # epoch was that window, and every rank idled at its start for the trigger: 30 ms a
    # rank on a 1,1,2,3,5,8 rig.)
    left = _batches(cad.pools[epoch].remaining(), st.config.batch_size)
    ms = cad.elche.smoothed_ms_per_batch(rank)
    # Every chunk costs the rank a turnaround (its last report to the coordinator, the
    # plan back) with nothing to train: a chunk shorter than that idles the rank more
    # than it trains it (at 256 ranks, 100 ms turnarounds on 40 ms batches). So a chunk
    # lasts the wait it fills *and* the rank's last turnaround (its latest plan wait):
    # it is still training when the trigger's window reaches it. Not more: a batch
    # handed out here and trained after the trigger counts in the next window, and
    # the run's final-window plan sizes each rank's share by those steps.
    turnaround = cad.last_wait_ms.get(rank, 0.0)
    if ms:
        n = int((max(0.0, waiting_ms) + turnaround) // ms) + 1
    else:
        n = 1  # no pace yet: one batch, as it always was
    if extend_epoch is None:
        # A fresh chunk of one batch ends with its only report: nothing can top it up
        # before the rank runs dry, so each such chunk cost a turnaround (the probe window,
        # a batch at a time until the first round: 10-14 ms a batch, simulated at 5 ms
        # links). Two let its first report bring the next in time (``top_up``). A fresh
        # chunk goes to an idle rank, which waits for it whether or not a turnaround is
        # known yet (held to one batch until one was, a paced 1,024-rank run idled a
        # turnaround more a rank in its probe window: simulated at 50 ms links, efficiency
        # 0.751 -> 0.765).
        n = max(n, 2)
    if waiting_ms < 0.0:
        # A wait of unknown length (the gate is later than its wall) that outlasted what
        # the rank already ran ahead (and trained): double it, so a late straggler costs
        # the others a few turnarounds, not one per chunk of a batch or two.
        n = max(n, window_steps(st, rank) - _budget(st, rank))  # trained past it: not what it holds
    n = max(1, min(n, room, left))
    ranges = _take_window(st, rank, epoch, n)
    if not ranges:
        return False
    if extend_epoch is not None:
        _send_extensions(st, rank, epoch, ranges, out)
    else:
        _send_plan(st, rank, epoch, ranges[0], out, extra=ranges[1:])
    return True


BOUNDARY_STREAMS = _BoundaryStreams()
# Cadence: barrier-paced windows, the next window folded into the Update, and windows
# that run on across an epoch boundary (see the module doc).
CADENCE = CadenceDispatcher(streams=BOUNDARY_STREAMS)
