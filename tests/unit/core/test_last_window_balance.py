"""The run's last window split by time (``_chunk_pool.balance_last_window``) and the
run-ahead room that outlasts a slow batch (``_boundary.run_ahead_room``).

* Nothing is sized after the run's last window, so it is split to end as early as it
  can: the split ends no later than any other split of the same batches (checked
  against every split of small worlds), sums to what it was, gives a dead rank nothing,
  and counts the batches a rank still holds. An unknown pace leaves the reference split.
* Another epoch's last window keeps the reference split (no lone 1: ElChe sizes the
  next window from it).
* A rank idle at its barrier while a round waits for a slow rank's batch may run ahead
  for two of the slowest batches yet seen, even when its window (the probe's: one
  batch) is much shorter than that.
"""

from __future__ import annotations

import itertools
import random

import pytest

from flodl.core.cadence._boundary import run_ahead_room
from flodl.core.cadence._chunk_pool import balance_last_window, final_window_alloc
from flodl.core.cadence._dispatcher import _budget, _held, start_window

from .test_cadence import _pool, _state


def _ends(alloc, ms, held):
    return max((h + a) * m for a, m, h in zip(alloc, ms, held) if a or h)


def _best(rem, ms, held, alive):
    """The earliest end of any split of ``rem`` batches over the alive ranks (brute force)."""
    live = [r for r in range(len(ms)) if alive[r]]
    best = None
    for split in itertools.product(range(rem + 1), repeat=len(live)):
        if sum(split) != rem:
            continue
        alloc = [0] * len(ms)
        for r, a in zip(live, split):
            alloc[r] = a
        end = _ends(alloc, ms, held)
        best = end if best is None or end < best else best
    return best


def test_the_six_rank_rigs_last_window_ends_a_slow_batch_earlier():
    # 1,1,2,3,5,8 at 10 ms: the reference split of 13 batches by counts gives the
    # 51 ms rank two of them (a lone 1 consolidated onto it): the run ends at 102 ms.
    ms, counts, alive = [11.0, 11.0, 21.4, 31.4, 51.0, 81.0], [16, 16, 8, 5, 3, 2], [True] * 6
    ref = final_window_alloc(13, counts, alive)
    assert _ends(ref, ms, [0] * 6) > 100.0
    got = balance_last_window(ref, ms, [0] * 6, alive)
    assert sum(got) == 13
    assert _ends(got, ms, [0] * 6) == pytest.approx(55.0)  # 5 batches of the fastest
    assert got[5] == 0 and got[4] == 1


def test_the_split_is_as_early_as_any_other_on_small_worlds():
    rnd = random.Random(7)
    for _ in range(300):
        ws = rnd.randint(2, 4)
        rem = rnd.randint(1, 8)
        ms = [rnd.choice([5.0, 10.0, 11.0, 20.0, 33.0, 80.0]) for _ in range(ws)]
        held = [rnd.randint(0, 3) for _ in range(ws)]
        alive = [rnd.random() > 0.2 for _ in range(ws)]
        if sum(alive) < 2:
            continue
        counts = [rnd.randint(1, 6) for _ in range(ws)]
        ref = final_window_alloc(rem, counts, alive)
        got = balance_last_window(ref, ms, held, alive)
        assert sum(got) == rem and all(g == 0 for g, a in zip(got, alive) if not a)
        assert _ends(got, ms, held) == pytest.approx(_best(rem, ms, held, alive)), (rem, ms, held, alive, ref, got)
        assert balance_last_window(got, ms, held, alive) == got  # settled: nothing moves again


def test_no_rank_is_given_more_than_its_room_and_the_split_is_still_the_earliest():
    # Found in the simulator (seed 2 of 1,1,2,3,5,8): a share past the rank's reduce budget
    # stopped at the budget and left a batch that the 81 ms rank took last.
    rnd = random.Random(11)
    for _ in range(300):
        ws = rnd.randint(2, 4)
        rem = rnd.randint(1, 8)
        ms = [rnd.choice([5.0, 10.0, 11.0, 20.0, 33.0, 80.0]) for _ in range(ws)]
        held, alive = [rnd.randint(0, 2) for _ in range(ws)], [True] * ws
        room = [rnd.randint(0, 5) for _ in range(ws)]
        if sum(room) < rem:
            continue
        ref = final_window_alloc(rem, [rnd.randint(1, 6) for _ in range(ws)], alive)
        got = balance_last_window(ref, ms, held, alive, room)
        assert sum(got) == rem and all(g <= c for g, c in zip(got, room)), (ref, room, got)
        best = min(
            _ends(list(split), ms, held)
            for split in itertools.product(*(range(c + 1) for c in room))
            if sum(split) == rem
        )
        assert _ends(got, ms, held) == pytest.approx(best), (rem, ms, held, room, ref, got)
    # A window that does not fit the rooms is left as it was (nothing to gain by moving).
    assert balance_last_window([3, 3], [10.0, 80.0], [0, 0], [True, True], [2, 2]) == [3, 3]


def test_a_rank_still_holding_batches_gets_fewer():
    free = balance_last_window([3, 3], [10.0, 10.0], [0, 0], [True, True])
    loaded = balance_last_window([3, 3], [10.0, 10.0], [0, 4], [True, True])
    assert free == [3, 3] and loaded == [5, 1]


def test_an_unknown_pace_keeps_the_reference_split():
    assert balance_last_window([0, 4, 2], [10.0, 0.0, 80.0], [0, 0, 0], [True] * 3) == [0, 4, 2]
    # ... but a dead rank's missing pace does not matter (it gets nothing either way)
    assert balance_last_window([4, 0, 2], [10.0, 0.0, 80.0], [0, 0, 0], [True, False, True]) == [6, 0, 0]


def test_the_pinned_plan_of_the_runs_last_window_is_split_by_time():
    # Scenario 47's world, its paces 20 / 90 / 100 ms: the reference split (44, 10, 9)
    # already ends as early as any (880 / 900 / 900 ms): kept as it is.
    st = _state(3, 10, total=63, epochs=1)
    for _ in range(5):
        st.cadence.elche.report_timing([200, 900, 1000], [10, 10, 10], 10)
    _pool(st, 0, 63)
    start_window(st, 0, [0, 1, 2])
    assert st.cadence.final_plan.alloc == (44, 10, 9)
    # The slowest twice as slow: the reference split ends at 1,800 ms; by time, 1,100.
    st = _state(3, 10, total=63, epochs=1)
    for _ in range(5):
        st.cadence.elche.report_timing([200, 900, 2000], [10, 10, 10], 10)
    _pool(st, 0, 63)
    ref = final_window_alloc(63, st.cadence.elche.batch_counts, [True] * 3)
    start_window(st, 0, [0, 1, 2])
    alloc = st.cadence.final_plan.alloc
    assert sum(alloc) == 63 and _ends(alloc, [20.0, 90.0, 200.0], [0] * 3) < _ends(ref, [20.0, 90.0, 200.0], [0] * 3)


def test_another_epochs_last_window_keeps_the_reference_split():
    # Cadence without streaming ends every epoch at a barrier: ElChe sizes the next
    # window from this one, so no rank may end it on a lone batch.
    st = _state(3, 10, total=63, epochs=2)
    st.cadence.streams_epochs = False
    for _ in range(5):
        st.cadence.elche.report_timing([200, 900, 2000], [10, 10, 10], 10)
    _pool(st, 0, 63)
    start_window(st, 0, [0, 1, 2])
    assert st.cadence.final_plan.alloc == tuple(final_window_alloc(63, st.cadence.elche.batch_counts, [True] * 3))


def test_a_probe_windows_run_ahead_outlasts_the_slowest_batch():
    st = _state(2, 4, total=1000)  # uncalibrated: windows of one batch, anchor 4
    _pool(st, 0, 1000)
    st.dispatch.last_dispatched = 0
    st.ranks[0].count_batch(4, 10.0, 0.0)  # rank 0: 10 ms a batch
    st.ranks[0].last_step = 8  # its probe batch and 7 run ahead: a window's room (2 x 4) left 0
    assert run_ahead_room(st, 0) == 0
    st.cadence.slowest_batch_ms = 100.0  # rank 1's batch: the round waits up to two of them
    assert run_ahead_room(st, 0) == 1 + 20 - 8
    st.cadence.slowest_batch_ms = 20.0  # a slow batch shorter than the window room: no change
    assert run_ahead_room(st, 0) == 0


def _ran_ahead_into_the_last_window(**kw):
    # Scenario 47's world (counts [45, 10, 9], 63 left: the final-window regime), but the
    # ranks ran ahead into it: 40 / 8 / 7 steps of their windows already.
    st = _state(3, 10, total=63, epochs=1, **kw)
    for _ in range(5):
        st.cadence.elche.report_timing([200, 900, 1000], [10, 10, 10], 10)
    _pool(st, 0, 63)
    for r, s in enumerate((40, 8, 7)):
        st.ranks[r].last_step = s
    return st


def test_without_run_ahead_a_last_window_the_ranks_ran_ahead_into_past_their_budgets_is_not_pinned():
    # What is left no longer fits what their budgets leave them (5 + 2 + 2 < 63): pinned,
    # each share past a budget stopped there and the gate waited for counts the plan had
    # cut short. Not the last window: it runs by counts, and the next trigger pins the rest.
    st = _ran_ahead_into_the_last_window(run_ahead=False)
    start_window(st, 0, [0, 1, 2])
    assert st.cadence.final_plan is None


def test_with_run_ahead_the_run_ahead_last_window_is_split_by_time_and_each_share_is_its_barrier():
    # With run-ahead (the default) a rank may run a window more than its budget: what is
    # left fits, so the window is pinned and split by time (20 / 90 / 100 ms a batch: all
    # three end at about 900 ms). Held to its budget instead, the fast rank idled at its
    # barrier while the slow ones trained what it had no room for (150-200 ms of a real
    # 1,1,2,3,5,8 run). Each rank's reduce barrier is where its share ends; the gate's
    # counts are all within those, so nothing waits for a count the plan cut short.
    st = _ran_ahead_into_the_last_window()
    budgets = [_budget(st, r) for r in range(3)]
    start_window(st, 0, [0, 1, 2], extra={})  # (a short take topped up with more ranges)
    plan = st.cadence.final_plan
    assert plan is not None and sum(plan.alloc) == 63 and plan.base == (40, 8, 7)
    assert plan.alloc == (44, 10, 9)
    assert plan.ends == (84, 18, 16) and plan.ends[0] > budgets[0]
    assert [_budget(st, r) for r in range(3)] == [max(b, e) for b, e in zip(budgets, plan.ends)]
    assert all(e >= c for e, c in zip(plan.ends, st.cadence.elche.batch_counts))
    taken = [st.cadence.pools[0].in_flight(r) for r in range(3)]
    assert taken == [44, 10, 9]  # each its whole share, past its budget
    # The barrier holds at the share's end, not before.
    st.cadence.in_flight.clear()
    st.ranks[0].last_step = 83
    assert _held(st, 0) is None
    st.ranks[0].last_step = 84
    assert _held(st, 0) == "reduce barrier"
    # A trigger moves the window marks: the shares' ends no longer apply until pinned again.
    st.cadence.marks_version += 1
    assert [_budget(st, r) for r in range(3)] == budgets
