"""Cadence's incremental views: so that no batch walks every rank.

Theory of operation
-------------------
A chunk completing used to wake every alive rank (``_dispatcher.wake``), the gate
(``windows_done``) walked every alive rank on every event, and chunk sizing summed
ElChe's counts over every rank per chunk: O(N) per event, O(N^2) per window. Three
views in ``CadenceState`` make each O(1) amortised (O(log N) where a heap orders them):

* ``wakeable``: every ACTIVE rank a wake could serve now -- a superset. A wake looks
  only at these, in rank order (and not at all while every pool is empty), and drops
  those it served or found held (a chunk in flight, throttled, at its reduce barrier, not
  ACTIVE); one that only lacked work stays (under Async, Cadence's wake of a death finds
  no work in a rank's own epoch that the stream's wake right after hands it from an
  older one). A rank comes back when what held it can have changed:
  its chunk completed (``on_batch``), its throttle was lifted (``release_throttle``), its
  steps were folded or it became ACTIVE (the rank index's ``released``, absorbed by
  ``absorb_released``: a mid-run join is covered), or ``rearm``.
* ``open_windows``: a lazy min-heap (``in_open``: its members) of the ranks that may
  block the gate -- window open, not throttled, not quiesced. The gate pops those that
  no longer block and stops at the lowest that does, the rank a walk in order would
  name; after a rearm that put back more than ``REFILL`` ranks (one heapify, not a push
  each), its first pass sifts out every rank that does not block in one sweep
  (``open_refilled``). A rank comes back on the same events, when it takes a chunk
  (``may_block``: a taker is not quiesced any more), and when its count may have risen
  (a rearm wherever the counts move).
* ``alive_counts``: ElChe's counts with the ranks that are not ACTIVE zeroed, their sum,
  and "calibrated or speed-hinted" (``counts_view``), keyed by the rank index's
  ``alive_version`` and dropped where the counts move (``counts_changed``: a finished
  round's feedback, a dispatch's callback slack).

``rearm`` is for what can release many ranks at once -- a trigger (window marks move), a
finished round (counts, budgets, throttles), a dispatch or an opened epoch, a death or a
refused window (a pool refills): every ACTIVE rank goes back into both views. Both
already hold every ACTIVE rank but those a wake or the gate took out since
(``dropped_wake`` / ``dropped_open``), those parked for leaving the run's tail
(``parked``, ``_boundary``) and those the index released, so a rearm puts back only
these: it costs what changed since the last one, not O(N log N) per death. ``flodl.core.view_drift`` recomputes the views from scratch (the
stateful property tests assert it after every step).
"""

from __future__ import annotations

import heapq

from .._phases import ACTIVE
from .._state import CadenceState, CoordinatorState

__all__ = ["counts_view", "counts_changed", "may_block", "absorb_released", "drop_wake", "drop_open", "rearm", "REFILL"]

# More ranks than this put back at once: the heap is rebuilt, and the gate's next pass
# sifts it in one sweep (``open_refilled``). Below it, pushes and pops are cheaper.
REFILL = 64


def _cad(st: CoordinatorState) -> CadenceState:
    cad = st.cadence
    assert cad is not None, "a Cadence view of a run without a Cadence policy"
    return cad


def counts_view(st: CoordinatorState) -> tuple[int, list[int], int, bool]:
    """(alive_version, the alive ranks' counts, their sum, ElChe calibrated or
    speed-hinted), cached until the ACTIVE set changes or ``counts_changed`` (callers must
    not change the list)."""
    cad, version = _cad(st), st.index.alive_version
    view = cad.alive_counts
    if view is None or view[0] != version:
        el = cad.elche
        counts = [c if rec.phase is ACTIVE else 0 for c, rec in zip(el.batch_counts, st.ranks)]
        view = cad.alive_counts = (version, counts, sum(counts), el.calibrated or el.has_speed_hint())
    return view


def counts_changed(st: CoordinatorState) -> None:
    """ElChe's counts may have moved (feedback, callback slack): drop the cached view."""
    _cad(st).alive_counts = None


def may_block(cad: CadenceState, rank: int) -> None:
    """The rank may block the gate (again)."""
    if rank not in cad.in_open:
        heapq.heappush(cad.open_windows, rank)
        cad.in_open.add(rank)


def absorb_released(st: CoordinatorState) -> None:
    """Ranks that became ACTIVE or had their steps folded (the rank index's ``released``)
    may be served again and may block the gate."""
    released = st.index.drain_released()
    if released:
        cad = _cad(st)
        cad.wakeable |= released
        _reopen(cad, [r for r in released if r not in cad.in_open])  # a formation releases every rank


def drop_wake(cad: CadenceState, rank: int) -> None:
    """A wake took ``rank`` out of ``wakeable``: the next ``rearm`` puts it back."""
    cad.dropped_wake.add(rank)


def drop_open(cad: CadenceState, rank: int) -> None:
    """The gate took ``rank`` out of ``open_windows``: the next ``rearm`` puts it back."""
    cad.dropped_open.add(rank)


def rearm(st: CoordinatorState, *, unpark: bool = True) -> None:
    """Something that can release many ranks at once happened (module doc): every ACTIVE
    rank may be served and may block the gate.

    Both views already hold every ACTIVE rank but those taken out since the last rearm
    (``dropped_wake`` / ``dropped_open``, and ``parked``) and those that became ACTIVE
    since (the index's ``released``): only these go back, so a rearm costs what changed,
    not O(N log N) -- it runs on every death, and a run's end is N of them.
    ``unpark=False``: the parked ranks stay out of ``wakeable`` (``_boundary``'s wake
    looks at them itself, in order, only while nobody trains)."""
    cad = _cad(st)
    released = st.index.drain_released()
    back_wake = cad.dropped_wake | released
    if unpark:
        back_wake |= cad.parked
        cad.parked = set()
    back_open = cad.dropped_open | released
    cad.dropped_wake, cad.dropped_open = set(), set()
    ranks = st.ranks
    # (Unsorted: a set's order is a function of its history, so a replay pushes the same
    # heap; and the heap's order never changes which rank it yields first.)
    cad.wakeable.update([r for r in back_wake if ranks[r].phase is ACTIVE])
    in_open = cad.in_open
    _reopen(cad, [r for r in back_open if ranks[r].phase is ACTIVE and r not in in_open])  # a round: every rank


def _reopen(cad: CadenceState, back: list[int]) -> None:
    """``may_block`` for each of ``back`` (none in ``open_windows`` yet), in bulk."""
    cad.in_open.update(back)
    heap = cad.open_windows
    if len(back) > REFILL:
        heap += back
        heapq.heapify(heap)  # (O(N), not N pushes)
        cad.open_refilled = True
    else:
        for r in back:
            heapq.heappush(heap, r)
