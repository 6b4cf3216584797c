"""ElChe formulas (spec §6; scenarios 20-27, plus the ElChe halves of 1, 5, 7-9, 43, 45, 46,
79, 81 and 82, whose coordinator halves belong to other modules)."""

import json
import math

import pytest

from flodl.core.cadence._elche import ElChe, Grow, Phase, round_half_away
from flodl.core.cadence._guards import NudgeDown, Stable, SuppressGrowth
from flodl.core.cadence._window import WindowLedger, delivered_capable


def _staged_grow_20():
    """E(2,10) with a Grow(20) staged the way report_timing stages it (scenario 21)."""
    el = ElChe(2, 10)
    el.report_timing([1000.0, 1000.0], [10, 10], 5000.0)
    el.report_timing([1000.0, 1000.0], [10, 10], 5000.0)
    assert el.proposed_anchor == Grow(20)
    return el


# Scenario 20
def test_verdict_nudge_down_halves_and_latches_growth_off():
    el = ElChe(2, 10)
    el.apply_verdict(NudgeDown(0.5))
    assert el.anchor == 5
    assert not el.growth_enabled


# Scenario 20
def test_verdict_nudge_discards_staged_grow_before_a_later_stable():
    el = _staged_grow_20()
    el.apply_verdict(NudgeDown(0.5))
    el.apply_verdict(Stable())
    assert el.anchor == 5
    assert el.batch_counts == [5, 5]


# Scenario 20
def test_verdict_stable_relax_up_drifts_one():
    el = ElChe(2, 10)
    el.apply_verdict(Stable(relax_up=True))
    assert el.anchor == 11
    el = ElChe(2, 10)
    el.apply_verdict(Stable(relax_up=False))
    assert el.anchor == 10


# Scenario 20
def test_verdict_suppress_growth_vetoes_for_good():
    el = _staged_grow_20()
    el.apply_verdict(SuppressGrowth())
    assert el.anchor == 10
    el.apply_verdict(Stable())
    assert el.anchor == 10


def test_verdict_stable_commits_staged_grow():
    el = _staged_grow_20()
    el.apply_verdict(Stable())
    assert el.anchor == 20
    assert el.batch_counts == [20, 20]


# Scenario 21
def test_warmup_growth_second_calibration_proposes_capped_grow():
    el = ElChe(2, 10)
    el.report_timing([1000.0, 1000.0], [10, 10], 5000.0)
    assert el.proposed_anchor is None  # the first report never proposes
    assert el.phase == Phase.WARMUP
    el.report_timing([1000.0, 1000.0], [10, 10], 5000.0)
    assert el.phase == Phase.WARMUP
    # overhead 5000 / (10*100 + 5000) = 0.833 > 0.10 warm-up bar; scale capped at 2.
    assert el.proposed_anchor == Grow(20)
    el.apply_verdict(Stable())
    assert el.anchor == 20


# Scenario 21
def test_warmup_growth_veto_keeps_anchor():
    el = _staged_grow_20()
    el.apply_verdict(SuppressGrowth())
    assert el.anchor == 10


# Scenario 22
def test_borderline_growth_waits_for_stable():
    el = ElChe(2, 10, overhead_target=0.10)
    for _ in range(5):
        el.report_timing([1000.0, 1000.0], [10, 10], 150.0)
        # 150 / 1150 = 0.130: above the 0.10 target, below the 0.20 warm-up bar.
        assert el.proposed_anchor is None
    assert el.phase == Phase.STABLE
    el.report_timing([1000.0, 1000.0], [10, 10], 150.0)
    # (derived) scale = 0.1304 / 0.10 = 1.304 -> ceil(13.04) = 14.
    assert el.proposed_anchor == Grow(14)


# Scenario 23
def test_sync_exemption_no_window_growth():
    el = ElChe(2, 10)
    el.set_initial_anchor(0)
    el.report_timing([10.0, 10.0], [10, 10], 0.0)  # smoothed 1.0 ms on both ranks
    assert el.anchor_rank == 0 and el.smoothed_ms_per_batch(0) == 1.0
    # overhead 10 / (10*1 + 10) = 0.5
    assert el.propose_anchor(10.0) == Grow(20)
    el.window_growth_applicable = False
    grow, reason = el.explain_proposal(10.0)
    assert grow is None and "Sync" in reason


# Scenario 24
def test_growth_rearm_after_five_consecutive_stables():
    el = ElChe(2, 10)
    el.apply_verdict(SuppressGrowth())
    assert not el.growth_enabled
    for _ in range(4):
        el.apply_verdict(Stable())
        assert not el.growth_enabled
    el.apply_verdict(Stable())
    assert el.growth_enabled


def test_growth_latch_resets_streak_on_non_stable():
    el = ElChe(2, 10)
    el.apply_verdict(SuppressGrowth())
    for _ in range(4):
        el.apply_verdict(Stable())
    el.apply_verdict(NudgeDown(1.0))
    for _ in range(4):
        el.apply_verdict(Stable())
    assert not el.growth_enabled


# Scenario 25
def test_election_lowest_index_in_cohort_then_dominance_margin():
    el = ElChe(3, 10)
    el.report_timing([200.0, 900.0, 1000.0], [10, 10, 10], 10.0)
    # cohort: smoothed >= 100 * 0.85 = 85 -> ranks {1, 2}; first pick = lowest index.
    assert el.anchor_rank == 1
    assert el.batch_counts == [45, 10, 9]  # (derived) 10*90/20, 10, round(10*90/100)
    for _ in range(4):  # Warmup holds the pin
        el.report_timing([200.0, 900.0, 1000.0], [10, 10, 10], 10.0)
        assert el.anchor_rank == 1
    assert el.phase == Phase.STABLE
    el.report_timing([200.0, 900.0, 1000.0], [10, 10, 10], 10.0)
    # 6th report: 100 > 90 * 1.10 = 99 -> switch to rank 2 (derived).
    assert el.anchor_rank == 2
    assert el.batch_counts == [50, 11, 10]  # (derived) recount from slow_ms 100


def test_election_keeps_incumbent_within_margin():
    el = ElChe(2, 10)
    el.set_initial_anchor(0)
    for _ in range(6):
        el.report_timing([1000.0, 1050.0], [10, 10], 0.0)
    assert el.phase >= Phase.STABLE
    assert el.anchor_rank == 0  # 105 < 100 * 1.10


# Scenario 26
def test_window_cap_scales_down_and_suppresses_growth():
    el = ElChe(2, 10)
    el.report_timing([200.0, 1000.0], [10, 10], 10.0)
    assert el.batch_counts == [50, 10]
    el.set_max_total_batches(20)
    el.report_timing([200.0, 1000.0], [10, 10], 10.0)
    # (derived) floor(50*20/60)=16, floor(10*20/60)=3, remainder 1 to the largest.
    assert el.batch_counts == [17, 3]
    assert el.window_cap_binding
    grow, reason = el.explain_proposal(1e9)
    assert grow is None and "cap" in reason


def test_window_cap_spreads_its_rounding_remainder_over_many_ranks():
    # 1,024 ranks at the 1,2,4 pace, anchor 8: counts 32/16/8 sum 19,128 > an epoch of
    # 17,408 batches, so the cap scales them to 29/14/7 (floors) and 329 batches are left.
    # All of them went to one rank (358 instead of 29): every round then waited ~33 s for it.
    ws = 1024
    el = ElChe(ws, 8, max_total_batches=17408)
    ms = [(100.0, 200.0, 400.0)[r % 3] for r in range(ws)]
    el.report_timing([10 * m for m in ms], [10] * ws, 0.0)
    assert el.window_cap_binding and sum(el.batch_counts) == 17408
    exact = [c * 17408 / 19128 for c in (32, 16, 8)]
    for r, c in enumerate(el.batch_counts):
        assert math.floor(exact[r % 3]) <= c <= math.ceil(exact[r % 3]), (r, c)


def test_window_cap_counts_only_the_live_ranks():
    # 3 ranks in an elastic world of 256 slots, an epoch of 375 batches: the 253 empty
    # slots' counts (the anchor each) made the cap bind and cut the live windows from
    # [16, 8, 4] to [6, 3, 1] -- 2.6x the rounds. Only the live ranks count against it,
    # and only theirs are scaled when it does bind.
    ws = 256
    el = ElChe(ws, 4, max_total_batches=375)
    el.live = [r < 3 for r in range(ws)]
    ms = [100.0, 200.0, 400.0] + [0.0] * (ws - 3)
    el.report_timing(ms, [10, 10, 10] + [0] * (ws - 3), 0.0)
    assert el.batch_counts[:3] == [16, 8, 4] and not el.window_cap_binding
    el.set_max_total_batches(14)  # a cap the live ranks do exceed: theirs are scaled
    el.report_timing(ms, [10, 10, 10] + [0] * (ws - 3), 0.0)
    assert el.window_cap_binding and sum(el.batch_counts[:3]) == 14 and el.batch_counts[3:] == [4] * (ws - 3)
    el.live = None  # every slot counts (a world with all its ranks): as before, the cap binds at 375
    el.set_max_total_batches(375)
    el.report_timing(ms, [10, 10, 10] + [0] * (ws - 3), 0.0)
    assert el.window_cap_binding and sum(el.batch_counts) == 375


def test_window_cap_floor_of_one_beats_the_cap():
    el = ElChe(3, 4, max_total_batches=2)
    el.report_timing([10.0, 10.0, 10.0], [1, 1, 1], 0.0)
    assert el.batch_counts == [1, 1, 1]  # ws > T: every rank keeps a quota


# Scenario 27
def test_dead_zone_holds_counts_and_slack_applies_once():
    el = ElChe(2, 100)
    el.report_timing([1000.0, 2000.0], [10, 10], 0.0)  # smoothed [100, 200]
    assert el.batch_counts == [200, 100]
    el.report_timing([950.0, 2000.0], [10, 10], 0.0)  # smoothed r0 97.5 -> target 205
    assert el.batch_counts == [200, 100]  # |205 - 200| <= 5 % of 200: unchanged
    el.apply_callback_slack([500.0, 0.0])
    el.report_timing([950.0, 2000.0], [10, 10], 0.0)  # r0 96.67: target 207 - ceil(5.17)=6
    assert el.batch_counts == [201, 100]  # slack bypasses the dead zone
    assert el.pending_callback_slack_ms == [0.0, 0.0]  # consumed exactly once
    el.report_timing([950.0, 2000.0], [10, 10], 0.0)
    assert el.batch_counts == [201, 100]  # target 208 is within 5 % of 201


def test_max_batch_diff_throttles_one_update():
    el = ElChe(2, 10, max_batch_diff=3)
    el.report_timing([50.0, 100.0], [10, 10], 0.0)
    assert el.batch_counts == [20, 10]  # first calibration is never throttled
    el.report_timing([10.0, 100.0], [10, 10], 0.0)  # r0 smoothed 3.0 -> target 33
    assert el.batch_counts == [23, 10]


def test_speed_ratio_cap_64():
    el = ElChe(2, 1)
    el.report_timing([0.0001, 1000.0], [1, 1], 0.0)
    assert el.batch_counts == [64, 1]


def test_relax_up_refused_when_spread_would_exceed_max_batch_diff():
    el = ElChe(2, 50, max_batch_diff=100)
    el.report_timing([100.0, 300.0], [10, 10], 0.0)  # ratio 3
    assert el.batch_counts == [150, 50]
    assert not el.relax_anchor_up()  # 153 - 51 = 102 > 100
    assert el.anchor == 50
    el = ElChe(2, 10, max_anchor=10)
    assert not el.relax_anchor_up()


def test_nudge_ignores_non_finite_and_bypasses_min_anchor():
    el = ElChe(2, 10)
    el.nudge_anchor_down(math.nan)
    assert el.anchor == 10
    el.nudge_anchor_down(0.01)  # clamped to 0.1 -> ceil(1.0) = 1
    assert el.anchor == 1 < el.min_anchor


def test_min_and_max_anchor_clamp():
    el = ElChe(2, 10, max_anchor=5)
    assert (el.anchor, el.min_anchor, el.max_anchor) == (5, 5, 5)
    el = ElChe(2, 10, min_anchor=12)
    assert el.anchor == 12


def test_phases_advance_probe_warmup_stable_mature():
    el = ElChe(2, 10)
    assert el.phase == Phase.PROBE
    seen = []
    for _ in range(20):
        el.report_timing([100.0, 100.0], [10, 10], 0.0)
        seen.append(el.phase)
    assert seen[0] == Phase.WARMUP and seen[3] == Phase.WARMUP
    assert seen[4] == Phase.STABLE and seen[18] == Phase.STABLE
    assert seen[19] == Phase.MATURE


def test_dead_window_escape_re_elects_after_five_misses():
    el = ElChe(2, 10)
    el.set_initial_anchor(1)  # pinned, but rank 1 never reports
    for _ in range(4):
        assert not el.report_timing([100.0, 0.0], [10, 0], 0.0).calibrated
    cal = el.report_timing([100.0, 0.0], [10, 0], 0.0)
    assert cal.calibrated and el.anchor_rank == 0


def test_world_size_one_gets_the_anchor():
    el = ElChe(1, 7)
    el.report_timing([70.0], [7], 3.0)
    assert el.batch_counts == [7] and el.anchor_rank == 0


def test_to_state_round_trips_through_json():
    el = ElChe(3, 10)
    for _ in range(6):
        el.report_timing([200.0, 900.0, 1000.0], [10, 10, 10], 10.0)
    state = json.loads(json.dumps(el.to_state(trend_history=[0.01, 0.02])))
    assert state["phase"] == "stable" and state["trend_history"] == [0.01, 0.02]
    back = ElChe(3, 1)
    back.restore_from_state(state)
    assert back.anchor == el.anchor and back.anchor_rank == el.anchor_rank
    assert back.ms_per_batch() == pytest.approx(el.ms_per_batch())
    assert back.phase == Phase.STABLE and back.calibration_count == 6 and back.calibrated
    with pytest.raises(ValueError):
        ElChe(2, 1).restore_from_state(state)


def test_round_half_away_matches_rust():
    assert [round_half_away(x) for x in (0.5, 1.5, 2.5, 1.2, 4.4999)] == [1, 2, 3, 1, 4]


# Scenarios 1, 5, 7, 8, 9, 45, 46, 79, 81, 82: the ElChe numbers those coordinator
# scenarios are built on (derived there, asserted here).
@pytest.mark.parametrize(
    ("ws", "anchor", "wall", "batches", "sync", "reports", "counts", "anchor_rank"),
    [
        (2, 1, [10, 12], [1, 1], 0, 1, [1, 1], 1),  # 1: ratio 1.2 rounds to 1
        (2, 2, [10, 20], [2, 2], 0, 1, [4, 2], 1),  # 5
        (2, 2, [10000, 10000], [1, 1], 0, 1, [2, 2], 0),  # 7
        (2, 4, [10, 20], [2, 2], 0, 1, [8, 4], 1),  # 8
        (3, 4, [200, 1000, 1000], [4, 4, 4], 10, 1, [20, 4, 4], 1),  # 9
        (2, 10, [500, 1000], [10, 10], 10, 1, [20, 10], 1),  # 45, 79
        (2, 10, [200, 1000], [10, 10], 10, 5, [50, 10], 1),  # 46
        (3, 1, [100, 50, 200], [10, 10, 10], 0, 1, [2, 4, 1], 2),  # 81
        (3, 1, [4000, 4000, 1200], [10, 10, 10], 0, 1, [1, 1, 3], 0),  # 82
    ],
)
def test_elche_counts_for_coordinator_scenarios(
    ws, anchor, wall, batches, sync, reports, counts, anchor_rank
):
    el = ElChe(ws, anchor)
    for _ in range(reports):
        el.report_timing(wall, batches, sync)
    assert el.batch_counts == counts
    assert el.anchor_rank == anchor_rank


def test_scenario_79_anchor_wall_ms():
    el = ElChe(2, 10)
    el.report_timing([500.0, 1000.0], [10, 10], 10.0)
    assert el.anchor_wall_ms() == 1000.0


# Scenario 43 (ElChe half): four Batches per rank, r0 10 ms and r1 20 ms, on a CPU
# Cadence ledger -> the delivered (marginal) feed is [10, 20] -> counts [8, 4].
def test_delivered_feed_from_ledger_gives_scenario_43_counts():
    led = WindowLedger(2)
    for _ in range(4):
        led.record_batch(0, 10.0, 0.0)
        led.record_batch(1, 20.0, 0.0)
    el = ElChe(2, 4)
    el.report_window(led.window_report(delivered_capable=delivered_capable("cadence", "cpu")))
    assert el.ms_per_batch() == [10.0, 20.0]
    assert el.batch_counts == [8, 4]
