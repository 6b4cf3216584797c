"""The real core in virtual time: coverage under faults, scale, determinism."""

import random

import pytest

from flodl.core import replay
from flodl.sim import SimConfig, simulate


def _exact(result, expected):
    cov = result.summary["coverage"]
    assert cov, "no epoch completed"
    for c in cov:
        assert (c["expected"], c["trained"], c["duplicates"], c["missing"]) == (expected, expected, 0, 0), c


def test_unequal_ranks_complete_with_exact_coverage():
    res = simulate(SimConfig(ms_per_batch=(10, 20, 40), total_samples=600, batch_size=16, epochs=3))
    assert res.finished.ok, res.finished.reason
    _exact(res, 600)
    assert res.summary["averages"] > 0


@pytest.mark.parametrize("seed", [1, 2, 3, 4, 5])
def test_a_crash_and_a_hang_lose_and_double_nothing(seed):
    rng = random.Random(seed)
    cfg = SimConfig(
        ms_per_batch=(10, 20, 40, 15), total_samples=1000, batch_size=16, epochs=3, seed=seed,
        fail_at={rng.randrange(4): rng.randrange(1, 40)},
        hang_at={rng.randrange(4): rng.randrange(1, 40)},
    )  # fmt: skip
    res = simulate(cfg)
    assert res.finished is not None and res.finished.ok, res.finished
    _exact(res, 1000)


def test_sync_on_1_2_4_is_held_to_the_slowest_rank():
    # Sync averages after every step, so each window lasts as long as the slowest batch:
    # the headline problem flodl exists to fix (cadence does better; see test_sim_cadence).
    res = simulate(SimConfig(ms_per_batch=(10, 20, 40), total_samples=3000, batch_size=16, epochs=2, jitter=0.0))
    assert res.finished.ok
    assert 0.3 < res.efficiency < 0.65, res.efficiency


def test_64_ranks_spread_1_to_10x_run_in_seconds():
    rng = random.Random(7)
    ms = tuple(rng.uniform(5.0, 50.0) for _ in range(64))
    res = simulate(SimConfig(ms_per_batch=ms, total_samples=16_000, batch_size=16, epochs=3))
    assert res.finished.ok
    _exact(res, 16_000)


def test_same_seed_same_run_and_the_event_list_replays():
    cfg = SimConfig(ms_per_batch=(10, 30), total_samples=300, batch_size=8, epochs=2, seed=11, fail_at={1: 7})
    a, b = simulate(cfg), simulate(cfg)
    assert a.events == b.events and a.summary == b.summary
    st = replay(a.state.config, a.events)
    assert st == a.state
