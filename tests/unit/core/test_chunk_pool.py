"""ChunkPool and dispatch math (spec §5.6, §8.2-8.9; scenarios 42-48 and 52-57)."""

import random

import pytest

from flodl.core.cadence._chunk_pool import (
    ChunkPool,
    FinalWindowPlan,
    compute_chunk_batches,
    consolidate_lone_ones,
    equal_sizes,
    explain_chunk_batches,
    fastest_alive_rank,
    final_window_alloc,
    refresh_final_window_plan,
    reservation_span_sizes,
)
from flodl.core.cadence._elche import ElChe
from flodl.core.cadence._guards import NudgeDown, Stable, SuppressGrowth
from flodl.core.cadence._overshoot import OvershootBudget, barrier_paced, reduce_step_budget

ALL3 = [True, True, True]


def sizing(el, pool, rank, policy, *, bs=1, total=100, steps=0, plan=None, overshoot=3):
    counts = el.batch_counts
    return explain_chunk_batches(
        rank,
        remaining_samples=pool.remaining(),
        counts=counts,
        batch_size=bs,
        barrier_paced=barrier_paced(policy),
        calibrated=el.calibrated or el.has_speed_hint(),
        total_samples=total,
        steps=steps,
        budget=reduce_step_budget(counts[rank], policy, overshoot),
        final_alloc=plan.alloc if plan is not None else None,
    )


# --- F. ChunkPool -------------------------------------------------------------------


# Scenario 52
def test_pool_equal_spans_take_from_own_span_front():
    pool = ChunkPool(0, 1000, 2)
    assert pool.remaining() == 1000 and not pool.is_epoch_done()
    assert pool.take_chunk(0, 300) == (0, 300)
    assert pool.take_chunk(1, 200) == (500, 200)
    assert pool.remaining() == 500
    assert pool.reservation(0) == (300, 200)
    assert pool.reservation(1) == (700, 300)


# Scenario 53
def test_pool_steal_from_largest_residue_tail():
    pool = ChunkPool.with_spans(0, 100, [70, 30])
    assert pool.take_chunk(1, 30) == (70, 30)
    assert pool.take_chunk(1, 20) == (50, 20)
    assert pool.reservation(0) == (0, 50)
    assert pool.take_chunk(0, 60) == (0, 50)
    assert pool.take_chunk(0, 10) is None and pool.remaining() == 0
    pool.mark_completed(0, 50)
    pool.mark_completed(1, 50)
    assert pool.is_epoch_done()


def test_pool_steal_ties_go_to_highest_rank():
    pool = ChunkPool(0, 90, 3)
    assert pool.take_chunk(0, 30) == (0, 30)
    assert pool.take_chunk(0, 5) == (85, 5)  # ranks 1 and 2 tie at 30: rank 2 donates


def _brute_donor(pool, rank):
    """The donor a steal must pick, by a walk over every span (the reference)."""
    donor, best = None, 0
    for r in range(pool.world_size):
        if r != rank and pool.residue(r) >= best and pool.residue(r) > 0:
            donor, best = r, pool.residue(r)
    return donor


@pytest.mark.parametrize("seed", range(6))
def test_pool_kept_sums_and_steal_heap_agree_with_a_walk(seed):
    # remaining() is kept and a steal finds its donor in a lazy heap: under random takes,
    # rollbacks, forfeits, reopens and completions both agree with a walk over the spans.
    rng = random.Random(seed)
    ws = rng.randint(2, 9)
    spans = [rng.randint(0, 40) for _ in range(ws)]
    pool = ChunkPool.with_spans(0, sum(spans), spans)
    taken: list[tuple[int, int, int]] = []
    steals = 0
    for _ in range(300):
        op, rank = rng.random(), rng.randrange(ws)
        if op < 0.7:
            own = pool.residue(rank) > 0 or bool(pool.reclaimed())
            want = None if own else _brute_donor(pool, rank)
            got = pool.take_chunk(rank, rng.randint(1, 12))
            if not own and want is None:
                assert got is None
            elif not own:
                steals += 1
                assert got is not None and got[0] == pool.reservation(want)[0] + pool.residue(want)
            if got is not None and got[1] > 0:
                taken.append((rank, *got))
        elif op < 0.8 and taken:
            pool.rollback_take(*taken.pop(rng.randrange(len(taken))))
        elif op < 0.87:
            pool.forfeit(rank)
        elif op < 0.94 and taken:
            r, off, n = taken.pop(rng.randrange(len(taken)))
            pool.reopen(r, [(off, n)])
        else:
            pool.mark_completed(rank, rng.randint(0, 10))
        pool.check_sums()
        assert pool.remaining() == sum(pool.residue(r) for r in range(ws)) + sum(n for _, n in pool.reclaimed())
    assert steals > 0


# Scenario 54
def test_pool_forfeit_reclaims_in_flight_for_survivors():
    pool = ChunkPool(0, 100, 2)
    pool.take_chunk(0, 50)
    pool.take_chunk(1, 50)
    pool.mark_completed(1, 50)
    assert pool.forfeit(1) == 0
    assert pool.forfeit(0) == 50
    assert pool.remaining() == 50 and pool.in_flight(0) == 0
    assert not pool.is_epoch_done()
    assert pool.take_chunk(1, 50) == (0, 50)
    pool.mark_completed(1, 50)
    assert pool.is_epoch_done()


# Scenario 54
def test_pool_forfeit_split_retakes_then_own_span():
    pool = ChunkPool(0, 100, 2)
    pool.take_chunk(0, 50)
    assert pool.forfeit(0) == 50
    assert pool.take_chunk(1, 25) == (0, 25)
    assert pool.take_chunk(1, 25) == (25, 25)
    assert pool.take_chunk(1, 25) == (50, 25)
    assert pool.remaining() == 25


def test_pool_forfeit_keeps_dispatch_order():
    pool = ChunkPool(0, 100, 2)
    pool.take_chunk(0, 30)
    pool.take_chunk(0, 20)
    assert pool.in_flight(0) == 50 and pool.forfeit(0) == 50
    assert pool.remaining() == 100
    assert pool.take_chunk(1, 30) == (0, 30)
    assert pool.take_chunk(1, 20) == (30, 20)


def test_pool_reopen_returns_exactly_the_uncommitted_positions():
    # Rank 0 completed (0,30), then took (30,20) and trained 10 of it; only (0,10) and
    # (30,10) were folded before it died. The pool must hand out (10,20), (40,10) -- the
    # trained-but-discarded (10,20) included -- and nothing committed.
    pool = ChunkPool(0, 100, 2)
    pool.take_chunk(0, 30)
    pool.mark_completed(0, 30)
    pool.take_chunk(0, 20)
    pool.mark_completed(0, 10)
    assert pool.reopen(0, [(10, 20), (40, 10)]) == 30
    assert pool.in_flight(0) == 0 and pool.outstanding(0) == ()
    assert pool.reclaimed() == ((10, 20), (40, 10))
    assert pool.remaining() == 50 + 30
    assert pool.take_chunk(1, 25) == (10, 20)
    assert pool.take_chunk(1, 25) == (40, 10)
    assert pool.take_chunk(1, 25) == (50, 25)
    assert pool.uncovered_ranges() == [(10, 20), (40, 60)]  # in flight is uncovered
    assert pool.reopen(0, []) == 0  # idempotent


def test_pool_reopen_without_holes_keeps_committed_in_flight_work_done():
    pool = ChunkPool(0, 20, 1)
    pool.take_chunk(0, 20)
    assert pool.reopen(0, []) == 0  # every trained position of the chunk was committed
    assert pool.is_epoch_done() and pool.uncovered_ranges() == []


# Scenario 55
def test_pool_rollback_rewinds_cursor():
    pool = ChunkPool(0, 100, 2)
    off, n = pool.take_chunk(0, 40)
    assert pool.rollback_take(0, off, n)
    assert pool.remaining() == 100 and pool.in_flight(0) == 0 and pool.chunks_sent[0] == 0
    assert pool.take_chunk(0, 40) == (0, 40)


# Scenario 55
def test_pool_rollback_of_older_take_goes_to_reclaimed_first():
    pool = ChunkPool(0, 100, 2)
    off, n = pool.take_chunk(0, 20)
    pool.take_chunk(0, 20)
    assert pool.rollback_take(0, off, n)
    assert pool.remaining() == 100 - 40 + 20
    assert pool.in_flight(0) == 20 and pool.chunks_sent[0] == 1
    assert pool.take_chunk(1, 20) == (0, 20)  # served to anyone, before rank 1's span


def test_pool_rollback_unknown_chunk_is_noop():
    pool = ChunkPool(0, 100, 2)
    pool.take_chunk(0, 40)
    assert not pool.rollback_take(0, 50, 10)
    assert not pool.rollback_take(0, 0, 0)
    assert pool.in_flight(0) == 40 and pool.chunks_sent[0] == 1 and pool.remaining() == 60


# Scenario 56
def test_pool_completion_after_forfeit_clamps_and_survivor_drains():
    pool = ChunkPool(0, 100, 2)
    pool.take_chunk(0, 40)
    pool.forfeit(0)
    pool.mark_completed(0, 40)  # falsely declared dead, reports anyway
    assert pool.in_flight(0) == 0 and pool.completed[0] == 0
    assert pool.take_chunk(1, 40) == (0, 40)
    pool.mark_completed(1, 40)
    assert pool.take_chunk(1, 60) == (50, 50)
    pool.mark_completed(1, 50)
    assert pool.take_chunk(1, 60) == (40, 10)
    pool.mark_completed(1, 10)
    assert pool.is_epoch_done()


# Scenario 57
def test_pool_uncovered_ranges_and_from_coverage():
    assert ChunkPool(0, 100, 2).uncovered_ranges() == [(0, 100)]
    pool = ChunkPool(0, 100, 2)
    pool.take_chunk(0, 30)
    assert pool.take_chunk(1, 20) == (50, 20)
    pool.mark_completed(0, 30)
    assert pool.uncovered_ranges() == [(30, 70)]

    resumed = ChunkPool.from_coverage(0, 100, 3, [(30, 36), (76, 24)])
    assert resumed.remaining() == 60 and not resumed.is_epoch_done()
    covered = [0] * 100
    while resumed.remaining() > 0:
        for r in range(3):
            got = resumed.take_chunk(r, 15)
            if got and got[1] > 0:
                for i in range(got[0], got[0] + got[1]):
                    covered[i] += 1
                resumed.mark_completed(r, got[1])
    assert resumed.is_epoch_done()
    assert covered == [1 if 30 <= i < 66 or 76 <= i < 100 else 0 for i in range(100)]
    assert ChunkPool.from_coverage(0, 100, 2, []).is_epoch_done()


def test_pool_uncovered_includes_reclaimed():
    pool = ChunkPool(0, 100, 2)
    pool.take_chunk(0, 40)
    pool.take_chunk(1, 20)
    pool.mark_completed(1, 20)
    pool.forfeit(0)
    assert pool.uncovered_ranges() == [(0, 50), (70, 30)]


def test_pool_edge_cases():
    assert ChunkPool(0, 0, 2).is_epoch_done()
    assert ChunkPool(0, 0, 2).take_chunk(0, 10) is None
    pool = ChunkPool(0, 100, 2)
    assert pool.take_chunk(0, 0) == (0, 0) and pool.remaining() == 100
    pool.take_chunk(0, 40)
    pool.mark_completed(0, 25)  # partial completion shrinks the front range
    assert pool.outstanding(0) == ((25, 15),) and pool.in_flight(0) == 15
    with pytest.raises(ValueError):
        ChunkPool.with_spans(0, 10, [3, 3])
    with pytest.raises(ValueError):
        pool.take_chunk(0, -1)


# --- E. dispatch math --------------------------------------------------------------


# Scenario 42 (pool half): uncalibrated E(2,4), total 100, bs 1 -> equal spans, first
# chunks of one window each, and the advisories each rank receives.
def test_progressive_cold_start_spans_chunks_and_advisories():
    el = ElChe(2, 4)
    spans = reservation_span_sizes(100, 1, el.batch_counts, calibrated=False)
    assert spans == [50, 50]
    pool = ChunkPool.with_spans(0, 100, spans)
    sizes = [sizing(el, pool, r, "cadence")[0] for r in range(2)]  # all sized before taking
    assert sizes == [4, 4]
    assert el.batch_counts == [4, 4]
    assert pool.take_chunk(0, 4) == (0, 4)
    assert pool.take_chunk(1, 4) == (50, 4)


# Scenario 43 (pool half): after the first reduce counts are [8, 4]; the folded chunks
# continue each rank's own span: Update{1, Some{0, 4, 8}} and Update{1, Some{0, 54, 4}}.
def test_progressive_first_reduce_folds_next_window():
    el = ElChe(2, 4)
    pool = ChunkPool.with_spans(0, 100, [50, 50])
    pool.take_chunk(0, 4)
    pool.take_chunk(1, 4)
    pool.mark_completed(0, 4)
    pool.mark_completed(1, 4)
    el.report_timing([30.0, 60.0], [3, 3], 0.0)  # marginal delivered [10, 20] ms
    assert el.batch_counts == [8, 4]
    folds = []
    for r in range(2):
        n = sizing(el, pool, r, "cadence")[0]
        folds.append(pool.take_chunk(r, n))
    assert folds == [(4, 8), (54, 4)]


# Scenario 44 (pool half): a headless kickoff takes and rolls back every first chunk.
def test_progressive_kickoff_rollback_leaves_pool_untouched():
    pool = ChunkPool.with_spans(0, 100, [50, 50])
    for r in range(2):
        off, n = pool.take_chunk(r, 4)
        assert pool.rollback_take(r, off, n)
    assert pool.remaining() == 100 and not pool.is_epoch_done()
    assert pool.chunks_sent == [0, 0]


# Scenario 45
def test_fold_mid_epoch_takes_one_window_per_rank():
    el = ElChe(2, 10)
    el.report_timing([500.0, 1000.0], [10, 10], 10.0)
    assert el.batch_counts == [20, 10]
    pool = ChunkPool(0, 1000, 2)
    n, why = sizing(el, pool, 0, "cadence", total=1000)
    assert (n, why) == (20, "schedule-exact: one chunk is one window")
    assert pool.take_chunk(0, 20) == (0, 20)
    assert pool.take_chunk(1, sizing(el, pool, 1, "cadence", total=1000)[0]) == (500, 10)
    drained = ChunkPool(0, 0, 2)
    assert sizing(el, drained, 0, "cadence") == (0, "pool empty")


# Scenario 46
def test_async_tail_is_share_capped():
    el = ElChe(2, 10)
    for _ in range(5):
        el.report_timing([200.0, 1000.0], [10, 10], 10.0)
    assert el.batch_counts == [50, 10]
    pool = ChunkPool(0, 59, 2)
    sizes = [sizing(el, pool, r, "async", total=59) for r in range(2)]
    assert [s for s, _ in sizes] == [50, 10]
    assert all("edge" in why for _, why in sizes)


# Scenario 47
def test_cadence_final_window_has_no_lone_one():
    el = ElChe(3, 10)
    for _ in range(5):
        el.report_timing([200.0, 900.0, 1000.0], [10, 10, 10], 10.0)
    assert el.batch_counts == [45, 10, 9]
    pool = ChunkPool(0, 63, 3)
    plan = refresh_final_window_plan(
        None, epoch=0, remaining_batches=63, counts=el.batch_counts, alive=ALL3, barrier_paced=True
    )
    sizes = [sizing(el, pool, r, "cadence", total=63, plan=plan)[0] for r in range(3)]
    assert sizes == [44, 10, 9]  # (derived) largest remainder of 63 over 45:10:9
    assert sum(sizes) == 63 and 1 not in sizes and sizes[0] == max(sizes)


# Scenario 48
def test_final_window_alloc_cases():
    counts = [71, 18, 15]
    alloc = final_window_alloc(72, counts, ALL3)
    assert sum(alloc) == 72 and 1 not in alloc and alloc[0] > max(alloc[1], alloc[2])
    for rem in range(3, 21):
        alloc = final_window_alloc(rem, counts, ALL3)
        assert sum(alloc) == rem and 1 not in alloc, (rem, alloc)
    alloc = final_window_alloc(106, counts, ALL3)
    assert alloc[0] == 71 and alloc[1] + alloc[2] == 35
    alloc = final_window_alloc(40, counts, [True, False, True])
    assert alloc[1] == 0 and sum(alloc) == 40 and 1 not in alloc
    assert sum(final_window_alloc(1, counts, ALL3)) == 1
    assert consolidate_lone_ones([1, 1, 0], ALL3) == [0, 2, 0]
    out = consolidate_lone_ones([2, 1, 1], ALL3)
    assert 1 not in out and sum(out) == 4


def _lone_ones_by_walking(alloc, alive):
    """The rule as §8.7 words it, one walk per orphan (the O(N^2) oracle)."""
    out = list(alloc)
    while True:
        orphan = next((r for r in range(len(out)) if alive[r] and out[r] == 1), None)
        if orphan is None:
            return out
        peers = [p for p in range(len(out)) if p != orphan and alive[p] and out[p] >= 1]
        if not peers:
            return out
        peer = min(peers, key=lambda p: out[p])
        out[peer] += 1
        out[orphan] = 0


def test_consolidate_lone_ones_matches_the_walk():
    rng = random.Random(7)
    for _ in range(400):
        n = rng.randint(1, 12)
        alloc = [rng.choice((0, 1, 1, 1, 2, 3, 5)) for _ in range(n)]
        alive = [rng.random() < 0.8 for _ in range(n)]
        assert consolidate_lone_ones(alloc, alive) == _lone_ones_by_walking(alloc, alive), (alloc, alive)


def test_final_window_fold_band_lone_survivor_and_fastest():
    assert final_window_alloc(10, [4, 4], [True, False]) == [10, 0]
    assert fastest_alive_rank([71, 18, 15], [False, True, True]) == 1
    assert fastest_alive_rank([5, 5], [True, True]) == 0
    assert final_window_alloc(0, [4, 4], [True, True]) == [0, 0]


def test_final_window_plan_pins_and_repins():
    kw = dict(epoch=0, counts=[8, 4], alive=[True, True], barrier_paced=True)
    assert refresh_final_window_plan(None, remaining_batches=14, **kw) is None  # >= 12 + 2
    assert refresh_final_window_plan(None, remaining_batches=0, **kw) is None
    plan = refresh_final_window_plan(None, remaining_batches=13, **kw)
    assert plan == FinalWindowPlan(0, (8, 5), (8, 4), (True, True))
    # Pinned: the live remainder drains, the split holds.
    assert refresh_final_window_plan(plan, remaining_batches=5, **kw) is plan
    # A schedule change or a death makes the pin stale: re-pin from live values.
    kw2 = {**kw, "alive": [False, True]}
    assert refresh_final_window_plan(plan, remaining_batches=5, **kw2).alloc == (0, 5)
    async_kw = {**kw, "barrier_paced": False}
    assert refresh_final_window_plan(plan, remaining_batches=13, **async_kw) is None


def test_chunk_sizing_probe_proportional_and_budget_cap():
    base = dict(batch_size=1, total_samples=1000)
    n, why = explain_chunk_batches(
        0, remaining_samples=1000, counts=[4, 4], barrier_paced=False, calibrated=False, **base
    )
    assert (n, why) == (50, "uncalibrated probe")  # 1000 // (2*10*1)
    n, why = explain_chunk_batches(
        0, remaining_samples=1000, counts=[30, 10], barrier_paced=False, calibrated=True,
        steps=20, budget=33, **base
    )
    assert (n, why) == (13, "proportional to the schedule")  # ceil(750) capped at 33 - 20
    assert compute_chunk_batches(
        1, remaining_samples=1000, counts=[30, 1], barrier_paced=False, calibrated=True, **base
    ) == 33  # ceil(1000 / 31) = 33 (above the floor of 4)
    assert compute_chunk_batches(
        0, remaining_samples=10, counts=[0, 0], barrier_paced=False, calibrated=True, **base
    ) == 4


# --- §8.2 partitions -----------------------------------------------------------------


def test_partition_helpers():
    assert equal_sizes(2, 10) == [5, 5]  # scenario 36
    assert equal_sizes(3, 10) == [4, 3, 3]


def test_reservation_span_sizes_calibrated_and_round_robin():
    assert reservation_span_sizes(1000, 1, [20, 10], calibrated=True) == [667, 333]
    assert reservation_span_sizes(100, 4, [4, 4, 4], calibrated=False) == [36, 32, 32]
    assert sum(reservation_span_sizes(96, 4, [7, 3, 1], calibrated=True)) == 96


# --- §5.6 overshoot budget -----------------------------------------------------------


def test_reduce_step_budget_by_policy():
    assert reduce_step_budget(8, "cadence", 3) == 8
    assert reduce_step_budget(8, "sync", 3) == 8
    assert reduce_step_budget(8, "async", 3) == 11
    assert reduce_step_budget(0, "async", 3) == 0
    with pytest.raises(ValueError):
        reduce_step_budget(1, "whenever")


def test_overshoot_older_rule():
    b = OvershootBudget()
    assert b.max_overshoot == 3
    for _ in range(20):
        b.on_verdict(Stable(), "async")
    assert b.max_overshoot == 15  # ceiling
    change = b.on_verdict(SuppressGrowth(), "async")
    assert (change.before, change.after) == (15, 15)
    assert b.on_verdict(NudgeDown(0.5), "async").after == 3
    assert b.on_verdict(Stable(), "cadence").after == 3  # only Async moves it
    fixed = OvershootBudget(auto=False)
    assert fixed.on_verdict(Stable(), "async").after == 3
    assert fixed.budget(10, "async") == 13
