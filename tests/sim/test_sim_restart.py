"""The coordinator killed and restarted at seeded journal positions, in virtual time.

Both ends run the real logic: the core rebuilt with ``replay(config, journal)`` and fed
``CoordinatorRestarted`` (what ``flodl_coordinator.recovery`` does), the rank machines
(``flodl.rank``) noticing the new incarnation and sending their resync report. Every
frame in flight either way is lost at the crash. Coverage must stay exactly once.
A larger campaign: ``python bench/sim_restart.py``.
"""

import pytest

from flodl.core import RankResynced, replay
from flodl.sim import SimConfig, simulate
from flodl.sim._restart import restart_case

SEEDS_PER_POLICY = 80  # x 3 policies = 240 seeded restarts in CI


@pytest.mark.parametrize("policy", ["sync", "cadence", "async"])
def test_a_restart_at_a_seeded_event_keeps_coverage_exactly_once(policy):
    cases = [restart_case(seed, policy) for seed in range(SEEDS_PER_POLICY)]
    bad = [c.describe() for c in cases if not c.exact]
    assert not bad, "\n".join(bad)
    # Not vacuous: the coordinator did restart, frames were lost, ranks resynced.
    assert sum(c.result.restarts for c in cases) >= SEEDS_PER_POLICY * 0.9
    assert sum(c.result.lost_frames for c in cases) > 0
    resynced = sum(1 for c in cases for e in c.result.events if isinstance(e, RankResynced))
    assert resynced >= sum(c.result.restarts for c in cases)


@pytest.mark.parametrize("policy", ["sync", "cadence"])
def test_two_restarts_in_one_run_keep_coverage_exactly_once(policy):
    cases = [restart_case(1000 + seed, policy, crashes=2) for seed in range(20)]
    bad = [c.describe() for c in cases if not c.exact]
    assert not bad, "\n".join(bad)


def test_a_restart_with_a_dead_rank_keeps_coverage_exactly_once():
    for seed in range(10):
        cfg = SimConfig(ms_per_batch=(10, 20, 35), total_samples=240, batch_size=8, epochs=2, seed=seed,
                        policy="cadence", latency_s=0.004, fail_at={seed % 3: 5 + seed}, crash_at=(40 + 7 * seed,))  # fmt: skip
        res = simulate(cfg)
        assert res.finished is not None and res.finished.ok, (seed, res.finished)
        for c in res.summary["coverage"]:
            assert (c["expected"], c["trained"], c["duplicates"], c["missing"]) == (240, 240, 0, 0), (seed, c)


def test_a_restarted_run_replays_from_its_journal_and_the_same_seed_repeats_it():
    cfg = SimConfig(ms_per_batch=(10, 30), total_samples=160, batch_size=8, epochs=2, seed=5, policy="cadence",
                    latency_s=0.004, crash_at=(40,))  # fmt: skip  (the run journals ~60 events)
    a, b = simulate(cfg), simulate(cfg)
    assert a.restarts == 1 and a.events == b.events and a.summary == b.summary
    assert replay(a.state.config, a.events) == a.state  # the journal holds the restart too
