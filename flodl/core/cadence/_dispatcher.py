"""Cadence (ElChe) dispatch: progressive chunks, the barriers, and the firing gate.

Theory of operation
-------------------
Under Cadence every rank runs its own *window* between two averages: ``counts[r]``
batches from ElChe (``state.cadence.elche``) -- the slowest rank ``anchor`` batches, a
faster one proportionally more -- so all ranks reach the reduce together and nobody
idles at a barrier the slowest card sets (spec §6). Work is handed out progressively,
one chunk per rank at a time, from one ``ChunkPool`` per epoch (§8.4-8.8); a chunk is
normally exactly one window.

* **Epoch start** (``dispatch_epoch``, §8.4; the run's first epoch, or one reached
  behind an epoch barrier): a pool whose reservation spans follow the
  alive ranks' counts (equal before calibration), every alive rank put at the epoch,
  then callback slack (``_slack.stage``: a rank that runs a callback at this boundary
  gets a shorter first window), then ``start_window``: the final-window plan is pinned
  (in an epoch whose end is a barrier, ``ends_at_a_barrier``),
  every rank's chunk is sized (``compute_chunk_batches``) *before any take*, then
  taken; each goes out as ``StartEpoch``.
* **Streaming** (``_dispatch_next``, §8.5): when a rank's chunk is done it gets its next
  one unless held -- one chunk in flight, which a report near its end extends with the
  next (``top_up``: the rank would otherwise idle a turnaround); the *reduce barrier* (its steps since the last
  *trigger* reached ``reduce_step_budget`` and are not all folded yet: it waits for the
  next round's trigger);
  throttled (waits for the ``Update``). When its epoch's pool is drained the composed
  stream (``EpochStreams``) decides: Cadence's (``_boundary``) hands it the rest of its
  window from the next epoch, Async's (``_async``) its next chunk; without one the rank
  waits at the *epoch barrier* (epoch e+1 opens once e is aggregated, by
  ``_run.advance``). The pool is credited per ``BatchDone`` (positions trained, in order), so a
  chunk is done when its last batch is reported, whenever the ``ChunkDone`` metrics
  frame lands.
* **Trigger** (``on_trigger``): the round overlaps the next window. Every participant's
  window mark (``window_mark``) moves to its last reported step, so steps reported from
  here on are its next window: that is what the reduce barrier, the chunk sizing and
  the gate count. Every participant that is not held (nothing in flight, not
  throttled) gets its next window now, via ``start_window``, as a ``StartEpoch`` sent
  just before its ``RequestParams``: it has work queued when it snapshots and trains
  while the round is open. So does one still training a run-ahead chunk of the
  window's epoch (``_ahead``): the rest of its window, as ``ExtendPartition`` ranges of that
  chunk (whose batches are the window's first steps) -- two windows in flight; it
  would otherwise get its window only once the chunk is done, a turnaround later; the rank applies the consensus delta-preserving
  (``theta <- consensus + (theta - snapshot)``). Folding is by the snapshot, not the
  mark: the ack's ``step_count`` (``_coverage.commit``: batches with step <= it) -- steps
  after the snapshot are folded by the *next* round. The two differ when a rank trains
  a batch between the trigger and reading its ``RequestParams`` (the ``StartEpoch``
  woke it first): that batch is folded now but paced as the next window's, so windows
  stay aligned on the trigger. The next round cannot fire before this one finishes
  (the gate), however fast the ranks run their windows.
* **Finish** (``on_round_finished``, §5.4-5.5): the feedback (``_feedback``) recalibrates
  ElChe (windows handed out at the trigger were sized by the counts before it: one
  window of lag); throttle marks clear; every alive rank that is not held (it got nothing at the trigger: throttled, or its pool was empty) gets its
  next window folded into its ``Update`` (atomic dispatch, via ``start_window``); then
  ``after_round`` wakes whoever is still idle. A rank that already ran the window it
  got at the trigger stays at the reduce barrier.
* **Death** (``reassign``, §9.2 step 7 made exact): the rank's chunk in flight *and* the
  positions it trained but never got folded (ARCHITECTURE §6: trained and discarded) go
  back to the pool -- ``ChunkPool.reopen`` with the uncommitted sub-ranges of everything
  it was handed -- then the plan is re-pinned and survivors are woken. Positions it had
  committed stay done, so every epoch is trained exactly once by committed samples.

Wake rule (why nothing deadlocks): whenever a chunk completes, a round opens or finishes
or a rank dies, every alive rank that is idle (nothing in flight, not held, not throttled) and whose
pool has work gets a chunk -- at least one batch, even when the pinned final-window plan
gives it 0 (a short take from a reclaimed fragment would otherwise leave work unowned
while everyone else waits at the barrier). So the gate below can only be blocked by a
rank that is training.

Gate (``cadence_gate``, §5.2): no round pending; each alive rank has run its window
(steps since the last trigger >= ``counts[r]``), is throttled, or is *quiesced*
(nothing in flight and its epoch's pool has nothing left); and at least one rank has
steps no round folded yet. Timing never gates firing. When the rest holds while a
round is still open, the round is what delays the next one: ``barrier_at`` records
when, and the feedback reports the delay as the round's exposed cost (``_feedback``).

Throttle (§4 step 5): with ``max_batch_diff = m`` and every rank ACTIVE, a rank whose
window steps exceed the slowest's by more than ``m`` gets one ``Throttle``; it counts as
at the barrier until the round finishes (its ``Update`` releases it).

Views (why no batch walks every rank): ``wake`` looks only at ``wakeable`` ranks, the
gate only at the lazy heap ``open_windows``, chunk sizing at cached alive counts; they are
kept by ``_views`` (its module doc says who puts a rank back, and when).

Sizes are in batches, the pool in samples. The epoch's sub-batch tail (``total % bs``)
belongs to the last alive rank's span, so it is trained like any other position (a short
last batch); chunk sizing sees the remainder rounded up to whole batches.
"""

from __future__ import annotations

import heapq
import math
from itertools import compress
from dataclasses import replace
from typing import Optional, Protocol

from flodl.wire import pb

from .. import _coverage, _dispatch
from . import _feedback, _slack
from ._chunk_pool import (
    balance_last_window,
    ChunkPool,
    compute_chunk_batches,
    compute_chunk_batches_each,
    refresh_final_window_plan,
    reservation_span_sizes,
)
from .._commands import Command
from .._config import CoreConfig
from ._elche import ElChe
from .._errors import LocalViolation
from .._events import BatchDone
from ._guards import make_guard
from ._lr_meta import LrEventMeta
from ._overshoot import OvershootBudget
from .._phases import ACTIVE, PENDING, TRAINING
from .._state import CadenceState, CoordinatorState
from ._views import absorb_released, counts_changed, counts_view, drop_wake, may_block, rearm
from ._window import WindowLedger

__all__ = [
    "CadenceDispatcher",
    "ends_at_a_barrier",
    "on_restarted",
    "release_throttle",
    "EpochStreams",
    "new_pool",
    "new_state",
    "cadence_gate",
    "quiesced",
    "window_steps",
    "windows_done",
    "round_wait_batches",
    "chunk_batches",
    "start_window",
    "wake",
    "live_epochs",
    "source_epoch",
]

def new_state(
    cfg: CoreConfig, *, barrier_paced: bool = True, overshoot: bool = False, streams_epochs: bool = False
) -> CadenceState:
    el = ElChe(
        cfg.world_size,
        cfg.anchor,
        overhead_target=cfg.overhead_target,
        max_anchor=cfg.max_anchor,
        min_anchor=cfg.min_anchor,
        max_batch_diff=cfg.batch_diff_cap,
    )
    # A min_anchor above anchor lifts both; the first window may be a shorter probe.
    first = min(cfg.probe_batches, el.anchor) if cfg.probe_batches else el.anchor
    el.batch_counts = [first] * cfg.world_size
    every = list(range(cfg.world_size))  # the views start full: nobody is missed before a rearm
    return CadenceState(
        wakeable=set(every),
        open_windows=every,
        in_open=set(every),
        elche=el,
        ledger=WindowLedger(cfg.world_size),
        guard=make_guard(cfg.guard),
        meta=LrEventMeta() if cfg.meta_controller else None,
        overshoot=OvershootBudget(),
        barrier_paced=barrier_paced,
        overshoot_on=overshoot,
        streams_epochs=streams_epochs,
    )


# -- queries ------------------------------------------------------------------------------


def _batches(samples: int, bs: int) -> int:
    return -(-samples // bs)


def window_steps(st: CoordinatorState, rank: int) -> int:
    """Steps the rank reported since the last trigger (its current window)."""
    return max(0, st.ranks[rank].last_step - st.cadence.window_mark.get(rank, 0))


def _budget(st: CoordinatorState, rank: int) -> int:
    cad = st.cadence  # the policy's switch: Async (``_async``) adds its overshoot look-ahead
    count = cad.elche.batch_counts[rank]
    if count > 0 and _probing(cad):
        budget = count + _probe_look(st, rank, cad.overshoot.look_ahead(True))
    else:
        budget = cad.overshoot.budget_for(count, overshoot=cad.overshoot_on)
    end = _share_end(cad)
    return end[rank] if end is not None and budget > 0 and end[rank] > budget else budget


def _budgets_each(st: CoordinatorState, ranks: list[int]) -> list[int]:
    """``_budget`` of each of ``ranks``, the inputs they share read once (a trigger and a
    window start ask it of every rank of a world of thousands)."""
    cad = st.cadence
    own, look = cad.elche.batch_counts, cad.overshoot.look_ahead(cad.overshoot_on)
    if _probing(cad):
        budgets = [own[r] + _probe_look(st, r, look) if own[r] > 0 else 0 for r in ranks]
    else:
        budgets = [own[r] + look if own[r] > 0 else 0 for r in ranks]
    end = _share_end(cad)
    if end is not None:  # (the run's last window: its shares may run past the budgets)
        budgets = [e if b > 0 and e > b else b for b, e in zip(budgets, [end[r] for r in ranks])]
    return budgets


def _share_end(cad: CadenceState) -> Optional[tuple[int, ...]]:
    """The run's last window, pinned under the current window marks: each rank's step at
    which its share of it is run (``FinalWindowPlan.ends``), its reduce barrier where that
    is later than its budget; None otherwise."""
    plan = cad.final_plan
    if plan is None or not plan.ends or plan.marks_version != cad.marks_version:
        return None
    return plan.ends


def run_ahead_limit(st: CoordinatorState, rank: int) -> int:
    """The most steps the rank may run in a window with run-ahead: up to one more window
    (``2 x max(budget, anchor)``: the probe window's budget is 1), and at least
    ``round_wait_batches`` past its budget (``_boundary.run_ahead_room``)."""
    budget = _budget(st, rank)
    return max(2 * max(budget, st.cadence.elche.anchor), budget + round_wait_batches(st, rank))


def round_wait_batches(st: CoordinatorState, rank: int) -> int:
    """Batches of the rank's own pace in two of the slowest batch yet seen (0: unknown).
    A round waits for every rank to end the batch it is in, twice (to snapshot, then to
    apply the consensus): while windows are a batch or two (the probe), that is longer
    than a window, and a rank held to one idled -- 80 ms (cadence's run-ahead room) to
    120 ms (async's look-ahead of 3) of a 1,1,2,3,5,8 rig's first round."""
    own_ms, slow = st.ranks[rank].mean_batch_ms(), st.cadence.slowest_batch_ms
    return math.ceil(2.0 * slow / own_ms) if own_ms > 0.0 and slow > 0.0 else 0


def _probing(cad: CadenceState) -> bool:
    """Async while ElChe is uncalibrated: windows of a batch or two (``_probe_look``)."""
    return cad.overshoot_on and not cad.elche.calibrated


def _probe_look(st: CoordinatorState, rank: int, look: int) -> int:
    """Async's look-ahead past a probe window: at least ``round_wait_batches``."""
    floor = round_wait_batches(st, rank)
    return floor if floor > look else look


def _alive_counts(st: CoordinatorState) -> list[int]:
    """ElChe's counts with every rank that is not ACTIVE zeroed (it gets no work)."""
    return counts_view(st)[1]


def _pool_of(st: CoordinatorState, rank: int) -> Optional[ChunkPool]:
    epoch = st.dispatch.rank_epoch.get(rank)
    return None if epoch is None else st.cadence.pools.get(epoch)


def quiesced(st: CoordinatorState, rank: int) -> bool:
    """Nothing in flight and its epoch's pool has nothing left (no pool: not quiesced)."""
    if rank in st.cadence.in_flight:
        return False
    pool = _pool_of(st, rank)
    return pool is not None and pool.remaining() == 0


def cadence_gate(st: CoordinatorState) -> tuple[bool, str]:
    """Cadence gate (§5.2): (verdict, reason)."""
    if st.run.phase is not TRAINING:
        return False, f"run is {st.run.phase!r}"
    if st.rounds.phase is PENDING:
        return False, f"round {st.rounds.cycle} pending"
    return windows_done(st)


def windows_done(st: CoordinatorState) -> tuple[bool, str]:
    """The gate's body: every alive rank ran its window, is throttled or quiesced.

    Looks only at ``open_windows`` (``_views``): the lowest rank there that still
    blocks is the one named, as a walk over every alive rank in order would."""
    if not st.alive_count():
        return False, "no active rank"
    cad = st.cadence
    absorb_released(st)
    if cad.open_refilled:
        _sift_open(st)
    counts, heap = cad.elche.batch_counts, cad.open_windows
    # (window_steps and drop_open inline: nothing read before the loop, as most events
    # stop at the first rank.)
    while heap:
        r = heap[0]
        rec = st.ranks[r]
        if rec.phase is ACTIVE and r not in cad.throttled:
            steps = max(0, rec.last_step - cad.window_mark.get(r, 0))
            if steps < counts[r] and not quiesced(st, r):
                why = f"rank {r} ran {steps}/{counts[r]} batches of its window and has work left"
                if r in cad.parked:  # waiting on the coordinator, not training: say so
                    why += f" (parked: the last window's tail is left to the {len(cad.in_flight)} rank(s) training)"
                return False, why
        heapq.heappop(heap)
        cad.in_open.discard(r)
        cad.dropped_open.add(r)
    if not st.any_unfolded():
        return False, "no rank has stepped since the last average"
    return True, "every active rank ran its window, is throttled, or has no work left"


def _sift_open(st: CoordinatorState) -> None:
    """The gate's first pass after a rearm refilled ``open_windows`` (``_views.REFILL``):
    every rank there that does not block now leaves it in one sweep (a finished round
    put back thousands, nearly all done with their window); the rest are heaped again.
    The pops leave the ranks above the lowest blocker in place; the sweep takes those
    out too, which is sound for the reason a pop is: a rank comes back on whatever can
    make it block again (``_views``; ``view_drift`` checks it after every step of the
    stateful tests, which run the sweep at any size)."""
    cad = st.cadence
    cad.open_refilled = False
    recs, throttled, marks, counts, heap = st.ranks, cad.throttled, cad.window_mark, cad.elche.batch_counts, cad.open_windows
    in_flight, rank_epoch = cad.in_flight, st.dispatch.rank_epoch
    drained = {e: pool.remaining() == 0 for e, pool in cad.pools.items()}  # (quiesced: asked per pool, not per rank)
    blocks = [
        recs[r].phase is ACTIVE and r not in throttled
        and max(0, recs[r].last_step - marks.get(r, 0)) < counts[r]
        and (r in in_flight or not drained.get(rank_epoch.get(r), False))  # not quiesced
        for r in heap
    ]  # fmt: skip
    gone = [r for r, b in zip(heap, blocks) if not b]
    if gone:
        heap[:] = list(compress(heap, blocks))
        heapq.heapify(heap)
        cad.in_open.difference_update(gone)
        cad.dropped_open.update(gone)


# -- sizing and taking --------------------------------------------------------------------


def _pinnable(st: CoordinatorState) -> bool:
    """The last dispatched epoch still has a pool to plan, and someone to plan it for
    (an aggregated epoch has nothing left to hand out: no plan is pinned for it)."""
    last = st.dispatch.last_dispatched
    ec = st.coverage.epochs.get(last) if last is not None else None
    return last in st.cadence.pools and ec is not None and not ec.frozen and st.alive_count() > 0


def _pin(st: CoordinatorState, epoch: int) -> None:
    """Pin the final-window plan for the window about to start (once per window)."""
    cad = st.cadence
    cad.final_plan = None  # (the budgets it is split under are the plain ones)
    pool = cad.pools[epoch]
    plan = refresh_final_window_plan(
        None,
        epoch=epoch,
        remaining_batches=_batches(pool.remaining(), st.config.batch_size),
        counts=cad.elche.batch_counts,
        alive=st.alive_mask(),
        barrier_paced=ends_at_a_barrier(st, epoch),
    )
    if plan is not None:
        # The plan splits what the pool has left; steps a rank runs from what it holds
        # already (a run-ahead chunk) are not its share. Counted as its share, they let
        # every rank "leave the tail" at once to the one still training, which then
        # trained the rest of the run alone, a chunk at a time (seen at 256 ranks).
        bs, base = st.config.batch_size, [window_steps(st, r) for r in range(len(st.ranks))]
        held = [0] * len(st.ranks)
        for r, (e, _off, _n) in cad.in_flight.items():
            held[r] = _batches(cad.pools[e].in_flight(r), bs) if e in cad.pools else 0
            base[r] += held[r]
        alloc = plan.alloc
        ends: tuple[int, ...] = ()
        if epoch + 1 >= st.config.num_epochs:  # the run's last window: split it by time
            # What each may run of it: with run-ahead, as far as that would take it past its
            # budget (a window more). Held to its budget, a fast rank that had run ahead
            # into this window had no room left, so the split gave the rest to the slower
            # ranks and the fast one idled at its barrier while they trained it (150-200 ms
            # of a 1.7 s real 1,1,2,3,5,8 run).
            limit = run_ahead_limit if st.config.run_ahead else _budget
            room = [max(0, limit(st, r) - b) for r, b in enumerate(base)]
            if sum(compress(room, plan.pinned_alive)) < sum(alloc):
                # Not the last window after all: the ranks ran ahead into it, and what is
                # left no longer fits what their budgets leave them. Pinned, the shares past
                # a budget stopped there and the gate waited for counts the plan cut short
                # (170 ms a fast rank, a real 1,1,2,3,5,8 run); unpinned, this window runs by
                # counts with its run-ahead and the next trigger pins the rest.
                cad.final_plan = None
                return
            alloc = tuple(balance_last_window(alloc, _paces(st), held, plan.pinned_alive, room))
            if st.config.run_ahead:
                ends = tuple(b + a for b, a in zip(base, alloc))  # its share run: its barrier
        plan = replace(plan, alloc=alloc, base=tuple(base), ends=ends, marks_version=cad.marks_version)
    cad.final_plan = plan


def _paces(st: CoordinatorState) -> list[float]:
    """Each rank's ms per batch: ElChe's smoothed reading, else the mean of what it reported
    (0.0: unknown)."""
    smoothed = st.cadence.elche.ms_per_batch()
    return [ms if ms > 0.0 else rec.mean_batch_ms() for ms, rec in zip(smoothed, st.ranks)]


def ends_at_a_barrier(st: CoordinatorState, epoch: int) -> bool:
    """Whether the ranks' windows stop at ``epoch``'s end, so its last window needs a
    final-window plan: never under Async; under Cadence only when no later epoch takes
    over (the run's last epoch, or Cadence without streaming, ``_boundary``)."""
    cad = st.cadence
    if not cad.barrier_paced:
        return False
    return not cad.streams_epochs or epoch + 1 >= st.config.num_epochs


def chunk_batches(st: CoordinatorState, rank: int, epoch: int) -> int:
    """Batches for the rank's next chunk of ``epoch`` (§8.6; 0: nothing for it)."""
    cad = st.cadence
    pool = cad.pools.get(epoch)
    if pool is None:
        return 0
    bs, plan = st.config.batch_size, cad.final_plan
    final = plan is not None and plan.epoch == epoch
    view = counts_view(st)
    return compute_chunk_batches(
        rank,
        remaining_samples=_batches(pool.remaining(), bs) * bs,
        counts=view[1],
        counts_total=view[2],
        batch_size=bs,
        barrier_paced=cad.barrier_paced,  # Async: probe / proportional chunks
        calibrated=view[3],
        total_samples=pool.total,
        steps=plan.share_steps(rank, window_steps(st, rank)) if final else window_steps(st, rank),
        budget=_budget(st, rank),
        final_alloc=plan.alloc if final else None,
        drains_run=epoch + 1 >= st.config.num_epochs,
    )


def _capped(st: CoordinatorState, rank: int, n: int) -> int:
    budget = _budget(st, rank)
    return min(n, max(1, budget - window_steps(st, rank))) if budget > 0 and n > 0 else n


def _take(st: CoordinatorState, rank: int, epoch: int, batches: int) -> Optional[tuple[int, int]]:
    """Take a chunk for the rank; record it as its assignment and its chunk in flight."""
    got = st.cadence.pools[epoch].take_chunk(rank, batches * st.config.batch_size)
    if got is None or got[1] == 0:
        return None
    _note_takes(st, epoch, [(rank, got[0], got[1])])
    return got


def start_window(
    st: CoordinatorState, epoch: int, ranks: list[int], ahead: Optional[dict[int, int]] = None,
    extra: Optional[dict[int, list[tuple[int, int]]]] = None,
) -> dict[int, tuple[int, int]]:
    """Pin the plan, size every rank in ``ranks`` before any take, then take (§8.4/§8.6).

    A rank that already ran part of its window gets only the rest (never crosses the
    reduce, as in streaming). ``ahead``: ranks still training a chunk of ``epoch`` (a
    run-ahead chunk, at a trigger), with the batches they hold: those are this window's
    first steps, so each gets the rest of its window behind them, or nothing. ``extra``
    (a dict to fill): a take that came back short is topped up to the window's size
    with more takes of the epoch, ``extra[rank]`` (``_take_window``), sent behind the
    plan as ``ExtendPartition`` commands; without it a short take is all the rank gets now."""
    if epoch not in st.cadence.pools:
        return {}
    _pin(st, epoch)
    sizes = _window_sizes(st, epoch, ranks, ahead or {})
    taken: dict[int, tuple[int, int]] = {}
    bs, pool = st.config.batch_size, st.cadence.pools[epoch]
    wants = [(r, sizes[r] * bs) for r in ranks if sizes[r] > 0]
    got: list[tuple[int, int, int]] = []
    i = 0
    while i < len(wants):
        # Nearly every rank's window is the front of its own span: taken in bulk, in
        # order; the first that is not is taken the general way, then the bulk goes on.
        i = pool.take_own_run(wants, i, got)
        _note_takes(st, epoch, got, taken)
        got.clear()
        if i == len(wants):
            break
        r = wants[i][0]
        i += 1
        if extra is None:
            one = _take(st, r, epoch, sizes[r])
            if one is not None:
                taken[r] = one
            continue
        ranges = _take_window(st, r, epoch, sizes[r])
        if ranges:
            taken[r] = ranges[0]
            if len(ranges) > 1:
                extra[r] = ranges[1:]
    return taken


def _note_takes(st: CoordinatorState, epoch: int, got: list[tuple[int, int, int]],
                taken: Optional[dict[int, tuple[int, int]]] = None) -> None:  # fmt: skip
    """Record each take ``(rank, offset, n)`` as the rank's assignment and its chunk in
    flight (it is not quiesced any more); ``taken`` (if given) gets ``rank -> (offset, n)``."""
    if not got:
        return
    cad, d = st.cadence, st.dispatch
    assigned, rank_epoch, in_flight, in_open = d.assigned.setdefault(epoch, {}), d.rank_epoch, cad.in_flight, cad.in_open
    for rank, off, n in got:
        ranges = assigned.get(rank)
        if ranges is None:
            assigned[rank] = [(off, n)]
        elif ranges and ranges[-1][0] + ranges[-1][1] == off:
            ranges[-1] = (ranges[-1][0], ranges[-1][1] + n)
        else:
            ranges.append((off, n))
        rank_epoch[rank] = epoch
        in_flight[rank] = (epoch, off, n)
        if rank not in in_open:
            may_block(cad, rank)
        if taken is not None:
            taken[rank] = (off, n)


def _take_window(st: CoordinatorState, rank: int, epoch: int, batches: int) -> list[tuple[int, int]]:
    """Take ``batches`` of ``epoch`` for the rank, in as many contiguous takes as it takes.
    A take is one contiguous range (its own span, then a reclaimed hole or another's
    residue), so a window larger than what is left of the rank's span comes back short;
    handed out one take at a time, each of the rest would cost the rank a turnaround
    with nothing to train (at 256 ranks, most of the plan waits). Each range is its
    assignment as a take is (``_take``)."""
    bs = st.config.batch_size
    ranges: list[tuple[int, int]] = []
    left = batches
    while left > 0:
        got = _take(st, rank, epoch, left)
        if got is None:
            break
        ranges.append(got)
        left -= _batches(got[1], bs)
    return ranges


def _ahead(st: CoordinatorState, epoch: int, ranks: list[int]) -> dict[int, int]:
    """Of ``ranks`` (each training a chunk at a trigger), those whose next window may go
    out now, queued behind it, with the batches they still hold. A rank that ran its
    window and took a run-ahead chunk would otherwise get its next window only once that
    chunk is done: one turnaround with nothing to train, every window. Its chunk must be
    of ``epoch`` (its batches name one epoch at a time, ``check_batch``) and it must not
    be throttled (it waits for the round). Barrier-paced windows only (Cadence)."""
    cad = st.cadence
    if not cad.barrier_paced or not st.config.run_ahead:
        return {}
    pool, bs = cad.pools.get(epoch), st.config.batch_size
    out: dict[int, int] = {}
    for r in ranks:
        chunk = cad.in_flight.get(r)
        if pool is None or chunk is None or chunk[0] != epoch or r in cad.throttled:
            continue
        out[r] = _batches(pool.in_flight(r), bs)
    return out


def _window_sizes(st: CoordinatorState, epoch: int, ranks: list[int], ahead: dict[int, int]) -> dict[int, int]:
    """``_capped(chunk_batches(rank))`` for each rank, the inputs they share (the pool's
    remaining, the counts view, the pinned plan) read once: nothing moves them before the
    first take, and a dispatch sizes every rank of a world of thousands."""
    cad = st.cadence
    pool = cad.pools[epoch]
    bs, plan = st.config.batch_size, cad.final_plan
    _, counts, counts_total, calibrated = counts_view(st)
    remaining = _batches(pool.remaining(), bs) * bs
    final_alloc = plan.alloc if plan is not None and plan.epoch == epoch else None
    recs = st.ranks
    # (Conditionals, not min/max: a builtin's call per rank was most of a formation's sizing.)
    get = cad.window_mark.get
    steps = [recs[r].last_step - get(r, 0) for r in ranks]
    steps = [s if s > 0 else 0 for s in steps]  # window_steps
    budgets = _budgets_each(st, ranks)
    helds = [ahead.get(r, 0) for r in ranks] if ahead else None  # the pinned plan's base already leaves them out of its share
    if final_alloc is None:
        sized = [s + h for s, h in zip(steps, helds)] if helds else steps
    else:
        sized = [plan.share_steps(r, s) for r, s in zip(ranks, steps)]
    ns = compute_chunk_batches_each(ranks, sized, budgets, remaining_samples=remaining, counts=counts,
                                    counts_total=counts_total, batch_size=bs, barrier_paced=cad.barrier_paced,
                                    calibrated=calibrated, total_samples=pool.total, final_alloc=final_alloc,
                                    drains_run=epoch + 1 >= st.config.num_epochs)  # fmt: skip
    if helds is None:  # (a formation, an epoch's first window: thousands of ranks) _capped:
        rooms = [b - s if b - s > 1 else 1 for s, b in zip(steps, budgets)]  # max(1, b - s)
        return {r: ((n if n < room else room) if b > 0 and n > 0 else n) for r, n, room, b in zip(ranks, ns, rooms, budgets)}
    sizes: dict[int, int] = {}
    for r, n, s, b, h in zip(ranks, ns, steps, budgets, helds):
        if h:  # the rest of its window behind what it holds, never a batch past it
            rest = b - s - h
            sizes[r] = min(n, rest) if b > 0 and rest > 0 and n > 0 else 0
        else:
            sizes[r] = min(n, max(1, b - s)) if b > 0 and n > 0 else n  # _capped
    return sizes


def _send_plan(st: CoordinatorState, rank: int, epoch: int, got: tuple[int, int], out: list[Command],
               role: Optional[int] = None, extra: tuple[tuple[int, int], ...] | list = ()) -> None:  # fmt: skip
    _dispatch.send_plan(st, out, rank, epoch, got[0], got[1], role)
    _send_extensions(st, rank, epoch, extra, out)


def _send_extensions(st: CoordinatorState, rank: int, epoch: int, ranges, out: list[Command]) -> None:
    """The rest of a plan, right behind it: the rank appends each to that plan."""
    for off, size in ranges:
        st.send(out, rank, extend_partition=pb.Control.ExtendPartition(epoch=epoch, partition_offset=off,
                                                                       partition_size=size))  # fmt: skip


# -- streaming ----------------------------------------------------------------------------


def _held(st: CoordinatorState, rank: int) -> Optional[str]:
    """Why the rank may not get a chunk now; None if it may (§8.5 steps 2-3)."""
    cad = st.cadence
    if st.ranks[rank].phase is not ACTIVE:
        return "not active"
    if rank in cad.in_flight:
        return "one chunk in flight"
    if rank in cad.throttled:
        return "throttled until the Update"
    budget = _budget(st, rank)
    # A window whose steps were all folded already (stepped between the trigger and its
    # snapshot) has nothing for the next reduce: holding it would wait for no round.
    if budget > 0 and window_steps(st, rank) >= budget and st.unfolded(rank) > 0:
        return "reduce barrier"
    return None


def _held_each(st: CoordinatorState, ranks: list[int]) -> dict[int, Optional[str]]:
    """``{r: _held(st, r) for r in ranks}``, the rules inline (a trigger and a finished
    round ask it of every participant)."""
    cad = st.cadence
    recs, in_flight, throttled, marks = st.ranks, cad.in_flight, cad.throttled, cad.window_mark
    out: dict[int, Optional[str]] = {}
    for r, budget in zip(ranks, _budgets_each(st, ranks)):
        rec = recs[r]
        if rec.phase is not ACTIVE:
            out[r] = "not active"
        elif r in in_flight:
            out[r] = "one chunk in flight"
        elif r in throttled:
            out[r] = "throttled until the Update"
        elif budget > 0 and rec.last_step - marks.get(r, 0) >= budget and rec.last_step > rec.folded_step:
            out[r] = "reduce barrier"  # window_steps >= _budget > 0, with unfolded steps
        else:
            out[r] = None
    return out


def _unheld(st: CoordinatorState, ranks: list[int]) -> list[int]:
    """``[r for r in ranks if _held(st, r) is None]`` (``_held_each``)."""
    return [r for r, why in _held_each(st, ranks).items() if why is None]


def _dispatch_next(st: CoordinatorState, rank: int, out: list[Command]) -> bool:
    """Stream the rank its next chunk unless held or its epoch is drained."""
    if _held(st, rank) is not None:
        return False
    pool = _pool_of(st, rank)
    if pool is None or pool.remaining() == 0:
        return False  # epoch barrier: the next epoch opens when this one is aggregated
    return offer_chunk(st, rank, st.dispatch.rank_epoch[rank], pool, out)


def _next_chunk_batches(st: CoordinatorState, rank: int, epoch: int, pool: ChunkPool, left: int) -> int:
    """The rank's next chunk of ``epoch``, in batches, at most ``left``."""
    n = chunk_batches(st, rank, epoch)
    return min(n, left) if n > 0 else min(left, _batches(pool.remaining(), st.config.batch_size))


def offer_chunk(st: CoordinatorState, rank: int, epoch: int, pool: ChunkPool, out: list[Command]) -> bool:
    """Size the rank's next chunk of ``epoch`` (never past its reduce budget), take it from
    ``pool`` and send it; False when nothing could be taken."""
    left = max(1, _budget(st, rank) - window_steps(st, rank))  # never cross the reduce
    ranges = _take_window(st, rank, epoch, _next_chunk_batches(st, rank, epoch, pool, left))
    if not ranges:
        return False
    _send_plan(st, rank, epoch, ranges[0], out, extra=ranges[1:])
    return True


def _drains_run(st: CoordinatorState, rank: int) -> bool:
    """The rank's chunk in flight is of the run's last epoch (nothing streams in after it)."""
    held = st.cadence.in_flight.get(rank)
    return held is None or held[0] + 1 >= st.config.num_epochs


def top_up_pace(st: CoordinatorState, rank: int, unreported: int) -> float:
    """The rank's ms per batch when the ``unreported`` batches of its chunk in flight last
    no longer than its next report and a turnaround (more work must go out now, or it
    runs dry first); 0.0 while a later report is still in time. While ElChe has no pace
    yet (the probe windows) the rank's own batches say it.

    Under Async, in the run's last epoch, or with a turnaround shorter than a report, a
    batch longer than that is never due: its rank asks when its chunk is done, and idles a
    turnaround. (Due at its last batch instead, the slowest rank of a 1,1,2,3,5,8 rig took
    its share of Async's last pool a batch early and held the run's end: the others idled
    0.10-0.14 s, ``tests/sim/test_sim_async_run_end.py``.)"""
    cad = st.cadence
    ms = cad.elche.smoothed_ms_per_batch(rank) or st.ranks[rank].mean_batch_ms()
    if not ms:
        return 0.0
    paced_ahead = cad.barrier_paced and not _drains_run(st, rank)
    # The report interval many ranks stretch (``report_interval_ms``) only where a rank may
    # run ahead: under Async and in the run's last epoch the rule below stays as tuned, on
    # the setting (a 400 ms rank is not due at its last batch there, 500 ms stretched or not).
    next_report_ms = st.config.report_interval_ms if paced_ahead else st.config.batch_report_ms
    turnaround = cad.last_wait_ms.get(rank, 0.0)
    if paced_ahead and ms > next_report_ms and turnaround >= next_report_ms:
        # Cadence with a loaded coordinator (a turnaround no shorter than a report): a batch
        # longer than a report is a report of its own, so the next report comes a batch
        # on, and a chunk's last batch is due. Held to the report instead, a rank whose
        # batch outlasts a report plus a turnaround (most of a paced 1,024-rank run's,
        # 100-400 ms against 40 ms) ran every chunk dry and idled a turnaround each
        # (simulated 1,024 ranks at 50 ms links, the rule in every epoch: idle between
        # batches 916 -> 611 rank-s). Not with a short turnaround (a batch held early costs more than the wait: a 1,1,2,3,5,8 rig
        # at 0.5 ms links had a 10 ms boundary wait), nor under Async (its last pool's
        # share taken a batch early, above; 1,1,2,3,5,8 at 0.5 ms links: 0.980 -> 0.964),
        # nor in the run's last epoch: a slow rank topped up there ran ahead into what the
        # last window's plan then counts as its own, and trained it alone after every other
        # rank was done (simulated 1,024 ranks at 50 ms links, 6 seeds: 3 runs ended 0.5 s
        # late on one 400 ms rank's last two batches; none with this rule).
        next_report_ms = ms
    if unreported * ms > next_report_ms + turnaround:
        return 0.0
    return ms


# -- the epochs streamed from (Async, and Cadence at its boundary: ``_async``) --------------


def live_epochs(st: CoordinatorState) -> list[int]:
    """Epochs with a pool that are not aggregated yet, oldest first."""
    cov = st.coverage.epochs
    return [e for e in sorted(st.cadence.pools) if e in cov and not cov[e].frozen]


def source_epoch(st: CoordinatorState) -> Optional[int]:
    """The epoch an idle rank draws from: the oldest live epoch with work left, else the
    next epoch (to be opened; None past ``num_epochs`` or before epoch 0 exists)."""
    pools = st.cadence.pools
    for e in live_epochs(st):
        if pools[e].remaining() > 0:
            return e
    last = st.dispatch.last_dispatched
    if last is None or last + 1 >= st.config.num_epochs:
        return None
    return last + 1


def extend_in_window(st: CoordinatorState, rank: int, left: int, out: list[Command]) -> bool:
    """The chunk in flight ends inside the rank's window, ``left`` batches short of it:
    the window's next chunk goes out now, as an extension, instead of once the rank ran
    dry (every chunk of a window cost the rank a turnaround with nothing to train: 2-12 ms
    each on a real 6-rank rig, 4-6 % of its time). Sized as its plain take would be. Only
    from the epoch an idle rank would draw from (``source_epoch``): an older epoch's
    reclaimed holes go first, by a plain take once this chunk is done."""
    cad = st.cadence
    epoch = cad.in_flight[rank][0]
    if source_epoch(st) != epoch:
        return False
    pool = cad.pools.get(epoch)
    if pool is None or pool.remaining() == 0:
        return False  # the epoch is handed out: the next is the streams' (after the chunk)
    ranges = _take_window(st, rank, epoch, _next_chunk_batches(st, rank, epoch, pool, left))
    if not ranges:
        return False
    _send_extensions(st, rank, epoch, ranges, out)
    return True


def wake(st: CoordinatorState, out: list[Command]) -> None:
    """Give every idle, unheld alive rank whose pool has work its next chunk (rank order;
    only the ranks in ``wakeable`` can be: ``_views``)."""
    if st.run.phase is not TRAINING:
        return
    cad = st.cadence
    absorb_released(st)
    if not cad.wakeable or not any(pool.remaining() for pool in cad.pools.values()):
        return  # nobody could be given anything: they stay wakeable
    in_flight = cad.in_flight
    busy = {r for r in cad.wakeable if r in in_flight}  # (O(wakeable), not O(in flight))
    if busy:  # held (one chunk in flight), whatever the others take: out at once, in bulk
        cad.wakeable -= busy  # (after a window start that is every rank)
        cad.dropped_wake |= busy  # drop_wake
    for r in sorted(cad.wakeable):
        _dispatch_next(st, r, out)
        if _held(st, r) is not None:  # served (one chunk in flight) or held: out until released
            cad.wakeable.discard(r)
            drop_wake(cad, r)


def _note_barrier(st: CoordinatorState) -> None:
    """While a round is open, remember when every rank reached its window end."""
    cad = st.cadence
    if st.rounds.phase is PENDING and cad.barrier_at is None and st.run.phase is TRAINING:
        if windows_done(st)[0]:
            cad.barrier_at = st.now


def _check_throttle(st: CoordinatorState, rank: int, out: list[Command]) -> bool:
    """Throttle the rank if it ran too far ahead; True when it was throttled now."""
    m = st.config.batch_diff_cap
    cad = st.cadence
    if m is None or rank in cad.throttled:
        return False
    if st.alive_count() < len(st.ranks):
        return False  # a rank is gone: the spread is no longer meaningful (spec: active < ws)
    if window_steps(st, rank) > _min_window_steps(st) + m:
        cad.throttled.add(rank)
        st.send(out, rank, throttle=pb.Control.Throttle())
        return True
    return False


def _min_window_steps(st: CoordinatorState) -> int:
    """The fewest steps any rank ran of its window (``window_steps``), asked per batch
    under ``max_batch_diff``: a walk over every rank made each batch O(N). A heap of lower
    bounds instead -- a rank's window steps only grow between two rebuilds (a window mark
    that moves, a new process counting from 0, are both keyed), so a fresh top is the
    minimum and a stale one is put back at its current value: O(log N) a batch, amortised."""
    cad = st.cadence
    key = (cad.marks_version, st.index.alive_version)
    heap = cad.steps_floor
    if cad.steps_floor_key != key:  # (the first ask too: the key starts at (-1, -1))
        heap = cad.steps_floor = [(window_steps(st, r), r) for r in range(len(st.ranks))]
        heapq.heapify(heap)
        cad.steps_floor_key = key
    while True:
        low, r = heap[0]
        now = window_steps(st, r)
        if now == low:
            return low
        heapq.heapreplace(heap, (now, r))


def new_pool(st: CoordinatorState, epoch: int, total: int) -> ChunkPool:
    """A fresh pool for ``epoch`` with reservation spans from the current counts (equal
    spans among the alive until ElChe calibrated or has a speed hint); on a resumed
    run, an epoch the checkpoint has samples of holds only what it left (its holes)."""
    holes = st.checkpoints.resume_holes.get(epoch)
    if holes is not None:
        return ChunkPool.from_coverage(epoch, total, st.config.world_size, holes)
    bs, el = st.config.batch_size, st.cadence.elche
    counts = _alive_counts(st)
    if not (el.calibrated or el.has_speed_hint()):
        counts = [1 if c > 0 else 0 for c in counts]  # equal spans among the alive
    batch_total = (total // bs) * bs
    spans = reservation_span_sizes(batch_total, bs, counts, True)
    owners = [r for r, c in enumerate(counts) if c > 0] or [len(counts) - 1]
    spans[owners[-1]] += total - batch_total  # the sub-batch tail
    return ChunkPool.with_spans(epoch, total, spans)


# -- the policy's hooks (``_policy.Policy``) -----------------------------------------------


def on_restarted(st: CoordinatorState, abandoned: Optional[int]) -> None:
    """The coordinator restarted: an abandoned round's exposed cost is not measured."""
    if abandoned is not None:
        st.cadence.barrier_at = None


def release_throttle(st: CoordinatorState, rank: int) -> None:
    """A resynced rank's throttle was lifted by an ``Update`` (``_resync``)."""
    cad = st.cadence
    cad.throttled.discard(rank)
    cad.wakeable.add(rank)
    may_block(cad, rank)


# -- the dispatcher -----------------------------------------------------------------------


class EpochStreams(Protocol):
    """What a streaming policy (Async: ``_async.STREAMS``) adds to the dispatcher: epochs
    opened on the fly instead of at an epoch barrier, and its own wake rule."""

    def open_epoch(self, st: CoordinatorState, epoch: int, out: list[Command]) -> None: ...

    def wake(self, st: CoordinatorState, out: list[Command]) -> None: ...

    def round_epoch(self, st: CoordinatorState) -> Optional[int]: ...

    def window_epoch(self, st: CoordinatorState, out: list[Command]) -> Optional[int]:
        """The epoch the windows handed out at a trigger or in an ``Update`` draw from
        (opened now if it must be); None: the trigger only wakes idle ranks (Async)."""
        ...

    def live_window_epoch(self, st: CoordinatorState) -> Optional[int]:
        """``window_epoch`` if it has a pool already; None if it would have to open one."""
        ...

    def top_up(self, st: CoordinatorState, rank: int, unreported: int, out: list[Command]) -> None:
        """A rank's report with ``unreported`` batches of its chunk still to come: hand it
        more now, before it runs dry, if its policy would then (its window's next chunk;
        Cadence's run-ahead past the window's end)."""
        ...


class CadenceDispatcher:
    """Progressive chunk dispatch driven by ElChe (see module doc), one class for Cadence
    and Async, parameterised by the policy's switches: ``barrier_paced`` and
    ``overshoot`` (handed to the engines through ``CadenceState``), ``atomic_dispatch``
    (the next window is folded into the ``Update``) and ``streams`` (``streams_epochs``:
    Async's epoch streaming, ``_async``; None under Cadence).

    Under streaming, a death and a refused window run Cadence's wake and then the
    stream's, in that order (as when Async was a subclass of this class)."""

    progressive = True

    def __init__(
        self,
        *,
        barrier_paced: bool = True,
        overshoot: bool = False,
        atomic_dispatch: bool = True,
        streams: Optional[EpochStreams] = None,
    ) -> None:
        self.barrier_paced = barrier_paced  # the ranks are held at the reduce and epoch barriers
        self.overshoot = overshoot  # the reduce budget has a moving look-ahead (``_overshoot``)
        self.atomic_dispatch = atomic_dispatch
        self.streams = streams

    _new_pool = staticmethod(new_pool)

    def _wake(self, st: CoordinatorState, out: list[Command]) -> None:
        (wake if self.streams is None else self.streams.wake)(st, out)

    def setup(self, st: CoordinatorState) -> None:
        st.cadence = new_state(
            st.config, barrier_paced=self.barrier_paced, overshoot=self.overshoot, streams_epochs=self.streams is not None
        )

    def _window_epoch(self, st: CoordinatorState, out: list[Command]) -> Optional[int]:
        """Where windows started now come from: the epoch last dispatched (the epoch
        barrier), or what the stream says (``EpochStreams.window_epoch``)."""
        if self.streams is None:
            return st.dispatch.last_dispatched
        return self.streams.window_epoch(st, out)

    def _live_window_epoch(self, st: CoordinatorState) -> Optional[int]:
        """``_window_epoch`` when it has a pool already (None: it would open one)."""
        if self.streams is None:
            return st.dispatch.last_dispatched
        return self.streams.live_window_epoch(st)

    def dispatch_epoch(self, st: CoordinatorState, epoch: int, out: list[Command]) -> None:
        if self.streams is not None and st.dispatch.last_dispatched is not None:
            # Streaming reaches a later epoch here only when nobody streamed into it.
            self.streams.open_epoch(st, epoch, out)
            return
        total = _dispatch.epoch_samples(st.total_samples, 1, epoch)
        if total <= 0:
            raise LocalViolation("dispatch_epoch requires total_samples > 0")
        cad, d = st.cadence, st.dispatch
        if epoch in cad.pools:
            raise LocalViolation(f"epoch {epoch} was already dispatched")
        role = _dispatch.role_to_tell(st)  # carried by the plans; announce_role tells the rest
        _coverage.open_epoch(st.coverage, epoch, total)
        d.assigned.setdefault(epoch, {})
        d.reported.setdefault(epoch, {})
        d.last_dispatched = epoch
        d.dispatched_at.setdefault(epoch, st.now)
        cad.elche.set_max_total_batches(total // st.config.batch_size)  # a window <= an epoch
        for old in [e for e in cad.pools if e < epoch]:
            del cad.pools[old]
        cad.pools[epoch] = new_pool(st, epoch, total)
        alive = st.alive_ranks()
        for r in alive:
            d.rank_epoch[r] = epoch
        _slack.stage(st, epoch, out)  # a callback holder's first window is shorter
        counts_changed(st)
        rearm(st)
        extra: dict[int, list[tuple[int, int]]] = {}
        taken = start_window(st, epoch, alive, extra=extra)
        _dispatch.send_plans(st, out, epoch, taken, role)  # one StartEpoch each, in rank order
        for r, ranges in extra.items():
            _send_extensions(st, r, epoch, ranges, out)
        _dispatch.announce_role(st, out, told=taken)
        wake(st, out)

    def reassign(self, st: CoordinatorState, rank: int, out: list[Command]) -> None:
        cad, d = st.cadence, st.dispatch
        cad.in_flight.pop(rank, None)
        cad.throttled.discard(rank)
        for epoch, pool in cad.pools.items():
            ec = st.coverage.epochs.get(epoch)
            if ec is None or ec.frozen:
                continue
            mine = d.assigned.get(epoch, {}).get(rank, [])
            pool.reopen(rank, _coverage.uncommitted(st.coverage, epoch, mine))
            if mine:
                d.assigned[epoch][rank] = []
        rearm(st)
        if _pinnable(st):
            _pin(st, d.last_dispatched)
        wake(st, out)
        _note_barrier(st)
        if self.streams is not None:  # then survivors are woken from the oldest epoch with work
            rearm(st)  # Cadence's wake dropped those its pools could not serve: the stream may
            self.streams.wake(st, out)

    def give_back(
        self, st: CoordinatorState, rank: int, lost: list[tuple[int, int, int]], out: list[Command]
    ) -> None:
        """A live rank's refused window: its batches leave its assignment and go back to
        their epoch's pool (``ChunkPool.give_back``); the plan is re-pinned and idle
        ranks are woken, as after a death (the rank keeps its chunk in flight)."""
        cad, d = st.cadence, st.dispatch
        for epoch, ranges in _dispatch.lost_by_epoch(lost).items():
            ec = st.coverage.epochs.get(epoch)
            pool = cad.pools.get(epoch)
            if ec is None or ec.frozen or pool is None:
                continue
            per_rank = d.assigned.setdefault(epoch, {})
            per_rank[rank] = _dispatch.subtract_ranges(per_rank.get(rank, []), ranges)
            pool.give_back(ranges)
        rearm(st)
        if _pinnable(st):
            _pin(st, d.last_dispatched)
        wake(st, out)
        _note_barrier(st)
        if self.streams is not None:  # then idle ranks are woken from the oldest epoch with work
            rearm(st)  # as after a death: the stream may serve whom the pools could not
            self.streams.wake(st, out)

    def idle(self, st: CoordinatorState, rank: int) -> bool:
        return quiesced(st, rank)

    def on_batch(self, st: CoordinatorState, ev: BatchDone, out: list[Command], more: bool = False) -> None:
        cad, r = st.cadence, ev.rank
        # A plan wait is a window's fixed cost, except in the run's last window (a final
        # plan is pinned): the tail's waits end the run, no longer window amortises them.
        cad.ledger.record_batch(r, ev.batch_ms, ev.data_ms, ev.wait_ms if cad.final_plan is None else 0.0, ev.loss)
        if ev.lr > 0.0:
            cad.last_lr[r] = ev.lr
        if ev.wait_ms > 0.0:  # (the wire's translation zeroed a hostile one)
            cad.last_wait_ms[r] = ev.wait_ms  # its latest turnaround: what a run-ahead chunk must outlast
        spent = ev.batch_ms + ev.data_ms
        if spent > cad.slowest_batch_ms:  # (a NaN compares false: never taken)
            cad.slowest_batch_ms = min(spent, st.config.liveness_timeout_s * 1e3)
            # A slower batch raises every rank's ``round_wait_batches``, so the budget of
            # a probing rank held at its barrier and the run-ahead room of one at it: a
            # rank a wake dropped may be servable now (a max: it rises a few times a run).
            rearm(st, unpark=False)
        pool = cad.pools.get(ev.epoch)
        if pool is not None and ev.samples > 0:
            pool.mark_completed(r, ev.samples)
        throttled = _check_throttle(st, r, out)
        chunk = cad.in_flight.get(r)
        unreported = pool.in_flight(r) if pool is not None and chunk is not None else 0
        if chunk is not None and chunk[0] == ev.epoch and unreported == 0:
            del cad.in_flight[r]
            cad.wakeable.add(r)
            self._wake(st, out)  # hand work to a rank that ran dry (streaming: oldest epoch first)
        elif chunk is not None and chunk[0] == ev.epoch and self.streams is not None and not throttled:
            if not more:  # (the frame's last batch decides: it knows the fewest left; asked
                # by each batch of a frame, it was a quarter of a coalesced batch's core cost)
                self.streams.top_up(st, r, _batches(unreported, st.config.batch_size), out)
        elif throttled and self.streams is not None:
            rearm(st)  # it stopped training: the tail it was left (``_boundary``) goes to another
            self._wake(st, out)
        if not more:  # (the frame's batches share one time, ``now``: noted at its last, the
            # barrier's time is the same unless an earlier batch closed the gate and a later
            # one reopened it, which a batch cannot: it adds steps to its own rank's window)
            _note_barrier(st)

    def on_trigger(self, st: CoordinatorState, ranks: list[int], out: list[Command]) -> None:
        cad = st.cadence
        recs = st.ranks  # the next window starts here
        cad.window_mark.update([(r, recs[r].last_step) for r in ranks])
        cad.marks_version += 1
        cad.barrier_at = None
        rearm(st)
        # Everything sent here goes before the RequestParams (the caller's): the round
        # overlaps training.
        held = _held_each(st, ranks)
        if st.run.phase is TRAINING and st.dispatch.last_dispatched is not None:
            training = [r for r in ranks if r in cad.in_flight and recs[r].phase is ACTIVE]  # held: in flight
            if any(h is None for h in held.values()):
                epoch = self._window_epoch(st, out)
            else:  # only ranks still training: none of them opens an epoch
                epoch = self._live_window_epoch(st) if training else None
            if epoch is not None:
                ahead = _ahead(st, epoch, training)
                ready = [r for r in ranks if held[r] is None or r in ahead]
                extra: dict[int, list[tuple[int, int]]] = {}
                for r, got in start_window(st, epoch, ready, ahead, extra).items():
                    if r in ahead:  # it extends the chunk it holds: a second plan queued would
                        # be one the rank cannot tell from a coordinator's mistake (hazard 11)
                        _send_extensions(st, r, epoch, [got, *extra.get(r, ())], out)
                    else:
                        _send_plan(st, r, epoch, got, out, extra=extra.get(r, ()))
        if self.streams is not None:
            self.streams.wake(st, out)  # whoever that epoch could not serve streams on

    def on_round_finished(
        self, st: CoordinatorState, ranks: list[int], out: list[Command]
    ) -> dict[int, pb.EpochPlan]:
        cad = st.cadence
        epoch = st.dispatch.last_dispatched if self.streams is None else self.streams.round_epoch(st)
        _feedback.finish_window(st, epoch, out)
        cad.throttled.clear()
        counts_changed(st)
        rearm(st)
        if epoch is None:
            return {}
        cad.averages[epoch] = cad.averages.get(epoch, 0) + 1
        if not self.atomic_dispatch:
            return {}  # nobody waits for the Update
        ready = _unheld(st, ranks)
        if not ready:
            return {}
        source = self._window_epoch(st, out)
        if source is None:
            return {}
        return {
            r: pb.EpochPlan(epoch=source, partition_offset=off, partition_size=n)
            for r, (off, n) in start_window(st, source, ready).items()
        }

    def after_round(self, st: CoordinatorState, out: list[Command]) -> None:
        self._wake(st, out)

    def window_end_step(self, st: CoordinatorState, rank: int) -> int:
        """The rank's step at which its window is run (the gate's ``windows_done``)."""
        return st.cadence.window_mark.get(rank, 0) + st.cadence.elche.batch_counts[rank]

    def window_end_steps(self, st: CoordinatorState, ranks: list[int]) -> list[int]:
        """``window_end_step`` of each of ``ranks``, in one pass."""
        marks, counts = st.cadence.window_mark, st.cadence.elche.batch_counts
        return [marks.get(r, 0) + counts[r] for r in ranks]

    def on_epoch_aggregated(self, st: CoordinatorState, epoch: int, out: list[Command]) -> None:
        """The ranks already stream into ``epoch + 1``: the callbacks of this aggregation
        run inside their current windows, so that is where the slack goes (``_slack``);
        behind an epoch barrier ``dispatch_epoch`` stages it before the first windows."""
        if self.barrier_paced and epoch + 1 in st.cadence.pools and _slack.stage(st, epoch + 1, out):
            counts_changed(st)
            rearm(st, unpark=False)  # a count that rose may make a rank block the gate again

    def on_join(self, st: CoordinatorState, rank: int, out: list[Command]) -> None:
        """A joiner holds the consensus: it draws chunks from the current epoch's pool
        (stealing from the largest residue: its slot had no span), starting with a probe
        window -- the smallest count among the members, at most ``probe_batches`` -- that
        ElChe then calibrates like any window."""
        cad, d = st.cadence, st.dispatch
        cad.in_flight.pop(rank, None)
        cad.throttled.discard(rank)
        cad.window_mark[rank] = 0
        cad.marks_version += 1
        el = cad.elche
        others = [c for c, rec in zip(el.batch_counts, st.ranks) if rec.phase is ACTIVE and rec.rank != rank]
        probe = st.config.probe_batches or st.config.anchor
        el.batch_counts[rank] = max(1, min([probe, *others]))
        counts_changed(st)  # the cached alive counts (``_views``) hold its old count
        epoch = d.last_dispatched
        if epoch is not None and epoch in cad.pools:
            d.rank_epoch[rank] = epoch
            _pin(st, epoch)
        rearm(st)  # a new member: every view may serve it or be blocked by it
        wake(st, out)
        _note_barrier(st)
        if self.streams is not None:
            self.streams.wake(st, out)

