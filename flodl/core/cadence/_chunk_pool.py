"""The progressive chunk pool and the dispatch math around it.

Theory of operation
-------------------
A :class:`ChunkPool` is the dispatch ledger of one epoch over sample positions
``[0, total)``. The positions are partitioned into contiguous per-rank **reservation spans**
(sized by ElChe's allocation, :func:`reservation_span_sizes`). A rank's chunks come from the
front of its own span through a cursor, so its upcoming data is known for the whole epoch
(what a stager prefetches). :meth:`ChunkPool.take_chunk` serves, in order:

1. ``reclaimed`` ranges first (a dead rank's forfeited chunks, rolled-back takes, resume
   holes): coverage holes close before anything fresh is handed out;
2. the front of the rank's own span;
3. a **steal** from the tail of the span with the largest residue (ties -> highest rank):
   the rank out-ran its reservation, the boundary moves, the books stay exact.

An owner consumes front-to-back and a thief peels back-to-front, so they can meet but never
cross: every position is handed out exactly once unless it is explicitly returned
(:meth:`~ChunkPool.rollback_take` after a failed send, :meth:`~ChunkPool.forfeit` when a
rank dies, :meth:`~ChunkPool.reopen` when a rank dies and the coordinator knows which of
its trained positions were never committed). Completions (:meth:`~ChunkPool.mark_completed`) consume each rank's outstanding
chunks in dispatch order. :meth:`~ChunkPool.uncovered_ranges` is everything not yet
completed (in-flight counts as uncovered: its gradient is not in the consensus yet), and
:meth:`ChunkPool.from_coverage` rebuilds a pool whose only work is those holes.

Dispatch math (pure functions of the schedule, no pool mutation):

* :func:`equal_sizes` -- whole-epoch partitions (non-progressive dispatch, spec §8.2).
* :func:`reservation_span_sizes` -- per-rank spans for a new pool (§8.4).
* :func:`compute_chunk_batches` -- the next chunk for one rank (§8.6): final-window slot,
  edge schedule, one-window chunk (barrier-paced), probe, or proportional.
* :func:`final_window_alloc` / :func:`refresh_final_window_plan` -- the epoch's last window
  split so that no rank ends with a lone 1-batch window (§8.7); :func:`balance_last_window`
  -- the run's last one split by time instead (nothing is sized after it).

Everything is in samples unless a name says batches. No clock, no I/O.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from itertools import accumulate, compress, repeat
from operator import itemgetter, sub
from dataclasses import dataclass
from typing import Optional, Sequence

__all__ = [
    "ChunkPool",
    "equal_sizes",
    "reservation_span_sizes",
    "compute_chunk_batches",
    "compute_chunk_batches_each",
    "explain_chunk_batches",
    "final_window_alloc",
    "balance_last_window",
    "consolidate_lone_ones",
    "fastest_alive_rank",
    "FinalWindowPlan",
    "refresh_final_window_plan",
    "MIN_CHUNK_BATCHES",
    "PROBE_FRACTION_DIVISOR",
]

# Floor for proportional (Async) chunks: smaller chunks spend more on control round trips
# than they save in balance.
MIN_CHUNK_BATCHES = 4
# Uncalibrated probe chunks are ~1/10 of a rank's equal share: several reduces per epoch
# so ElChe calibrates early, floored at MIN_CHUNK_BATCHES.
PROBE_FRACTION_DIVISOR = 10

Range = tuple[int, int]  # (offset, size)


class ChunkPool:
    """One epoch's dispatch ledger with per-rank reservation spans (see module doc)."""

    def __init__(self, epoch: int, total: int, world_size: int) -> None:
        """Equal spans of ``total // ws``; the remainder goes to the last rank."""
        if world_size < 1 or total < 0:
            raise ValueError("ChunkPool needs world_size >= 1 and total >= 0")
        base = total // world_size
        sizes = [base] * world_size
        sizes[-1] += total - base * world_size
        self._init(epoch, total, sizes)

    @classmethod
    def with_spans(cls, epoch: int, total: int, span_sizes: Sequence[int]) -> "ChunkPool":
        """Spans of the given sizes laid out contiguously in rank order (must sum to total)."""
        if not span_sizes or sum(span_sizes) != total or min(span_sizes) < 0:
            raise ValueError(f"span sizes {list(span_sizes)} must be >= 0 and sum to {total}")
        pool = cls.__new__(cls)
        pool._init(epoch, total, list(span_sizes))
        return pool

    @classmethod
    def from_coverage(
        cls, epoch: int, total: int, world_size: int, holes: Sequence[Range]
    ) -> "ChunkPool":
        """A pool whose only work is ``holes`` (served once each, in order): every cursor
        is parked at its span end and the holes wait in ``reclaimed``."""
        pool = cls(epoch, total, world_size)
        pool._cursor = list(pool._span_end)
        pool._unassigned = 0
        for o, s in holes:
            if s > 0:
                pool._reclaim((int(o), int(s)))
        return pool

    def _init(self, epoch: int, total: int, sizes: list[int]) -> None:
        self.epoch = epoch
        self.total = total
        ends = list(accumulate(sizes))  # (a world of thousands: no Python loop per rank)
        starts = [0, *ends[:-1]]
        # Each span's end, which a steal moves down (a span's start is never read again:
        # the cursor walks from it). One flat list, not a [start, end] list per rank.
        self._span_end: list[int] = ends
        ws = len(sizes)
        self._cursor = starts
        self.dispatched = [0] * ws
        self.completed = [0] * ws
        self.chunks_sent = [0] * ws
        # (Lists, not deques: a rank has few chunks out at once -- its plan and the
        # extensions behind it -- and 4,096 deques were 3 MB and most of a pool's making.)
        self._outstanding: list[list[list[int]]] = [[] for _ in repeat(None, ws)]
        self._reclaimed: deque[Range] = deque()
        # ``remaining()`` is asked per rank on every chunk: its two sums are kept as the
        # cursors, span ends and reclaimed ranges move (``check_sums`` recomputes them).
        # Every span's residue (cursors at their starts); a negative size is no residue.
        self._unassigned = ends[-1] if ends and min(sizes) >= 0 else sum(max(0, s) for s in sizes)
        self._reclaimed_samples = 0
        # Steals look for the largest residue: a lazy max-heap of (-residue, -rank) (ties
        # -> highest rank), built at the first steal; a stale entry is dropped when seen.
        self._donors: Optional[list[tuple[int, int]]] = None

    def _residue_moved(self, rank: int) -> None:
        if self._donors is not None and self.residue(rank) > 0:
            heapq.heappush(self._donors, (-self.residue(rank), -rank))

    def _largest_residue(self, exclude: int) -> Optional[int]:
        """The rank other than ``exclude`` with the largest residue > 0 (ties -> highest)."""
        ws = self.world_size
        if self._donors is None or len(self._donors) > 4 * ws + 64:
            self._donors = [(-self.residue(r), -r) for r in range(ws) if self.residue(r) > 0]
            heapq.heapify(self._donors)
        heap, skipped, found = self._donors, [], None
        while heap:
            neg_res, neg_rank = heap[0]
            if self.residue(-neg_rank) != -neg_res:
                heapq.heappop(heap)  # stale: the residue moved since
            elif -neg_rank == exclude:
                skipped.append(heapq.heappop(heap))
            else:
                found = -neg_rank
                break
        for entry in skipped:
            heapq.heappush(heap, entry)
        return found

    def _reclaim(self, rng: Range, *, front: bool = False) -> None:
        (self._reclaimed.appendleft if front else self._reclaimed.append)(rng)
        self._reclaimed_samples += rng[1]

    def _unreclaim(self) -> Range:
        rng = self._reclaimed.popleft()
        self._reclaimed_samples -= rng[1]
        return rng

    def check_sums(self) -> None:
        """Raise AssertionError if the kept sums of ``remaining()`` drifted from a recount."""
        unassigned = sum(self.residue(r) for r in range(self.world_size))
        reclaimed = sum(s for _, s in self._reclaimed)
        if (self._unassigned, self._reclaimed_samples) != (unassigned, reclaimed):
            raise AssertionError(
                f"epoch {self.epoch} pool: kept sums (unassigned {self._unassigned}, reclaimed "
                f"{self._reclaimed_samples}) differ from a recount ({unassigned}, {reclaimed})"
            )

    @property
    def world_size(self) -> int:
        return len(self._span_end)

    # --- views --------------------------------------------------------------------

    def residue(self, rank: int) -> int:
        return max(0, self._span_end[rank] - self._cursor[rank])

    def reservation(self, rank: int) -> Range:
        """``(next_offset, len)`` of the unassigned front of the rank's own span."""
        return self._cursor[rank], self.residue(rank)

    def reclaimed(self) -> tuple[Range, ...]:
        return tuple(self._reclaimed)

    def outstanding(self, rank: int) -> tuple[Range, ...]:
        return tuple((o, s) for o, s in self._outstanding[rank])

    def remaining(self) -> int:
        """Not yet handed out: every span's residue plus the reclaimed ranges."""
        return self._unassigned + self._reclaimed_samples

    def in_flight(self, rank: int) -> int:
        return max(0, self.dispatched[rank] - self.completed[rank])

    def is_epoch_done(self) -> bool:
        return (
            all(self.residue(r) == 0 for r in range(self.world_size))
            and not self._reclaimed
            and all(c >= d for c, d in zip(self.completed, self.dispatched))
        )

    def uncovered_ranges(self) -> list[Range]:
        """Residues, in-flight chunks and reclaimed ranges, sorted and coalesced."""
        ranges = [(self._cursor[r], self.residue(r)) for r in range(self.world_size)]
        for q in self._outstanding:
            ranges.extend((o, s) for o, s in q)
        ranges.extend(self._reclaimed)
        out: list[list[int]] = []
        for off, size in sorted(r for r in ranges if r[1] > 0):
            if out and out[-1][0] + out[-1][1] == off:
                out[-1][1] += size
            else:
                out.append([off, size])
        return [(o, s) for o, s in out]

    # --- mutations ----------------------------------------------------------------

    def _record(self, rank: int, offset: int, n: int) -> Range:
        self.dispatched[rank] += n
        self.chunks_sent[rank] += 1
        if n > 0:
            self._outstanding[rank].append([offset, n])
        return offset, n

    def take_chunk(self, rank: int, size: int) -> Optional[Range]:
        """Hand ``rank`` one contiguous chunk of at most ``size`` samples: reclaimed first,
        then its own span, then the tail of the largest residue. None when exhausted.
        A size-0 take skips ``reclaimed`` and returns an empty chunk at the cursor."""
        if size < 0:
            raise ValueError(f"chunk size must be >= 0, got {size}")
        if size > 0 and self._reclaimed:
            off, length = self._unreclaim()
            n = min(size, length)
            if n < length:
                self._reclaim((off + n, length - n), front=True)
            return self._record(rank, off, n)
        residue = self.residue(rank)
        if residue > 0:
            n = min(size, residue)
            off = self._cursor[rank]
            self._cursor[rank] += n
            self._unassigned -= n
            self._residue_moved(rank)
            return self._record(rank, off, n)
        donor = self._largest_residue(rank)  # ties -> highest rank (Rust max_by_key)
        if donor is None:
            return None
        n = min(size, self.residue(donor))
        self._span_end[donor] -= n
        self._unassigned -= n
        self._residue_moved(donor)
        return self._record(rank, self._span_end[donor], n)

    def take_own_run(self, wants: list[tuple[int, int]], start: int, got: list[tuple[int, int, int]]) -> int:
        """``take_chunk(rank, size)`` for ``wants[start:]`` in order, each appended to
        ``got`` as ``(rank, offset, n)``, while each is served from the front of the
        rank's own span (nothing reclaimed waits, its residue covers ``size > 0``): what
        a window's dispatch is for nearly every rank, taken without a call per rank.
        Returns the index of the first it stopped at (``len(wants)``: none), which the
        caller takes with ``take_chunk``, so the order -- and every result -- is the same."""
        if self._reclaimed:
            return start
        cursor, span_end, dispatched, sent, outstanding = (self._cursor, self._span_end, self.dispatched,
                                                           self.chunks_sent, self._outstanding)  # fmt: skip
        donors, taken, i = self._donors, 0, start
        for i in range(start, len(wants)):
            rank, size = wants[i]
            off = cursor[rank]
            if size <= 0 or span_end[rank] - off < size:
                self._unassigned -= taken
                return i
            cursor[rank] = off + size
            taken += size
            dispatched[rank] += size
            sent[rank] += 1
            outstanding[rank].append([off, size])
            got.append((rank, off, size))
            if donors is not None and span_end[rank] > off + size:
                heapq.heappush(donors, (off + size - span_end[rank], -rank))
        self._unassigned -= taken
        return len(wants)

    def rollback_take(self, rank: int, offset: int, size: int) -> bool:
        """Undo a take whose send failed. The newest matching outstanding chunk is removed;
        the cursor rewinds if the chunk ends exactly at it, otherwise the range goes to the
        *front* of ``reclaimed`` (served to anyone next). Unknown chunk: no-op, False."""
        if size <= 0:
            return False
        q = self._outstanding[rank]
        match = next((i for i in range(len(q) - 1, -1, -1) if q[i] == [offset, size]), None)
        if match is None:
            return False
        del q[match]
        self.dispatched[rank] = max(0, self.dispatched[rank] - size)
        self.chunks_sent[rank] = max(0, self.chunks_sent[rank] - 1)
        if self._cursor[rank] == offset + size:
            before = self.residue(rank)
            self._cursor[rank] -= size
            self._unassigned += self.residue(rank) - before
            self._residue_moved(rank)
        else:
            self._reclaim((offset, size), front=True)
        return True

    def forfeit(self, rank: int) -> int:
        """A rank died: its outstanding chunks (in dispatch order) go to the back of
        ``reclaimed``; returns the number of samples returned. Idempotent."""
        q = self._outstanding[rank]
        moved = 0
        for off, n in q:
            self._reclaim((off, n))
            moved += n
        q.clear()
        self.dispatched[rank] = max(0, self.dispatched[rank] - moved)
        return moved

    def reopen(self, rank: int, holes: Sequence[Range]) -> int:
        """A rank is gone, and of everything it was handed only ``holes`` still need
        training: the positions it never trained *and* those it trained in a window
        that was never folded into the consensus (committed-sample semantics: those were
        discarded). The pool does not track commits, so the caller names the holes.

        Its outstanding chunks are dropped without being reclaimed (their committed
        parts stay done), nothing is left in flight for it, and ``holes`` go to the
        back of ``reclaimed`` in the given order. Returns the samples queued.
        Contract: every hole lies inside what this rank was handed (outstanding, or
        completed by it) -- anything else would be handed out twice. Idempotent when
        called again with no holes."""
        self._outstanding[rank].clear()
        self.dispatched[rank] = self.completed[rank]
        queued = 0
        for off, size in holes:
            if size > 0:
                self._reclaim((int(off), int(size)))
                queued += int(size)
        return queued

    def give_back(self, holes: Sequence[Range]) -> int:
        """Positions a live rank trained in a window the coordinator discarded (its
        contribution was refused) are handed out again: ``holes`` go to the back of
        ``reclaimed``; the rank's own books (dispatched, completed, in flight) are left
        as they are. Returns the samples queued. Contract as ``reopen``: every hole was
        completed by that rank."""
        queued = 0
        for off, size in holes:
            if size > 0:
                self._reclaim((int(off), int(size)))
                queued += int(size)
        return queued

    def mark_completed(self, rank: int, samples: int) -> None:
        """Credit completions (clamped to dispatched: a falsely-declared-dead rank may
        report after its chunks were forfeited) and consume outstanding front-first."""
        self.completed[rank] = min(self.completed[rank] + samples, self.dispatched[rank])
        left = samples
        q = self._outstanding[rank]
        while left > 0 and q:
            front = q[0]
            if front[1] <= left:
                left -= front[1]
                del q[0]
            else:
                front[0] += left
                front[1] -= left
                left = 0


# --------------------------------------------------------------------------------------
# Partitions (non-progressive) and reservation spans
# --------------------------------------------------------------------------------------


def equal_sizes(world_size: int, total: int) -> list[int]:
    """``total // ws`` each, the first ``total % ws`` ranks get one more."""
    base, extra = divmod(total, world_size)
    return [base + (1 if r < extra else 0) for r in range(world_size)]


def reservation_span_sizes(
    batch_total: int, batch_size: int, counts: Sequence[int], calibrated: bool
) -> list[int]:
    """Per-rank span sizes (samples, batch-aligned, summing to ``batch_total``).

    ``calibrated`` = ElChe calibrated or speed-hinted: then ``B * counts[r] // sum(counts)``
    batches each, else ``B // ws``; leftover batches +1 round-robin from rank 0.
    """
    bs = max(batch_size, 1)
    ws = max(len(counts), 1)
    total_batches = batch_total // bs
    total_counts = sum(counts)
    if calibrated and total_counts > 0:
        batches = [total_batches * c // total_counts for c in counts]
    else:
        batches = [total_batches // ws] * ws
    for i in range(max(0, total_batches - sum(batches))):
        batches[i % ws] += 1
    return [b * bs for b in batches]


# --------------------------------------------------------------------------------------
# Chunk sizing
# --------------------------------------------------------------------------------------


def explain_chunk_batches(
    rank: int,
    *,
    remaining_samples: int,
    counts: Sequence[int],
    batch_size: int,
    barrier_paced: bool,
    calibrated: bool,
    total_samples: int,
    steps: int = 0,
    budget: int = 0,
    final_alloc: Optional[Sequence[int]] = None,
    min_chunk_batches: int = MIN_CHUNK_BATCHES,
    counts_total: Optional[int] = None,
    drains_run: bool = False,
) -> tuple[int, str]:
    """Batches for ``rank``'s next chunk, and which rule decided (spec §8.6).

    ``remaining_samples``: the epoch pool's ``remaining()`` (0 when there is no pool).
    ``calibrated``: ElChe calibrated or speed-hinted. ``budget``: ``reduce_step_budget``
    for the rank and ``steps`` its steps this window (the cap never crosses a reduce).
    ``final_alloc``: the pinned final-window plan's alloc **for this epoch**, if any.
    ``counts_total``: ``sum(counts)`` when the caller keeps it (asked per chunk: O(1)).
    ``drains_run``: the pool is the run's last (nothing streams in after it).
    """
    rem = remaining_samples // batch_size
    if rem == 0:
        return 0, "pool empty"
    if final_alloc is not None:  # what is left of the rank's share (a short take comes back for the rest)
        return max(0, final_alloc[rank] - steps), "final-window plan"

    def cap(s: int) -> int:
        return min(s, max(1, budget - steps)) if budget > 0 else s

    total = sum(counts) if counts_total is None else counts_total
    if total > 0 and rem < total:
        if drains_run and counts[rank] > 0:
            return cap(_share(rem, counts[rank], total)), "the run's last pool: its share of what is left"
        return cap(min(counts[rank], rem)), "edge schedule: less than one window left"
    if barrier_paced and counts[rank] > 0:
        return min(counts[rank], rem), "schedule-exact: one chunk is one window"
    if not calibrated:
        ws = len(counts)
        probe = max(total_samples // (ws * PROBE_FRACTION_DIVISOR * batch_size), min_chunk_batches)
        return min(probe, rem), "uncalibrated probe"
    if total == 0:
        return min(rem, min_chunk_batches), "no schedule"
    target = math.ceil(rem * (counts[rank] / total))
    return cap(min(max(target, min_chunk_batches), rem)), "proportional to the schedule"


def _share(rem: int, count: int, total: int) -> int:
    """The rank's share of the run's last ``rem`` batches, by its count (rounded up: >= 1).

    The edge rule hands each rank that asks a whole window of what is left; in the run's
    last pool nothing streams in behind it, so the first to ask held most of the end while
    the others idled -- under Async 12-18 % of a 1,1,2,3,5,8 run for the slow ranks
    (simulated); under Cadence, whose last window is split by time only when a plan can be
    pinned for it (``_dispatcher._pin``: not once the ranks ran ahead into it), a fast rank
    topped up with the last 14-15 batches trained 150-180 ms alone while five idled (real
    1,1,2,3,5,8 runs, ``bench/hetero.py``). A share by count ends about when the others'
    do, and shrinks as the pool drains."""
    return -(-rem * count // total)


def compute_chunk_batches(
    rank: int,
    *,
    remaining_samples: int,
    counts: Sequence[int],
    batch_size: int,
    barrier_paced: bool,
    calibrated: bool,
    total_samples: int,
    steps: int = 0,
    budget: int = 0,
    final_alloc: Optional[Sequence[int]] = None,
    min_chunk_batches: int = MIN_CHUNK_BATCHES,
    counts_total: Optional[int] = None,
    drains_run: bool = False,
) -> int:
    """:func:`explain_chunk_batches` without the reason."""
    return explain_chunk_batches(
        rank,
        remaining_samples=remaining_samples,
        counts=counts,
        batch_size=batch_size,
        barrier_paced=barrier_paced,
        calibrated=calibrated,
        total_samples=total_samples,
        steps=steps,
        budget=budget,
        final_alloc=final_alloc,
        min_chunk_batches=min_chunk_batches,
        counts_total=counts_total,
        drains_run=drains_run,
    )[0]


def compute_chunk_batches_each(
    ranks: Sequence[int],
    steps: Sequence[int],
    budgets: Sequence[int],
    *,
    remaining_samples: int,
    counts: Sequence[int],
    counts_total: int,
    batch_size: int,
    barrier_paced: bool,
    calibrated: bool,
    total_samples: int,
    final_alloc: Optional[Sequence[int]] = None,
    min_chunk_batches: int = MIN_CHUNK_BATCHES,
    drains_run: bool = False,
) -> list[int]:
    """:func:`compute_chunk_batches` for each of ``ranks`` (``steps[i]``, ``budgets[i]``
    its own), the inputs they share read once: the same rules in the same order, without
    two keyword calls per rank (a window start sizes every rank of a world of thousands)."""
    rem = remaining_samples // batch_size
    if rem == 0:
        return [0] * len(ranks)
    if final_alloc is not None:
        return [max(0, final_alloc[r] - s) for r, s in zip(ranks, steps)]
    total = counts_total
    if barrier_paced and 0 < total <= rem:
        each = [counts[r] for r in ranks]
        if min(each, default=1) > 0:
            return each  # min(c, rem) uncapped, and every c <= total <= rem: the counts themselves
    probe = max(total_samples // (max(1, len(counts)) * PROBE_FRACTION_DIVISOR * batch_size), min_chunk_batches)
    if not barrier_paced and not calibrated and not (total > 0 and rem < total):
        return [min(probe, rem)] * len(ranks)  # every rank's probe chunk, uncapped
    out = []
    for r, s, budget in zip(ranks, steps, budgets):
        c = counts[r]
        capped = True
        if total > 0 and rem < total:
            n = _share(rem, c, total) if drains_run and c > 0 else min(c, rem)
        elif barrier_paced and c > 0:
            n, capped = min(c, rem), False
        elif not calibrated:
            n, capped = min(probe, rem), False
        elif total == 0:
            n, capped = min(rem, min_chunk_batches), False
        else:
            n = min(max(math.ceil(rem * (c / total)), min_chunk_batches), rem)
        if capped and budget > 0:
            n = min(n, max(1, budget - s))
        out.append(n)
    return out


# --------------------------------------------------------------------------------------
# Final window
# --------------------------------------------------------------------------------------


def fastest_alive_rank(counts: Sequence[int], alive: Sequence[bool]) -> Optional[int]:
    """Alive rank with the largest count (ties -> lowest index); None if none alive."""
    best = None
    for r, c in enumerate(counts):
        if alive[r] and (best is None or c > counts[best]):
            best = r
    return best


def consolidate_lone_ones(alloc: Sequence[int], alive: Sequence[bool]) -> list[int]:
    """While an alive rank holds exactly 1, move it onto the alive peer holding the
    smallest non-zero amount (first such); stop when no such peer exists.

    O(N log N): the orphans are taken in index order (an amount only ever leaves 1, so
    none appears later), and the peers come from a heap of ``(amount, rank)`` whose
    stale entries are dropped when they reach the top (a world of lone ones was O(N^2))."""
    out = list(alloc)
    orphans = deque(r for r in range(len(out)) if alive[r] and out[r] == 1)
    holders = [(v, r) for r, v in enumerate(out) if alive[r] and v >= 1]
    heapq.heapify(holders)
    while orphans:
        orphan = orphans.popleft()
        if out[orphan] != 1:
            continue  # a peer of an earlier orphan: it holds 2 now
        while holders and (holders[0][1] == orphan or out[holders[0][1]] != holders[0][0]):
            heapq.heappop(holders)  # the orphan itself (it empties now) or a stale amount
        if not holders:
            return out  # irreducible (rem 1): that window falls back to the compute feed
        amount, peer = heapq.heappop(holders)
        out[peer] = amount + 1
        heapq.heappush(holders, (amount + 1, peer))
        out[orphan] = 0
    return out


def final_window_alloc(rem: int, counts: Sequence[int], alive: Sequence[bool]) -> list[int]:
    """Split the epoch's last ``rem`` batches (sums to ``rem``; dead ranks get 0).

    Fold band (``rem >= sum of alive counts``): each alive rank its full count, and the
    crumb one batch at a time, round-robin, to the alive non-fastest ranks by ascending
    count (the fastest is only padded when alone). Sub-window: largest-remainder split by
    ``counts / total``, then :func:`consolidate_lone_ones`.
    """
    ws = len(counts)
    alloc = [0] * ws
    total = sum(compress(counts, alive))
    if rem <= 0 or total == 0:
        return alloc
    if rem >= total:
        for r in range(ws):
            if alive[r]:
                alloc[r] = counts[r]
        fast = fastest_alive_rank(counts, alive)
        order = sorted((r for r in range(ws) if alive[r] and r != fast), key=lambda r: counts[r])
        crumb = rem - total
        if not order:  # a lone survivor takes the whole remainder
            alloc[fast] += crumb
            return alloc
        for i in range(crumb):
            alloc[order[i % len(order)]] += 1
        return alloc
    # (Comprehensions and a C-level sort: the run's last window splits a world of thousands.)
    live = list(compress(range(ws), alive))
    exact = [rem * counts[r] / total for r in live]
    floors = list(map(math.floor, exact))
    for r, f in zip(live, floors):
        alloc[r] = f
    frac = list(zip(live, map(sub, exact, floors)))
    left = rem - sum(floors)
    frac.sort(key=itemgetter(1), reverse=True)  # largest remainder first, ties in rank order (stable)
    for i in range(left):
        alloc[frac[i % len(frac)][0]] += 1
    return consolidate_lone_ones(alloc, alive)


def balance_last_window(
    alloc: Sequence[int], ms: Sequence[float], held: Sequence[int], alive: Sequence[bool],
    room: Optional[Sequence[int]] = None,
) -> list[int]:
    """The run's last window split to end as early as it can: batches move, one at a time,
    from the rank that would finish last to the one that would finish a batch soonest,
    while that ends earlier (``held[r]`` batches still in hand, ``ms[r]`` a batch). Nothing
    is sized after this window, so the lone-1 rule (a one-batch window leaves ElChe no
    marginal reading for the next) has nothing to protect; by counts alone, the remainder's
    crumb went to the slowest ranks and a 1,1,2,3,5,8 rig's run ended one slow batch late.

    ``room[r]``: the most the rank may take in this window (what its reduce budget leaves
    it); a share past it would stop at the budget and leave a fragment for whoever asks
    last. A split over it is brought under it first, when the others have room.

    Optimal for equal batches within ``room`` (what cannot move any more ends no later than
    every other split could); ``alloc`` unchanged when an alive rank's pace is unknown.
    Deterministic: ties go to the lower rank. O(moves x log N): heaps, their stale entries
    dropped at the top."""
    out = list(alloc)
    live = [r for r in range(len(out)) if alive[r]]
    if len(live) < 2 or any(not (ms[r] > 0.0) for r in live):
        return out
    cap = list(room) if room is not None else [sum(out)] * len(out)
    if sum(max(0, cap[r]) for r in live) < sum(out):
        return out  # the window does not fit the budgets: nothing to gain by moving
    ends = [(held[r] + out[r]) * ms[r] if alive[r] else 0.0 for r in range(len(out))]

    def fresh(entry: tuple[float, int]) -> bool:  # a ``soon`` entry still true
        r = entry[1]
        return out[r] < cap[r] and entry[0] == ends[r] + ms[r]

    soon = [(ends[r] + ms[r], r) for r in live if out[r] < cap[r]]  # who would end a batch more soonest
    heapq.heapify(soon)
    for r in live:  # a share past the rank's room: to whoever ends it soonest
        while out[r] > cap[r]:
            while not fresh(soon[0]):
                heapq.heappop(soon)
            nxt, taker = soon[0]
            out[r] -= 1
            ends[r] -= ms[r]
            out[taker] += 1
            ends[taker] = nxt
            heapq.heapreplace(soon, (nxt + ms[taker], taker))
    last = [(-ends[r], r) for r in live if out[r] > 0]  # who ends last (a max-heap)
    heapq.heapify(last)
    while last:
        neg, giver = last[0]
        if out[giver] == 0 or -neg != ends[giver]:
            heapq.heappop(last)
            continue
        while soon and not fresh(soon[0]):
            heapq.heappop(soon)
        if not soon:
            return out
        nxt, taker = soon[0]
        if taker == giver or not nxt < ends[giver]:
            return out
        out[giver] -= 1
        out[taker] += 1
        ends[giver] -= ms[giver]
        ends[taker] = nxt
        heapq.heapreplace(soon, (nxt + ms[taker], taker))
        heapq.heappush(soon, (ends[giver] + ms[giver], giver))
        heapq.heapreplace(last, (-ends[giver], giver))
        heapq.heappush(last, (-nxt, taker))
    return out


@dataclass(frozen=True, slots=True)
class FinalWindowPlan:
    """A pinned split of an epoch's final window, and the schedule it was pinned under."""

    epoch: int
    alloc: tuple[int, ...]
    pinned_counts: tuple[int, ...]
    pinned_alive: tuple[bool, ...]
    # Per rank, the window steps that are not its share: those it had run when the plan
    # was pinned and the batches it then held (a run-ahead chunk taken before the pin:
    # ``alloc`` splits only what the pool had left). Empty: none (a plan built by hand).
    base: tuple[int, ...] = ()
    # The run's last window with run-ahead on: per rank, the window step at which its
    # share is run (``base + alloc``), its reduce barrier where that is later than its
    # budget, under the window marks of ``marks_version`` (``_dispatcher._budget``).
    # Empty: the budgets hold.
    ends: tuple[int, ...] = ()
    marks_version: int = -1

    def share_steps(self, rank: int, window_steps: int) -> int:
        """The steps of the rank's window that count against its ``alloc``."""
        return max(0, window_steps - self.base[rank]) if self.base else window_steps


def refresh_final_window_plan(
    plan: Optional[FinalWindowPlan],
    *,
    epoch: int,
    remaining_batches: int,
    counts: Sequence[int],
    alive: Sequence[bool],
    barrier_paced: bool,
) -> Optional[FinalWindowPlan]:
    """The final-window plan to use now, or None outside the final-window regime (pass
    ``remaining_batches=0`` when the epoch has no pool).

    The final window is ``0 < rem < sum(alive counts) + ws``. A plan pinned for this epoch
    under the same counts **and the same alive set** is kept (the live remainder has since
    drained as ranks took their slots); otherwise it is re-pinned from the live values.
    Pin it once per window, before sizing the first rank.
    """
    if not barrier_paced:
        return None
    ws = len(counts)
    total = sum(compress(counts, alive))
    rem = remaining_batches
    if rem == 0 or total == 0 or rem >= total + ws:
        return None
    counts_t, alive_t = tuple(counts), tuple(map(bool, alive))
    if plan is not None and plan.epoch == epoch and plan.pinned_counts == counts_t:
        if plan.pinned_alive == alive_t:
            return plan
    alloc = tuple(final_window_alloc(rem, counts, alive))
    return FinalWindowPlan(epoch, alloc, counts_t, alive_t)
