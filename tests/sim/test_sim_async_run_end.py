"""Async's end on unequal ranks: nobody idles through it while one rank finishes.

In the run's last pool (``_chunk_pool._share``) a rank that asks takes its share of what
is left by count, not a whole window: before, the first to ask held most of the end while
the slow ranks idled 100-330 ms of a 1.5 s run (1,1,2,3,5,8, simulated). Cadence takes the
same share when its last window has no plan pinned (the ranks ran ahead into it); a
pinned one, split by time, is ``tests/unit/core/test_last_window_balance.py``'s.)

Virtual time (``flodl.sim``): the scheduler's decisions, not this machine's speed. Every
rank's last batch must end within one of the slowest rank's batches of the run's end, and
every sample is trained exactly once."""

from __future__ import annotations

import pytest

from flodl.core.cadence._chunk_pool import compute_chunk_batches, compute_chunk_batches_each
from flodl.sim import SimConfig, batch_ends, simulate

SLOW = (1, 1, 2, 3, 5, 8)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_every_rank_trains_until_about_the_end(seed):
    ms = tuple(1.5 + 10.0 * f for f in SLOW)
    res = simulate(SimConfig(ms_per_batch=ms, total_samples=4096, batch_size=32, epochs=3, policy="async", seed=seed))
    assert res.finished is not None and res.finished.ok
    assert all(c["duplicates"] == 0 and c["missing"] == 0 for c in res.summary["coverage"])
    last: dict[int, float] = {}
    for ev, end in batch_ends(res.events):
        last[ev.rank] = end
    slowest_batch_s = max(ms) * 1.05 / 1e3  # (the simulator's 5 % jitter)
    tails = {r: res.virtual_s - t for r, t in last.items()}
    assert max(tails.values()) < slowest_batch_s, tails


def _sizes(rank, rem, drains_run, counts=(50, 10), barrier_paced=False):
    return compute_chunk_batches(rank, remaining_samples=rem, counts=list(counts), batch_size=1,
                                 barrier_paced=barrier_paced, calibrated=True, total_samples=600,
                                 drains_run=drains_run)  # fmt: skip


@pytest.mark.parametrize("barrier_paced", [False, True], ids=["async", "cadence"])
def test_a_rank_takes_its_share_of_the_runs_last_pool_and_a_window_of_another(barrier_paced):
    # Scenario 46's schedule (counts [50, 10]), 59 left: in an epoch that more follow, each
    # rank its window, as the reference (what it does not take streams on); in the run's
    # last pool, its share by count, rounded up. Cadence too, when no final-window plan is
    # pinned (the ranks ran ahead into the last window): before, a fast rank topped up
    # there took min(its count, what is left) and trained the end alone.
    def sizes(rank, rem, drains_run):
        return _sizes(rank, rem, drains_run, barrier_paced=barrier_paced)

    assert [sizes(r, 59, False) for r in (0, 1)] == [50, 10]
    assert [sizes(r, 59, True) for r in (0, 1)] == [50, 10]  # ceil(59 x 50/60), ceil(59 x 10/60)
    assert [sizes(r, 30, True) for r in (0, 1)] == [25, 5]
    assert [sizes(r, 30, False) for r in (0, 1)] == [30, 10]  # (more epochs follow: the edge rule)
    assert [sizes(r, 14, True) for r in (0, 1)] == [12, 3]
    assert [sizes(r, 1, True) for r in (0, 1)] == [1, 1]  # never 0 while something is left
    # The bulk sizing (a window start) decides the same.
    for rem in (1, 7, 14, 30, 59):
        each = compute_chunk_batches_each([0, 1], [0, 0], [0, 0], remaining_samples=rem, counts=[50, 10],
                                          counts_total=60, batch_size=1, barrier_paced=barrier_paced,
                                          calibrated=True, total_samples=600, drains_run=True)  # fmt: skip
        assert each == [sizes(r, rem, True) for r in (0, 1)]


def test_a_pinned_final_window_plan_still_decides_the_cadence_share():
    # The plan's split (by time, ``balance_last_window``) wins over the share by count.
    n = compute_chunk_batches(0, remaining_samples=30, counts=[50, 10], batch_size=1, barrier_paced=True,
                              calibrated=True, total_samples=600, final_alloc=[27, 3], drains_run=True)  # fmt: skip
    assert n == 27
