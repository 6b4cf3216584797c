"""Convergence guards (spec §7.1-7.2; scenarios 28-30)."""

import math

import pytest

from flodl.core.cadence._guards import (
    DivergenceReport,
    GrowthGuard,
    LambdaEstimator,
    LevelGuard,
    MsfGuard,
    NoGuard,
    NudgeDown,
    Stable,
    SuppressGrowth,
    TrendGuard,
    make_guard,
)


def rep(*deltas):
    return DivergenceReport(deltas=deltas)


def feed(guard, values, k_used=8, k_max=4):
    return [guard.report(rep(v), k_used, k_max) for v in values]


# Scenario 28
def test_level_guard_three_rises_above_default_threshold_suppress():
    g = LevelGuard()
    assert g.threshold == 0.01
    assert feed(g, [0.011, 0.012, 0.013]) == [Stable(), Stable(), SuppressGrowth()]


# Scenario 28
def test_level_guard_rising_sequence_stable_stable_suppress():
    assert feed(LevelGuard(0.01), [0.02, 0.03, 0.04]) == [Stable(), Stable(), SuppressGrowth()]


# Scenario 28
def test_level_guard_non_rising_is_stable():
    assert feed(LevelGuard(0.01), [0.05, 0.04, 0.06])[-1] == Stable()


# Scenario 28
def test_level_guard_below_threshold_is_stable():
    assert feed(LevelGuard(0.10), [0.01, 0.02, 0.03])[-1] == Stable()


# Scenario 28
def test_level_guard_ring_capped_at_five():
    g = LevelGuard(0.01)
    feed(g, [i * 0.01 for i in range(10)])
    assert len(g.history) == 5
    assert g.trend_history() == pytest.approx([0.05, 0.06, 0.07, 0.08, 0.09])
    assert LevelGuard().with_history(range(10)).history == (5.0, 6.0, 7.0, 8.0, 9.0)


# Scenario 28
def test_level_guard_restored_history_suppresses_immediately():
    cold = LevelGuard(0.01)
    assert cold.report(rep(0.05), 8, 4) == Stable()
    warm = LevelGuard(0.01).with_history([0.02, 0.03, 0.04])
    verdict = warm.report(rep(0.05), 8, 4)
    assert verdict == SuppressGrowth()
    assert "0.05" in verdict.reason


def test_level_guard_telemetry_reset_and_empty_history():
    g = LevelGuard()
    assert g.trend_history() is None and g.telemetry() == {}
    g.report(rep(0.01, 0.03), 8, 4)
    assert g.telemetry() == {"d_history_last": 0.03}
    g.reset()
    assert g.history == ()


def test_no_guard_always_stable_no_telemetry():
    g = NoGuard()
    assert all(v == Stable() for v in feed(g, [0.5] * 10))
    assert g.telemetry() == {} and g.trend_history() is None


# Scenario 29
def test_lambda_estimator_growth_decay_floor_and_bias_correction():
    e = LambdaEstimator()
    first = e.observe(0.01, 8, 4)
    assert first.lambda_raw is None and first.lambda_ema is None
    assert e.observe(0.02, 8, 4).lambda_raw == pytest.approx(math.log(2) / 4)

    e = LambdaEstimator()
    e.observe(0.04, 8, 4)
    assert e.observe(0.02, 8, 4).lambda_raw == pytest.approx(-math.log(2) / 4)

    e = LambdaEstimator()
    e.observe(0.01, 8, 4)
    assert e.observe(1e-12, 8, 4).lambda_raw is None  # sub-floor sample
    assert e.observe(0.02, 8, 4).lambda_raw is None  # chain broken
    assert e.observe(0.04, 8, 4).lambda_raw == pytest.approx(math.log(2) / 4)

    e = LambdaEstimator()
    e.observe(1.0, 1, 1)
    s = e.observe(math.e, 1, 1)
    assert s.lambda_raw == pytest.approx(1.0) and s.lambda_ema == pytest.approx(1.0)


def test_lambda_sub_floor_keeps_the_ema():
    e = LambdaEstimator()
    e.observe(0.01, 8, 4)
    e.observe(0.02, 8, 4)
    before = e.ema_raw
    e.observe(0.0, 8, 4)
    assert e.ema_raw == before and e.ema_t == 1


# Scenario 30
def test_growth_guard_doubling_suppresses_within_20_events():
    g = GrowthGuard(nudge_threshold=math.inf)
    d, verdicts = 1e-4, []
    for _ in range(20):
        d *= 2.0
        verdicts.append(g.report(rep(d), 8, 4))
    assert SuppressGrowth() in verdicts
    # lambda_raw = ln2/4 = 0.173 from event 2; the streak reaches 3 on event 4.
    assert verdicts.index(SuppressGrowth()) == 3
    assert set(g.telemetry()) == {"lambda_raw", "lambda_ema"}


# Scenario 30
def test_growth_guard_nudge_wins_when_both_fire():
    g = GrowthGuard(suppress_threshold=1e-3, nudge_threshold=1e-3)
    d, verdicts = 1e-4, []
    for _ in range(20):
        d *= 2.0
        verdicts.append(g.report(rep(d), 8, 4))
    assert verdicts[3] == NudgeDown(0.5)
    assert NudgeDown(0.5) in verdicts


def test_growth_guard_decay_never_fires_and_reset_clears():
    g = GrowthGuard()
    d = 0.5
    for _ in range(30):
        d *= 0.5
        assert g.report(rep(d), 8, 4) == Stable()
    g.reset()
    assert g.report(rep(0.04), 8, 4) == Stable()
    assert g.last_sample.lambda_raw is None
    assert g.trend_history() is None


def test_divergence_report_helpers():
    r = DivergenceReport(deltas=(0.01, 0.05, 0.03))
    assert r.max_relative_delta() == 0.05
    assert DivergenceReport(deltas=()).max_relative_delta() == 0.0
    assert DivergenceReport(deltas=(-1.0, math.nan)).max_relative_delta() == 0.0


def test_make_guard_names_and_aliases():
    assert isinstance(make_guard("none"), NoGuard)
    assert isinstance(make_guard("LevelGuard"), LevelGuard)
    assert isinstance(make_guard("TrendGuard"), LevelGuard)
    assert isinstance(make_guard("msf"), GrowthGuard)
    assert TrendGuard is LevelGuard and MsfGuard is GrowthGuard
    assert make_guard("level", history=[0.1, 0.2]).history == (0.1, 0.2)
    with pytest.raises(ValueError):
        make_guard("oracle")


def test_verdict_equality_ignores_reason():
    assert NudgeDown(0.5, reason="a") == NudgeDown(0.5, reason="b")
    assert Stable(relax_up=True) != Stable()
    with pytest.raises(TypeError):
        NudgeDown("half")
