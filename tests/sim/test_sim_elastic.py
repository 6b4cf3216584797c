"""Elastic membership under churn, in virtual time: random late joins, a host that never
comes, ranks killed and restarted by their agent, coordinator restarts. Every run must
finish ok with every epoch committed exactly once, and no joiner may train before its
seed consensus arrived. A larger campaign: ``python bench/elastic.py --sim``."""

import math

import pytest

from flodl.core import JoinerSeeded, replay
from flodl.sim import SimConfig, batch_ends, simulate
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


def test_sync_shares_the_epoch_with_a_joiner_exactly_once_whenever_the_coordinator_dies_around_the_trim():
    """Sync re-partitions the live epoch for the joiner (TrimPartition / PartitionTrimmed):
    a coordinator crash at every journal length around the first trim -- before it is
    sent, with it undelivered (void, planned again), with its answer lost (settled by the
    member's resync report) -- still commits every epoch exactly once. Two seeds: which
    crash point loses an answer in flight depends on the links' random delays."""
    ended: dict = {}
    for seed in (0, 3):
        cfg = SimConfig(ms_per_batch=(10, 20, 12), total_samples=480, batch_size=8, epochs=2, seed=seed,
                        policy="sync", latency_s=0.01, hello_at={2: 0.3}, restart_after_s=0.05,
                        core_overrides=dict(min_ranks=2, join_timeout_s=0.0))  # fmt: skip
        plain = simulate(cfg)
        first = next(i for i, e in enumerate(plain.events) if type(e).__name__ == "PartitionTrimmed")
        for k in range(first - 10, first + 3):
            r = simulate(SimConfig(**{**cfg.__dict__, "crash_at": (k,)}))
            assert r.restarts == 1 and r.finished.ok and not r.violations, (seed, k)
            for c in r.summary["coverage"]:
                assert (c["trained"], c["duplicates"], c["missing"]) == (c["expected"], 0, 0), (seed, k, c)
            for name, n in r.summary["elastic"].get("repartition", {}).items():
                ended[name] = ended.get(name, 0) + n
    # Not vacuous: each way a trim can end under a restart happened in the sweep.
    assert ended["answered"] >= 1 and ended["void"] >= 1 and ended["settled_by_resync"] >= 1, ended


def test_sync_shares_a_slow_members_tail_with_the_joiner_and_a_faster_member_that_ran_dry():
    """Equal shares of the rest: the fast member finished its partition by the barrier, so
    the slow one's tail goes to the joiner and to it alike -- exactly once."""
    cfg = SimConfig(ms_per_batch=(5.0, 40.0, 20.0), total_samples=1600, batch_size=8, epochs=2, seed=1,
                    policy="sync", hello_at={2: 0.5}, core_overrides=dict(min_ranks=2, join_timeout_s=0.0))  # fmt: skip
    r = simulate(cfg)
    assert r.finished.ok and not r.violations
    for c in r.summary["coverage"]:
        assert (c["trained"], c["duplicates"], c["missing"]) == (c["expected"], 0, 0), c
    batches = [e for e, _end in batch_ends(r.events) if e.epoch == 0]
    slow_part = range(800, 1600)  # rank 1's partition of epoch 0 (two members: [0, 800), [800, 1600))
    assert any(e.rank == 0 and e.offset in slow_part for e in batches)  # the fast member got some of it
    assert any(e.rank == 2 for e in batches)  # and so did the joiner
    assert r.summary["elastic"]["repartition"]["answered"] >= 1


def test_an_elastic_world_of_many_empty_slots_averages_as_often_as_its_ranks_alone():
    # 3 ranks (10, 20, 40 ms) in a world of 256 slots that never fill: the empty slots'
    # counts once made the window cap bind (an epoch is 375 batches here) and cut the
    # windows to [6, 3, 1] -- 73 rounds instead of 28, 2-3 points of efficiency at 1,024
    # slots. Only the ranks that train count against the cap.
    def run(slots):
        ms = (10, 20, 40) + (10,) * (slots - 3)
        over = dict(join_timeout_s=0.1, **({"min_ranks": 3} if slots > 3 else {}))
        r = simulate(SimConfig(ms_per_batch=ms, total_samples=6000, batch_size=16, epochs=2, policy="cadence",
                               hello_at={x: math.inf for x in range(3, slots)}, core_overrides=over))  # fmt: skip
        assert r.finished.ok, r.finished.reason
        return r

    alone, elastic = run(3), run(256)
    assert elastic.summary["averages"] == alone.summary["averages"]
    assert elastic.summary["elche"]["counts"][:3] == alone.summary["elche"]["counts"] == [16, 8, 4]
