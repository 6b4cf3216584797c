"""Coverage ledger: pending -> committed on ack, duplicates, discards, remainders."""

import random

from flodl.core._coverage import (
    commit,
    discard,
    discard_upto,
    epoch_summary,
    freeze,
    is_complete,
    open_epoch,
    record_batch,
    summary,
    uncommitted,
)
from flodl.core._state import CoverageState

from .cluster import Cluster


def _ledger(expected=20):
    cov = CoverageState()
    open_epoch(cov, 0, expected)
    return cov


def test_record_batch_is_pending_until_committed():
    cov = _ledger()
    record_batch(cov, 1, 0, 0, 4, step=1, folded=0)
    assert cov.pending[1] == [(0, 0, 4, 1)]
    assert cov.epochs[0].unique == 0


def test_commit_takes_batches_up_to_the_acked_step():
    cov = _ledger()
    record_batch(cov, 1, 0, 0, 4, step=1, folded=0)
    record_batch(cov, 1, 0, 4, 4, step=2, folded=0)
    record_batch(cov, 1, 0, 8, 4, step=3, folded=0)
    assert commit(cov, 1, 2) == 8
    assert cov.pending[1] == [(0, 8, 4, 3)]
    ec = cov.epochs[0]
    assert (ec.unique, ec.trained, ec.duplicates) == (8, 8, 0)


def test_commit_of_committed_position_counts_duplicate():
    cov = _ledger()
    record_batch(cov, 0, 0, 0, 4, step=1, folded=0)
    commit(cov, 0, 1)
    record_batch(cov, 1, 0, 2, 4, step=1, folded=0)
    commit(cov, 1, 1)
    ec = cov.epochs[0]
    assert (ec.unique, ec.trained, ec.duplicates) == (6, 8, 2)


def test_record_batch_already_folded_commits_at_once():
    cov = _ledger()
    record_batch(cov, 0, 0, 0, 4, step=2, folded=3)
    assert cov.epochs[0].unique == 4
    assert not cov.pending.get(0)


def test_record_batch_of_zero_samples_is_nothing():
    cov = _ledger()
    record_batch(cov, 0, 0, 0, 0, step=1, folded=0)
    assert not cov.pending.get(0)


def test_discard_counts_trained_and_thrown_away():
    cov = _ledger()
    record_batch(cov, 2, 0, 10, 4, step=5, folded=0)
    record_batch(cov, 2, 0, 14, 2, step=6, folded=0)
    assert discard(cov, 2) == 6
    assert cov.epochs[0].discarded == 6
    assert 2 not in cov.pending
    assert discard(cov, 2) == 0


def test_uncommitted_returns_holes_as_contiguous_ranges():
    cov = _ledger()
    record_batch(cov, 0, 0, 2, 3, step=1, folded=0)
    record_batch(cov, 0, 0, 8, 1, step=2, folded=0)
    commit(cov, 0, 2)
    assert uncommitted(cov, 0, [(0, 10)]) == [(0, 2), (5, 3), (9, 1)]
    assert uncommitted(cov, 0, [(2, 3)]) == []
    assert uncommitted(cov, 0, [(12, 3), (0, 1)]) == [(12, 3), (0, 1)]


def test_is_complete_and_summary():
    cov = _ledger(6)
    record_batch(cov, 0, 0, 0, 6, step=1, folded=0)
    assert not is_complete(cov, 0)
    assert epoch_summary(cov.epochs[0])["missing"] == 6
    commit(cov, 0, 1)
    assert is_complete(cov, 0)
    assert summary(cov) == [
        {"epoch": 0, "expected": 6, "trained": 6, "duplicates": 0, "missing": 0, "discarded": 0}
    ]
    assert not is_complete(cov, 1)


def test_freeze_releases_bitmap_and_keeps_counters():
    cov = _ledger(4)
    record_batch(cov, 0, 0, 0, 4, step=1, folded=0)
    commit(cov, 0, 1)
    record_batch(cov, 1, 0, 0, 2, step=1, folded=0)  # a re-trained, never-folded batch
    freeze(cov, 0)
    ec = cov.epochs[0]
    assert ec.frozen and len(ec.committed) == 0
    assert (ec.unique, ec.trained, ec.duplicates) == (4, 6, 2)
    assert cov.pending[1] == []


def _counted_pending(cov):
    """Each epoch's ``pending`` counter against a count of the lists (its definition)."""
    for e, ec in cov.epochs.items():
        assert ec.pending == sum(it[0] == e for items in cov.pending.values() for it in items), e


class _NoWalk(dict):
    """Pending lists that fail the test if anything walks them all."""

    def items(self):
        raise AssertionError("the pending lists were walked")


def test_the_pending_counter_follows_every_move_and_freeze_walks_only_when_needed():
    cov = _ledger(8)
    open_epoch(cov, 1, 8)
    record_batch(cov, 0, 0, 0, 4, step=1, folded=0)
    record_batch(cov, 0, 1, 0, 2, step=2, folded=0)  # the next epoch's, streamed in
    record_batch(cov, 1, 0, 4, 4, step=1, folded=0)
    record_batch(cov, 2, 1, 2, 2, step=1, folded=0)
    record_batch(cov, 3, 1, 4, 2, step=5, folded=9)  # folded already: never pending
    _counted_pending(cov)
    assert (cov.epochs[0].pending, cov.epochs[1].pending) == (2, 2)
    commit(cov, 0, 1)
    _counted_pending(cov)
    assert discard_upto(cov, 2, 1) == [(1, 2, 2)]
    _counted_pending(cov)
    commit(cov, 1, 1)
    _counted_pending(cov)
    assert cov.epochs[0].pending == 0 and is_complete(cov, 0)
    lists = cov.pending
    cov.pending = _NoWalk(lists)
    freeze(cov, 0)  # nothing of epoch 0 pending: no list is walked, epoch 1's batch stays
    cov.pending = lists
    assert cov.pending[0] == [(1, 0, 2, 2)]
    assert (cov.epochs[0].trained, cov.epochs[0].duplicates) == (8, 0)
    record_batch(cov, 1, 1, 0, 2, step=2, folded=1)
    assert discard(cov, 1) == 2
    _counted_pending(cov)
    assert cov.epochs[1].pending == 1


def _commit_batch_by_batch(cov, rank, step):
    """The ledger's rule, one batch at a time: what ``commit`` must leave, run or no run."""
    keep, done = [], 0
    for epoch, offset, samples, s in cov.pending.get(rank, []):
        if s > step:
            keep.append((epoch, offset, samples, s))
            continue
        ec = cov.epochs[epoch]
        ec.pending -= 1
        dup = sum(ec.committed[offset : offset + samples])
        ec.committed[offset : offset + samples] = b"\x01" * samples
        ec.unique, ec.trained, ec.duplicates = ec.unique + samples - dup, ec.trained + samples, ec.duplicates + dup
        done += samples
    cov.pending[rank] = keep
    return done


def _ledger_state(cov):
    return ({e: (bytes(ec.committed), ec.unique, ec.trained, ec.duplicates, ec.pending) for e, ec in cov.epochs.items()},
            {r: list(items) for r, items in cov.pending.items()})  # fmt: skip


def test_an_ack_commits_runs_of_batches_as_it_would_commit_each():
    # A chunk's batches follow on (each starts where the last ended) and are marked as one
    # run; batches that overlap, repeat, skip, change epoch or come late are not. The
    # counters, bitmaps and pending lists must read as a commit batch by batch leaves them.
    rng = random.Random(11)
    for _ in range(300):
        ours, ref = _ledger(64), _ledger(64)
        for cov in (ours, ref):
            open_epoch(cov, 1, 64)
        for rank in (0, 1):
            offset, epoch = rng.randrange(64), rng.choice((0, 1))
            for step in range(1, rng.randrange(2, 14)):
                if rng.random() < 0.25:  # a jump, a repeat or an overlap
                    offset, epoch = rng.randrange(60), rng.choice((0, 1))
                n = rng.randint(1, 4)
                if offset + n > 64:
                    offset = 64 - n
                late = step if rng.random() < 0.9 else max(1, step - rng.randint(1, 3))
                for cov in (ours, ref):
                    record_batch(cov, rank, epoch, offset, n, step=late, folded=0)
                offset += n
        for rank, ack in ((0, rng.randint(0, 14)), (1, rng.randint(0, 14)), (0, 14)):
            assert commit(ours, rank, ack) == _commit_batch_by_batch(ref, rank, ack)
            assert _ledger_state(ours) == _ledger_state(ref)


def test_e2e_committed_means_acked():
    # Nothing is committed before the first round finishes; everything is after the run.
    c = Cluster(policy="sync", world_size=2, total=16, batch_size=4, epochs=1)
    c.join_all()
    for r in (0, 1):
        while c.deliver_one(r):
            pass
        c.train_one(r)
    assert c.state.coverage.epochs[0].unique == 0
    res = c.run()
    assert res.summary["coverage"] == [
        {"epoch": 0, "expected": 16, "trained": 16, "duplicates": 0, "missing": 0, "discarded": 0}
    ]
