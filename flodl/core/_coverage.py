"""Coverage: which permutation positions of each epoch are *committed*.

Theory of operation
-------------------
A position is committed once the window in which a rank trained it has been folded
into the consensus (ARCHITECTURE §6). The ledger follows that definition literally:

1. ``record_batch``: a ``BatchDone`` puts ``(epoch, offset, samples, step_count)`` on
   the rank's *pending* list (kept in step order). A batch whose step the rank has
   already had folded (an ack that overtook it) is committed at once.
2. ``commit``: a ``SyncAcked(step_count=s)`` commits that rank's pending batches with
   ``step_count <= s``. Committing a position that is already committed counts a
   duplicate (it is still counted in ``trained``); coverage stays honest rather than
   silently idempotent.
3. ``discard``: when a rank dies or leaves, its pending batches were trained and
   thrown away (``discarded``); their positions are simply not committed, so they are
   part of the remainder that ``_dispatch`` hands to survivors. ``discard_upto`` does
   the same for a live rank's window whose contribution the reducer refused.
4. ``freeze``: once an epoch is aggregated its bitmap is released (a bytearray per
   *live* epoch keeps memory at one byte per sample of the epoch in flight); its
   counters stay for the summary.

``uncommitted(epoch, ranges)`` turns a rank's assignment into the contiguous ranges of
positions not committed: the remainder after a death.

The summary per epoch is ``{"epoch", "expected", "trained", "duplicates", "missing",
"discarded"}`` with ``missing = expected - unique committed``.
"""

from __future__ import annotations

from itertools import islice
from typing import Any

from ._state import CoverageState, EpochCoverage

__all__ = [
    "open_epoch",
    "record_batch",
    "keep_step_order",
    "commit",
    "discard",
    "discard_upto",
    "is_complete",
    "uncommitted",
    "freeze",
    "summary",
    "epoch_summary",
]


def open_epoch(cov: CoverageState, epoch: int, expected: int) -> None:
    if epoch not in cov.epochs:
        cov.epochs[epoch] = EpochCoverage(epoch, expected, bytearray(expected))


def _mark(ec: EpochCoverage, offset: int, samples: int) -> int:
    """Commit ``[offset, offset+samples)``; returns how many were already committed."""
    dup = ec.committed.count(1, offset, offset + samples)  # (counted in place: no slice copied)
    ec.committed[offset : offset + samples] = b"\x01" * samples
    ec.unique += samples - dup
    ec.trained += samples
    ec.duplicates += dup
    return dup


def record_batch(
    cov: CoverageState, rank: int, epoch: int, offset: int, samples: int, step: int, folded: int
) -> None:
    """Note a trained batch; commit it at once if its step is already folded."""
    if samples <= 0:
        return
    ec = cov.epochs[epoch]
    if step <= folded and not ec.frozen:
        _mark(ec, offset, samples)
        return
    cov.pending.setdefault(rank, []).append((epoch, offset, samples, step))
    ec.pending += 1


def keep_step_order(cov: CoverageState, rank: int) -> None:
    """A batch older than the rank's latest was recorded late (``_resync``): the pending
    list keeps step order."""
    pending = cov.pending.get(rank)
    if pending:
        pending.sort(key=lambda it: it[3])


def commit(cov: CoverageState, rank: int, step: int) -> int:
    """Commit the rank's pending batches with ``step_count <= step``; returns samples."""
    pending = cov.pending.get(rank)
    if not pending:
        return 0
    done = [item for item in pending if item[3] <= step]
    if not done:
        return 0
    cov.pending[rank] = [item for item in pending if item[3] > step] if len(done) < len(pending) else []
    return _mark_runs(cov, done)


def _mark_runs(cov: CoverageState, items: list[tuple[int, int, int, int]]) -> int:
    """Commit ``items`` (pending batches), each run of them that follows on in one epoch
    (a chunk's batches: each starts where the last ended) in one ``_mark``; returns the
    samples. A run's batches are disjoint, so its duplicates are theirs summed: the
    counters read as a mark per batch would leave them (an ack commits a window: tens
    of batches, a few runs)."""
    done = 0
    epoch, start, end, count = items[0][0], items[0][1], items[0][1] + items[0][2], 1
    for e, offset, samples, _s in islice(items, 1, None):
        if e == epoch and offset == end:
            end += samples
            count += 1
            continue
        done += _mark_run(cov.epochs[epoch], start, end, count)
        epoch, start, end, count = e, offset, offset + samples, 1
    return done + _mark_run(cov.epochs[epoch], start, end, count)


def _mark_run(ec: EpochCoverage, start: int, end: int, batches: int) -> int:
    ec.pending -= batches
    _mark(ec, start, end - start)
    return end - start


def discard(cov: CoverageState, rank: int) -> int:
    """Throw away the rank's uncommitted batches; returns the samples lost."""
    lost = 0
    for epoch, _offset, samples, _s in cov.pending.pop(rank, []):
        ec = cov.epochs[epoch]
        ec.pending -= 1
        ec.discarded += samples
        lost += samples
    return lost


def discard_upto(cov: CoverageState, rank: int, step: int) -> list[tuple[int, int, int]]:
    """Throw away the rank's pending batches with ``step_count <= step`` (a live rank
    whose contribution was refused); returns their ``(epoch, offset, samples)``."""
    pending = cov.pending.get(rank)
    if not pending:
        return []
    lost = [(e, o, n) for e, o, n, s in pending if s <= step]
    cov.pending[rank] = [item for item in pending if item[3] > step]
    for epoch, _offset, samples in lost:
        ec = cov.epochs[epoch]
        ec.pending -= 1
        ec.discarded += samples
    return lost


def is_complete(cov: CoverageState, epoch: int) -> bool:
    ec = cov.epochs.get(epoch)
    return ec is not None and ec.unique >= ec.expected


def uncommitted(cov: CoverageState, epoch: int, ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The contiguous sub-ranges of ``ranges`` whose positions are not committed."""
    ec = cov.epochs[epoch]
    out: list[tuple[int, int]] = []
    for offset, size in ranges:
        pos, end = offset, offset + size
        while pos < end:
            hole = ec.committed.find(0, pos, end)
            if hole < 0:
                break
            stop = ec.committed.find(1, hole, end)
            stop = end if stop < 0 else stop
            out.append((hole, stop - hole))
            pos = stop
    return out


def freeze(cov: CoverageState, epoch: int) -> None:
    """Release the epoch's bitmap. It is complete, so any batch of it still pending
    re-trained positions already committed: it is counted as a duplicate now."""
    ec = cov.epochs[epoch]
    # (As a rule none is left: every window of a complete epoch was folded. The lists
    # then hold other epochs' batches, and are not walked.)
    for rank, items in cov.pending.items() if ec.pending else ():
        stale = [it for it in items if it[0] == epoch]
        if stale:
            cov.pending[rank] = [it for it in items if it[0] != epoch]
            n = sum(it[2] for it in stale)
            ec.trained += n
            ec.duplicates += n
    ec.pending = 0
    ec.frozen = True
    ec.committed = bytearray()


def epoch_summary(ec: EpochCoverage) -> dict[str, Any]:
    return {
        "epoch": ec.epoch,
        "expected": ec.expected,
        "trained": ec.trained,
        "duplicates": ec.duplicates,
        "missing": ec.expected - ec.unique,
        "discarded": ec.discarded,
    }


def committed_samples(cov: CoverageState) -> int:
    """Distinct positions committed, summed over every epoch (the run's progress)."""
    return sum(ec.unique for ec in cov.epochs.values())


def summary(cov: CoverageState) -> list[dict[str, Any]]:
    return [epoch_summary(cov.epochs[e]) for e in sorted(cov.epochs)]
