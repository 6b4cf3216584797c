"""LrEventMeta (spec §7.4; scenarios 31-33)."""

import pytest

from flodl.core.cadence._elche import Phase
from flodl.core.cadence._guards import NudgeDown, Stable, SuppressGrowth
from flodl.core.cadence._lr_meta import (
    LrEventMeta,
    LrEventMetaConfig,
    Noop,
    base_factor_for,
    effective_factor,
    sustain_k_for,
)

ST = Stable()
SG = SuppressGrowth()
ND = NudgeDown(0.5)


def run(meta, phase, seq):
    out = None
    for lr, anchor, verdict in seq:
        out = meta.observe(lr, anchor, verdict, phase)
    return out


# Scenario 31
def test_lr_cliff_ten_x_drop_nudges_half():
    meta = LrEventMeta()
    action = run(meta, Phase.STABLE, [(0.1, 100, ST), (0.01, 100, ST)])
    assert action == NudgeDown(0.5)
    assert "cliff" in action.reason


# Scenario 31
def test_lr_cliff_threshold_boundary():
    assert run(LrEventMeta(), Phase.STABLE, [(1.0, 100, ST), (0.75, 100, ST)]) == Noop()
    action = run(LrEventMeta(), Phase.STABLE, [(1.0, 100, ST), (0.65, 100, ST)])
    assert isinstance(action, NudgeDown)


# Scenario 31
def test_lr_cliff_rising_lr_and_probe_are_noop():
    assert run(LrEventMeta(), Phase.STABLE, [(0.001, 100, ST), (0.1, 100, ST)]) == Noop()
    assert run(LrEventMeta(), Phase.PROBE, [(0.1, 100, ND), (0.01, 100, ND)]) == Noop()


def test_lr_cliff_silent_on_smooth_decay_and_single_sample():
    meta = LrEventMeta()
    assert meta.observe(0.1, 100, ST, Phase.STABLE) == Noop()
    lr = 0.1
    for _ in range(10):
        lr *= 0.98
        assert meta.observe(lr, 100, ST, Phase.STABLE) == Noop()


# Scenario 32
def test_convergence_pattern_stable_needs_three():
    assert run(LrEventMeta(), Phase.STABLE, [(0.1, 100, ND)] * 3) == NudgeDown(0.5)
    two = run(LrEventMeta(), Phase.STABLE, [(0.1, 100, ST), (0.1, 100, ND), (0.1, 100, ND)])
    assert two == Noop()
    mixed = run(LrEventMeta(), Phase.STABLE, [(0.1, 100, SG), (0.1, 100, ND), (0.1, 100, SG)])
    assert isinstance(mixed, NudgeDown)


# Scenario 32
def test_convergence_pattern_mature_two_suppress():
    action = run(LrEventMeta(), Phase.MATURE, [(0.1, 100, ST), (0.1, 100, SG), (0.1, 100, SG)])
    assert action.factor == pytest.approx(0.7)


# Scenario 32
def test_both_watchers_compound_at_mature():
    action = run(LrEventMeta(), Phase.MATURE, [(0.1, 100, ND), (0.1, 100, ND), (0.01, 100, ND)])
    assert action.factor == pytest.approx(0.35)


def test_warmup_pattern_needs_five_at_base_0_3():
    meta = LrEventMeta()
    assert run(meta, Phase.WARMUP, [(0.1, 100, SG)] * 4) == Noop()
    assert meta.observe(0.1, 100, SG, Phase.WARMUP).factor == pytest.approx(0.3)


# Scenario 33
def test_effective_factor_trend_and_clamps():
    assert effective_factor(0.5, 0.0) == 0.5
    assert effective_factor(0.5, -0.5) == 0.75
    assert effective_factor(0.5, 0.5) == 0.25
    assert effective_factor(0.5, 5.0) == 0.1
    assert effective_factor(0.5, -5.0) == 0.95


# Scenario 33
def test_trend_dampens_a_cliff_after_a_drop():
    meta = LrEventMeta()
    run(meta, Phase.STABLE, [(0.1, 100, ST)] * 4)
    action = meta.observe(0.01, 50, ST, Phase.STABLE)
    # trend = (50 - 90) / 90 = -0.444 -> 0.5 + 0.5 * 0.444 = 0.7222
    assert action.factor == pytest.approx(0.5 + 0.5 * 40 / 90)
    assert action.factor == pytest.approx(0.722, abs=1e-3)


def test_trend_amplifies_during_a_climb():
    meta = LrEventMeta()
    run(meta, Phase.STABLE, [(0.1, a, ST) for a in (100, 110, 120, 130, 140)])
    assert meta.anchor_trend() > 0
    action = meta.observe(0.01, 140, ST, Phase.STABLE)
    assert 0.1 < action.factor < 0.5


def test_windows_are_capped_and_guard_cap_raised_to_longest_k():
    meta = LrEventMeta(LrEventMetaConfig(lr_window_cap=3, anchor_window_cap=3, guard_window_cap=3))
    for i in range(5):
        meta.observe(0.1 * i, 100 + i, ST, Phase.STABLE)
    assert len(meta.lr_window) == 3 and len(meta.anchor_window) == 3
    assert len(meta.guard_window) == 5
    assert meta.lr_window[0] == pytest.approx(0.2) and meta.anchor_window[-1] == 104
    assert meta.config.guard_window_cap == 5


def test_phase_tables():
    assert [sustain_k_for(p) for p in (Phase.WARMUP, Phase.STABLE, Phase.MATURE)] == [5, 3, 2]
    assert [base_factor_for(p) for p in (Phase.WARMUP, Phase.STABLE, Phase.MATURE)] == [
        0.3,
        0.5,
        0.7,
    ]


def test_is_settled():
    meta = LrEventMeta()
    run(meta, Phase.STABLE, [(0.1, 100, ST)] * 5)
    assert meta.is_settled() and meta.anchor_trend() == 0.0
