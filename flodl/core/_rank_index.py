"""The rank index: incremental views of the rank records, so that no event walks every rank.

Theory of operation
-------------------
The step asks, on every event, who is ACTIVE, who is addressable, how many are DEAD,
whether any ACTIVE rank has steps no round folded, whom the open round still waits for,
and (on a ``Tick``) whether anyone may have gone silent. Walking ``st.ranks`` for each of
those made one event O(N) and a round O(N^2). A ``RankIndex`` keeps the answers:

* ``phases[p]``: the ranks in membership phase ``p``; ``alive()`` (ACTIVE, sorted, cached
  until the ACTIVE set changes), ``addressable()`` (JOINING | ACTIVE) and the counts;
* ``movers``: ACTIVE ranks with ``last_step > folded_step`` (unfolded steps);
* ``waiting``: the open round's participants still ACTIVE that have not acked it;
* ``seen_floor``: a lower bound on the addressable ranks' ``last_seen`` (None: unknown).
  While ``now - seen_floor`` is within the liveness timeout nobody can be stale, so a
  ``Tick`` need not look (``_membership.stale_ranks`` rebuilds the bound when it looks);
* ``still_heap``: a min-heap over ACTIVE ranks without unfolded steps (lazy: entries
  are checked when popped), so Sync's gate finds the lowest rank that blocks it without
  walking the movers (``lowest_still``);
* ``released``: ranks that became ACTIVE or had their steps folded since the Cadence
  dispatcher last looked (``drain_released``): what may let a held rank be served again
  or reopen its window; ``alive_version`` counts changes of the ACTIVE set (caches of
  per-rank values over the alive ranks key on it).

Who keeps it: the records themselves. Assigning a ``RankRecord``'s ``phase``,
``last_step``, ``folded_step`` or ``last_seen`` tells its index (``RankRecord.__setattr__``),
so every writer -- membership's transitions, the step's batch ledger, the averaging acks,
the resync report, a test, a mid-run join (issue 12) -- keeps it exact without having to
call anything (``RankRecord.advance_step`` skips the hook only where it would change
nothing: a mover's higher step); the round's participants come from ``_averaging`` (``open_round`` /
``acked`` / ``close_round``). Nothing else writes it. It is derived data: the state's
equality ignores it, and ``drift`` recomputes every view from the records and names the
ones that differ (the property tests run it after every step).
"""

from __future__ import annotations

import heapq
from typing import Any, Callable, Iterable, Optional

from ._phases import ACTIVE, DEAD, JOINING, LEFT, VACANT

__all__ = ["RankIndex", "INDEXED_FIELDS"]

# The RankRecord fields whose assignment updates the index.
INDEXED_FIELDS = frozenset({"phase", "last_step", "folded_step", "last_seen"})


class RankIndex:
    __slots__ = ("phases", "movers", "waiting", "participants", "acked", "seen_floor", "still_heap", "_in_heap",
                 "_alive", "released", "alive_version")  # fmt: skip

    def __init__(self, records: Iterable[Any] = ()) -> None:
        self.phases: dict[Any, set[int]] = {p: set() for p in (VACANT, JOINING, ACTIVE, DEAD, LEFT)}
        self.movers: set[int] = set()
        self.waiting: set[int] = set()
        self.participants: frozenset[int] = frozenset()  # the open round's (empty: none open)
        self.acked: set[int] = set()
        self.seen_floor: Optional[float] = None
        self.still_heap: list[int] = []
        self._in_heap: set[int] = set()
        self._alive: Optional[list[int]] = None
        self.released: set[int] = set()
        self.alive_version = 0
        for rec in records:
            self.phases.setdefault(rec.phase, set()).add(rec.rank)
            self._steps(rec)

    # -- queries ---------------------------------------------------------------------------

    def alive(self) -> list[int]:
        """ACTIVE ranks, ascending (the cached list: callers must not change it)."""
        if self._alive is None:
            self._alive = sorted(self.phases[ACTIVE])
        return self._alive

    def alive_count(self) -> int:
        return len(self.phases[ACTIVE])

    def addressable(self) -> list[int]:
        """JOINING and ACTIVE ranks, ascending."""
        return sorted(self.phases[JOINING] | self.phases[ACTIVE])

    def addressable_count(self) -> int:
        return len(self.phases[JOINING]) + len(self.phases[ACTIVE])

    def count(self, phase: Any) -> int:
        return len(self.phases.get(phase, ()))

    def drain_released(self) -> set[int]:
        """``released`` since the last call (one reader: the Cadence dispatcher)."""
        out, self.released = self.released, set()
        return out

    def lowest_still(self, blocks: Callable[[int], bool]) -> Optional[int]:
        """The lowest ACTIVE rank without unfolded steps for which ``blocks`` is true.

        Pops entries that are no longer such ranks (they come back when they are again);
        ranks that do not block are looked at and kept. Amortised O(log N) per event while
        the lowest still rank blocks (the common case: it is the one the gate waits for)."""
        heap, skipped, found = self.still_heap, [], None
        while heap:
            r = heap[0]
            if r in self.movers or r not in self.phases[ACTIVE]:
                heapq.heappop(heap)
                self._in_heap.discard(r)
                continue
            if blocks(r):
                found = r
                break
            skipped.append(heapq.heappop(heap))
        for r in skipped:
            heapq.heappush(heap, r)
        return found

    # -- the round's participants (``_averaging``) -------------------------------------------

    def open_round(self, ranks: Iterable[int]) -> None:
        self.participants = frozenset(ranks)
        self.acked = set()
        self.waiting = {r for r in self.participants if r in self.phases[ACTIVE]}

    def ack(self, rank: int) -> None:
        self.acked.add(rank)
        self.waiting.discard(rank)

    def close_round(self) -> None:
        self.participants, self.acked, self.waiting = frozenset(), set(), set()

    # -- kept by RankRecord.__setattr__ -------------------------------------------------------

    def changed(self, rec: Any, name: str, old: Any) -> None:
        if name == "phase":
            self._phase(rec, old)
        elif name == "last_seen":
            self._seen(rec)
        else:
            self._steps(rec)

    def _phase(self, rec: Any, old: Any) -> None:
        r, phases = rec.rank, self.phases
        was = phases.get(old)  # (not setdefault: it would build a set per call, a world forms N of these)
        if was is not None:
            was.discard(r)
        now = phases.get(rec.phase)
        if now is None:
            now = phases[rec.phase] = set()
        now.add(r)
        if old is ACTIVE or rec.phase is ACTIVE:
            self._alive = None
            self.alive_version += 1
        if rec.phase is ACTIVE:
            self.released.add(r)
            if r in self.participants and r not in self.acked:
                self.waiting.add(r)
        else:
            self.waiting.discard(r)
        self._steps(rec)
        self._seen(rec)

    def moved(self, recs: list[Any], old: Any) -> None:
        """``recs``, all in phase ``old``, were moved together to one new phase, written
        quietly (``RankRecord.set_quietly``): what ``_phase`` does for each, in bulk (a
        world forms N ranks in one step)."""
        if not recs:
            return
        new = recs[0].phase
        ranks = [rec.rank for rec in recs]
        was = self.phases.get(old)
        if was is not None:
            was.difference_update(ranks)
        now = self.phases.get(new)
        if now is None:
            now = self.phases[new] = set()
        now.update(ranks)
        if old is ACTIVE or new is ACTIVE:
            self._alive = None
            self.alive_version += len(ranks)  # as N moves would: caches key on it
        if new is ACTIVE:
            self.released.update(ranks)
            if self.participants:
                self.waiting.update(r for r in ranks if r in self.participants and r not in self.acked)
        else:
            self.waiting.difference_update(ranks)
        if new is not ACTIVE:
            for rec in recs:
                self._steps(rec)
                self._seen(rec)
            return
        # A world forms: ``_steps`` and ``_seen`` for each, inline (N ranks in one step).
        movers, in_heap, heap, released = self.movers, self._in_heap, self.still_heap, self.released
        for rec in recs:
            r = rec.rank
            if rec.last_step > rec.folded_step:
                movers.add(r)
                continue
            if r in movers:
                movers.discard(r)
                released.add(r)
            if r not in in_heap:
                heapq.heappush(heap, r)
                in_heap.add(r)
        floor = self.seen_floor
        if floor is not None:
            self.seen_floor = min(floor, min(rec.last_seen for rec in recs))

    def _seen(self, rec: Any) -> None:
        # Only ever lowered here: a rank refreshing its liveness cannot make anyone stale.
        if self.seen_floor is not None and (rec.phase is JOINING or rec.phase is ACTIVE):
            if rec.last_seen < self.seen_floor:
                self.seen_floor = rec.last_seen

    def _steps(self, rec: Any) -> None:
        r = rec.rank
        if rec.phase is ACTIVE and rec.last_step > rec.folded_step:
            self.movers.add(r)
            return
        if r in self.movers:
            self.movers.discard(r)
            if rec.phase is ACTIVE:
                self.released.add(r)
        if rec.phase is ACTIVE and r not in self._in_heap:
            heapq.heappush(self.still_heap, r)
            self._in_heap.add(r)

    # -- the drift check ------------------------------------------------------------------------

    def drift(self, records: list[Any], round_ranks: tuple[int, ...], acked: Iterable[int], pending: bool) -> list[str]:
        """The views that differ from a recount over ``records`` (empty: none)."""
        bad: list[str] = []
        for p, ranks in self.phases.items():
            want = {rec.rank for rec in records if rec.phase is p}
            if ranks != want:
                bad.append(f"phase {p!r}: kept {sorted(ranks)}, recounted {sorted(want)}")
        if self._alive is not None and self._alive != sorted(self.phases[ACTIVE]):
            bad.append(f"alive cache {self._alive}")
        movers = {rec.rank for rec in records if rec.phase is ACTIVE and rec.last_step > rec.folded_step}
        if self.movers != movers:
            bad.append(f"movers: kept {sorted(self.movers)}, recounted {sorted(movers)}")
        still = {rec.rank for rec in records if rec.phase is ACTIVE and rec.rank not in movers}
        if not still <= self._in_heap or set(self.still_heap) != self._in_heap:
            bad.append(f"still heap {sorted(self._in_heap)} misses {sorted(still - self._in_heap)}")
        acked_set = set(acked)
        if self.participants != (frozenset(round_ranks) if pending else frozenset()):
            bad.append(f"participants: kept {sorted(self.participants)}, the round has {sorted(round_ranks)}")
        waiting = {r for r in round_ranks if records[r].phase is ACTIVE and r not in acked_set} if pending else set()
        if self.waiting != waiting:
            bad.append(f"waiting: kept {sorted(self.waiting)}, recounted {sorted(waiting)}")
        if self.seen_floor is not None:
            low = [rec.rank for rec in records if rec.phase in (JOINING, ACTIVE) and rec.last_seen < self.seen_floor]
            if low:
                bad.append(f"seen_floor {self.seen_floor} above the last_seen of ranks {low}")
        return bad
