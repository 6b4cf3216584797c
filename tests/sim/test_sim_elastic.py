"""Elastic membership under churn, in virtual time: random late joins, a host that never
comes, ranks killed and restarted by their agent, coordinator restarts. Every run must
finish ok with every epoch committed exactly once, and no joiner may train before its
seed consensus arrived. A larger campaign: ``python bench/elastic.py --sim``."""

import pytest

from flodl.core import JoinerSeeded, replay
from flodl.sim import SimConfig, simulate
from flodl.sim._churn import churn_case

SEEDS_PER_POLICY = 15  # x 3 policies in CI (bench/elastic.py --sim runs more)


@pytest.mark.parametrize("policy", ["sync", "cadence", "async"])
def test_churn_keeps_every_epoch_exactly_once_and_no_joiner_trains_unseeded(policy):
    cases = [churn_case(seed, policy) for seed in range(SEEDS_PER_POLICY)]
    bad = [c.describe() for c in cases if not c.exact]
    assert not bad, "\n".join(bad)
    # Not vacuous: ranks joined the running world, restarted ranks took their slots back,
    # and the coordinator restarted with the membership in its journal.
    assert sum(c.joins for c in cases) >= SEEDS_PER_POLICY
    assert sum(c.result.respawns for c in cases) >= 2
    assert sum(c.result.restarts for c in cases) >= 2


def test_a_joiner_pending_when_the_coordinator_restarts_is_seeded_by_the_next_consensus():
    cfg = SimConfig(ms_per_batch=(10, 20, 12), total_samples=480, batch_size=8, epochs=3, seed=3, policy="cadence",
                    latency_s=0.002, hello_at={2: 0.3}, core_overrides=dict(min_ranks=2, join_timeout_s=0.0))  # fmt: skip
    plain = simulate(cfg)
    admitted = next(i for i, e in enumerate(plain.events) if getattr(e, "rank", None) == 2)
    crashed = simulate(SimConfig(**{**cfg.__dict__, "crash_at": (admitted + 2,)}))
    assert crashed.restarts == 1 and crashed.finished.ok and not crashed.violations
    assert [e.rank for e in crashed.events if isinstance(e, JoinerSeeded)] == [2]
    for c in crashed.summary["coverage"]:
        assert (c["trained"], c["duplicates"], c["missing"]) == (c["expected"], 0, 0), c
    assert replay(crashed.state.config, crashed.events) == crashed.state
