"""End to end: the core against the real rank machines; every epoch trains every sample once."""

import pytest

from .cluster import Cluster

EXACT = {"expected": 100, "trained": 100, "duplicates": 0, "missing": 0}


def test_three_ranks_three_epochs_exact_coverage():
    c = Cluster(policy="sync", world_size=3, total=100, batch_size=8, epochs=3)
    c.join_all()
    res = c.run()
    assert res.ok and res.reason == "completed"
    s = res.summary
    assert [{k: e[k] for k in EXACT} for e in s["coverage"]] == [EXACT] * 3
    assert [e["discarded"] for e in s["coverage"]] == [0, 0, 0]
    assert s["accuracy"] == 0.875
    assert s["epochs_completed"] == 3 and len(s["epochs"]) == 3
    assert s["world_size"] == 3 and s["policy"] == "sync"
    assert sum(r["samples"] for r in s["ranks"]) == 300
    assert s["global_step"] == sum(r["steps"] for r in s["ranks"])
    assert [r["param_digest"] for r in s["ranks"]] == ["digest-0", "digest-1", "digest-2"]


def test_death_mid_epoch_still_exact_with_discards_counted():
    c = Cluster(policy="sync", world_size=3, total=100, batch_size=8, epochs=3)
    c.join_all()
    c.run_until(lambda: c.ranks[2].step >= 3 and c.state.unfolded(2) > 0)
    lost_epoch = c.state.dispatch.rank_epoch[2]
    c.kill(2)
    res = c.run()
    assert res.ok
    cov = res.summary["coverage"]
    assert [{k: e[k] for k in EXACT} for e in cov] == [EXACT] * 3
    assert cov[lost_epoch]["discarded"] == 8
    assert res.summary["discarded_samples"] == 8
    assert res.summary["ranks"][2]["phase"] == "DEAD"
    # Every position of every epoch was trained by exactly one rank *and committed*;
    # survivors trained what the dead rank never committed.
    trained = {}
    for r in c.ranks[:2]:
        for e, off, n, _ in r.trained:
            for p in range(off, off + n):
                trained[(e, p)] = trained.get((e, p), 0) + 1
    assert all(v == 1 for v in trained.values())


def test_silent_rank_dies_by_liveness_and_run_completes():
    c = Cluster(policy="sync", world_size=3, total=60, batch_size=4, epochs=2)
    c.join_all()
    c.run_until(lambda: c.ranks[1].step >= 2)
    c.silence(1)
    res = c.run()
    assert res.ok
    assert c.state.ranks[1].reason == "heartbeat stale (>10s)"
    assert all(e["missing"] == 0 and e["duplicates"] == 0 for e in res.summary["coverage"])


@pytest.mark.parametrize("ws,total,bs", [(1, 7, 3), (2, 33, 5), (4, 10, 4), (5, 3, 2)])
def test_shapes_exact_coverage(ws, total, bs):
    c = Cluster(policy="sync", world_size=ws, total=total, batch_size=bs, epochs=2)
    c.join_all()
    res = c.run()
    assert res.ok
    for e in res.summary["coverage"]:
        assert (e["expected"], e["trained"], e["duplicates"], e["missing"]) == (total, total, 0, 0)


def test_two_deaths_in_one_epoch():
    c = Cluster(policy="sync", world_size=4, total=97, batch_size=5, epochs=2)
    c.join_all()
    c.run_until(lambda: c.ranks[3].step >= 2)
    c.kill(3)
    c.run_until(lambda: c.ranks[1].step >= 4)
    c.kill(1, code=1)
    res = c.run()
    assert res.ok
    assert all(e["missing"] == 0 and e["duplicates"] == 0 for e in res.summary["coverage"])
