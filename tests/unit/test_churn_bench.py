"""bench/churn_plan.py: the churn campaign's schedule and measurements, on made-up data.

The numbers ``bench/elastic.py --churn`` reports are only as good as these functions:
the schedule is a function of its seed and keeps join / leave in order, a stall delays
``recovery_s`` by its length and a fault that slowed nobody reads 0, joins are timed
from the right records, and the trace audit counts a missing or a doubled sample.
"""

from __future__ import annotations

import pathlib
import sys
from collections import Counter

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "bench"))
import churn_plan as plan  # noqa: E402


def _steady(rate: float, start: float, end: float, gaps=()) -> list[float]:
    """A batch every 1/rate s in [start, end), none inside the (a, b) gaps."""
    out, t = [], start
    while t < end:
        if not any(a <= t < b for a, b in gaps):
            out.append(round(t, 6))
        t += 1.0 / rate
    return out


def test_the_schedule_is_the_seeds_and_keeps_join_and_leave_in_order():
    a = plan.draw_schedule(7, 40, 10.0)
    assert a == plan.draw_schedule(7, 40, 10.0) and a != plan.draw_schedule(8, 40, 10.0)
    gaps = [y.at_s - x.at_s for x, y in zip([plan.Fault(0.0, "")] + a, a)]
    assert all(8.0 <= g <= 12.0 for g in gaps), gaps
    kinds = Counter(f.kind for f in a)
    assert set(kinds) == set(plan.KINDS) and min(kinds.values()) >= 8, kinds  # the bag spreads them
    joined = False
    for f in a:  # a join only while the extra host is out, a leave only while it is in
        assert f.kind != "join" or not joined
        assert f.kind != "leave" or joined
        joined = {"join": True, "leave": False}.get(f.kind, joined)
        assert (f.then in ("cont", "kill")) == (f.kind == "sigstop_rank")
    only = plan.draw_schedule(1, 10, 5.0, kinds=["kill9_rank"])
    assert {f.kind for f in only} == {"kill9_rank"} and len(only) == 10
    assert len(plan.draw_schedule(1, 10, 5.0, kinds=["leave"])) == 0  # nothing to leave, ever


def test_the_victim_is_drawn_among_the_ranks_training_then():
    f = plan.Fault(1.0, "kill9_rank", pick=7)
    assert plan.pick_victim(f, [4, 0, 2]) == 2  # 7 % 3 of the sorted ranks
    assert plan.pick_victim(f, []) is None


def test_recovery_is_the_end_of_the_survivors_stall():
    # Ranks 0 and 1 train 20 batches/s; both stop for 3 s after a fault at t=10 (a barrier
    # held by a dead rank), rank 2 is the victim (it stops at 10).
    gap = [(10.5, 13.5)]
    batches = {0: _steady(20, 0, 30, gap), 1: _steady(20, 0, 30, gap), 2: _steady(20, 0, 10)}
    rates = plan.full_rates(batches)
    assert rates == {0: 20.0, 1: 20.0, 2: 20.0}
    surv = plan.survivors(batches, 10.0, struck=[2])
    assert surv == [0, 1]
    rec = plan.recovery_s(batches, surv, rates, 10.0, until=30.0)
    # The stall ended at 13.5, 3.5 s after the fault; a window counts once it holds THETA of
    # the full rate, so the reading is early by up to (1 - THETA) x W.
    assert 3.5 - (1 - plan.THETA) * plan.W - plan.GRID_S <= rec <= 3.5, rec
    # Undisturbed survivors read 0; a stall that outlasts the horizon reads None.
    calm = {0: _steady(20, 0, 30), 1: _steady(20, 0, 30)}
    assert plan.recovery_s(calm, [0, 1], plan.full_rates(calm), 10.0, until=30.0) == 0.0
    assert plan.recovery_s(batches, surv, rates, 10.0, until=13.0) is None
    # Half the pace is not full rate.
    slow = {0: _steady(20, 0, 10) + _steady(8, 10, 30)}
    assert plan.recovery_s(slow, [0], {0: 20.0}, 10.0, until=30.0) is None


def test_join_times_come_from_the_joiners_own_records():
    records = [
        {"type": "RankHello", "rank": 6, "now": 100.0, "restart_count": 0},
        {"type": "SyncAcked", "rank": 6, "now": 101.0, "step_count": 0},  # before its seed: not it
        {"type": "JoinerSeeded", "rank": 6, "now": 102.5},
        {"type": "SyncAcked", "rank": 6, "now": 103.0, "step_count": 0},  # the seed's ack folds nothing
        {"type": "SyncAcked", "rank": 6, "now": 104.0, "step_count": 5},
        {"type": "RankHello", "rank": 2, "now": 110.0, "restart_count": 3},
        {"type": "JoinerSeeded", "rank": 2, "now": 111.0},  # it dies before it commits a step ...
        {"type": "RankHello", "rank": 2, "now": 120.0, "restart_count": 4},  # ... and comes back
        {"type": "JoinerSeeded", "rank": 2, "now": 120.5},
    ]
    a, b, c = plan.join_times(records)
    assert (a["rank"], a["hello_to_seeded_s"], a["hello_to_first_commit_s"]) == (6, 2.5, 4.0)
    assert (b["rank"], b["restart_count"], b["hello_to_seeded_s"], b["hello_to_first_commit_s"]) == (2, 3, 1.0, None)
    assert (c["rank"], c["restart_count"], c["hello_to_seeded_s"], c["hello_to_first_commit_s"]) == (2, 4, 0.5, None)


def test_goodput_and_the_trace_audit():
    records = [{"type": "BatchDone", "rank": 0, "now": 10.0}, {"type": "SyncAcked", "rank": 0, "now": 30.0}]
    summary = {"coverage": [{"trained": 100, "duplicates": 0}, {"trained": 100, "duplicates": 0}]}
    assert plan.goodput(records, summary)["samples_per_s"] == 10.0
    traced = {0: Counter({s: 1 for s in range(10)}), 1: Counter({s: 1 for s in range(9)})}
    traced[0][3] += 2
    assert plan.trace_audit(traced, expected=10, epochs=2) == {"never_trained": 1, "trained_again": 2}
