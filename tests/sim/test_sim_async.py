"""Async in virtual time: ranks never wait for a round or an epoch end, coverage stays exact."""

import random

import pytest

from flodl.core import Notice, replay
from flodl.sim import SimConfig, simulate

# The 1,2,4 rig: three ranks at 10, 20 and 40 ms per batch, 0.5 ms links.
RIG = dict(ms_per_batch=(10, 20, 40), latency_s=0.0005, batch_size=16)


def _exact(result, expected, epochs):
    cov = result.summary["coverage"]
    assert len(cov) == epochs, cov
    for c in cov:
        assert (c["expected"], c["trained"], c["duplicates"], c["missing"]) == (expected, expected, 0, 0), c


def _commands(res):
    record = []
    replay(res.state.config, res.events, record=record)
    return record


@pytest.mark.parametrize("jitter", [0.05, 0.3])
def test_async_on_1_2_4_is_exact_and_at_least_as_efficient_as_cadence_held_at_its_barrier(jitter):
    # Async's overshoot is what lets a rank train past the reduce barrier; Cadence does so
    # only with run_ahead (off by default), so the comparison is with the barrier-held form.
    cfg = dict(RIG, jitter=jitter, total_samples=6000, epochs=3)
    cad = simulate(SimConfig(**cfg, policy="cadence", core_overrides={"run_ahead": False}))
    asy = simulate(SimConfig(**cfg, policy="async"))
    assert cad.finished.ok and asy.finished.ok
    _exact(asy, 6000, 3)
    assert asy.summary["policy"] == "async" and asy.summary["averages"] >= 20
    assert asy.efficiency >= cad.efficiency, (asy.efficiency, cad.efficiency)
    assert asy.efficiency >= 0.95, asy.efficiency
    cmds = _commands(asy)
    assert not [c for c in cmds if getattr(c, "kind", None) == "throttle"]
    # Epochs are coverage labels: every later epoch was opened by a rank streaming into
    # it while the one before was still being trained.
    opened = [c for c in cmds if isinstance(c, Notice) and c.kind == "epoch_opened"]
    assert [c.data["epoch"] for c in opened] == [1, 2]
    assert all(len(c.data["live_epochs"]) == 2 for c in opened)


def test_the_look_ahead_is_bounded_and_widens_while_the_guard_is_stable():
    # No guard: every verdict is Stable, so the look-ahead grows by one per round from 3
    # to the ceiling of 15. A round folds at most a window (the counts before or after
    # its recalibration) plus the look-ahead, plus the batch a rank may train between
    # the trigger and reading its RequestParams. (Enough samples for 13+ rounds with
    # room to spare: with 30 % jitter the count of rounds moves with any change of timing.)
    res = simulate(SimConfig(**RIG, jitter=0.3, total_samples=10000, epochs=1, policy="async",
                             core_overrides={"guard": "none"}))  # fmt: skip
    assert res.finished.ok
    _exact(res, 10000, 1)
    windows = [c.data for c in _commands(res) if isinstance(c, Notice) and c.kind == "window"]
    assert len(windows) == res.summary["averages"] >= 13
    assert res.summary["elche"]["max_overshoot"] == 15
    for i in range(1, len(windows)):
        look_ahead = min(3 + i, 15)
        bound = max(windows[i - 1]["counts"] + windows[i]["counts"]) + look_ahead + 1
        assert windows[i]["k_max"] <= bound, (i, windows[i])
    assert any(windows[i]["k_max"] > max(windows[i - 1]["counts"]) for i in range(1, len(windows)))  # ran ahead


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_a_death_and_a_hang_mid_epoch_lose_and_double_nothing(seed):
    rng = random.Random(seed)
    cfg = SimConfig(
        ms_per_batch=(10, 20, 40, 15), total_samples=1000, batch_size=16, epochs=3, seed=seed, policy="async",
        fail_at={rng.randrange(4): rng.randrange(5, 40)},
        hang_at={rng.randrange(4): rng.randrange(5, 40)},
    )  # fmt: skip
    res = simulate(cfg)
    assert res.finished is not None and res.finished.ok, res.finished
    _exact(res, 1000, 3)
    assert res.summary["discarded_samples"] == sum(c["discarded"] for c in res.summary["coverage"])
    assert any(r["phase"] == "DEAD" for r in res.summary["ranks"])


def test_same_seed_same_run_and_the_event_list_replays():
    cfg = SimConfig(ms_per_batch=(10, 30), total_samples=300, batch_size=8, epochs=3, seed=11, fail_at={1: 20},
                    policy="async")  # fmt: skip
    a, b = simulate(cfg), simulate(cfg)
    assert a.events == b.events and a.summary == b.summary
    assert replay(a.state.config, a.events) == a.state


@pytest.mark.timeout(60)  # a hang guard, not a speed assertion (speed lives in bench/)
def test_32_ranks_spread_1_to_10x_exact_over_several_epochs():
    rng = random.Random(7)
    ms = tuple(rng.uniform(5.0, 50.0) for _ in range(32))
    res = simulate(SimConfig(ms_per_batch=ms, total_samples=8_000, batch_size=16, epochs=3, policy="async"))
    assert res.finished.ok
    _exact(res, 8_000, 3)
    counts = res.summary["elche"]["counts"]
    assert counts[ms.index(min(ms))] > counts[ms.index(max(ms))]
