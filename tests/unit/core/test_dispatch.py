"""Dispatch: epoch geometry, equal partitions, plan cache, roles, remainders."""

import copy

import pytest

from flodl.core import BatchDone, CoreConfig, HeartbeatSeen, LocalViolation, RankViolation, Tick, initial_state
from flodl.core._dispatch import (
    SYNC,
    contiguous_plans,
    epoch_samples,
    equal_sizes,
    split_ranges,
)

from .cluster import Cluster


def _plans(c, rank):
    return [
        (ctl.start_epoch.plan.epoch, ctl.start_epoch.plan.partition_offset, ctl.start_epoch.plan.partition_size)
        for ctl in c.ranks[rank].received
        if ctl.WhichOneof("cmd") == "start_epoch"
    ]


def _extensions(cmds_or_cluster, rank=None):
    cmds = cmds_or_cluster.commands if isinstance(cmds_or_cluster, Cluster) else cmds_or_cluster
    return [
        (s.rank, s.control.extend_partition.epoch, s.control.extend_partition.partition_offset,
         s.control.extend_partition.partition_size)
        for s in cmds
        if getattr(s, "kind", None) == "extend_partition" and (rank is None or s.rank == rank)
    ]


# -- geometry (§8.1-8.2) ----------------------------------------------------------------------


def test_equal_sizes_first_ranks_get_the_remainder():
    assert equal_sizes(3, 100) == [34, 33, 33]
    assert equal_sizes(2, 10) == [5, 5]
    assert equal_sizes(4, 2) == [1, 1, 0, 0]
    assert equal_sizes(0, 5) == []


def test_contiguous_plans_offsets_cumulative_in_rank_order():
    assert contiguous_plans([0, 2, 3], [4, 3, 3]) == {0: (0, 4), 2: (4, 3), 3: (7, 3)}


def test_epoch_samples_splits():
    # Scenario 41.
    assert [epoch_samples(100, 4, e) for e in range(4)] == [25, 25, 25, 25]
    assert [epoch_samples(100, 7, e) for e in range(7)] == [15, 15, 14, 14, 14, 14, 14]
    assert epoch_samples(100, 1, 3) == 100


def test_split_ranges_equal_slices_across_range_boundaries():
    assert split_ranges([(0, 3), (10, 4)], 2) == [[(0, 3), (10, 1)], [(11, 3)]]
    assert split_ranges([(5, 2)], 3) == [[(5, 1)], [(6, 1)], []]


# -- dispatch_epoch (§8.3) ----------------------------------------------------------------------


def test_equal_plans_first_dispatch():
    # Scenario 36: ws 2, total 10, bs 2.
    c = Cluster(policy="sync", world_size=2, total=10, batch_size=2)
    c.join_all()
    assert c.out(0) == ["start_epoch"]  # the role rides in the plan: one command per rank
    assert c.out(1) == ["start_epoch"]
    assert _plans(c, 0) == [(0, 0, 5)] and _plans(c, 1) == [(0, 5, 5)]
    assert c.ranks[1].received[0].start_epoch.epoch_callback_role == 0
    assert c.roles_told(0) == c.roles_told(1) == [0]
    assert c.state.dispatch.rank_epoch == {0: 0, 1: 0}


def test_plan_cache_reuses_plans():
    # Scenario 38: dispatching an epoch twice reuses the same plans; the role goes once.
    c = Cluster(policy="sync", world_size=2, total=10, batch_size=2)
    c.join_all()
    first = SYNC.plans_for_epoch(c.state, 0)
    out = []
    SYNC.dispatch_epoch(c.state, 0, out)
    assert SYNC.plans_for_epoch(c.state, 0) is first
    for x in out:
        c._route(x)
    assert c.out(0) == ["start_epoch", "start_epoch"]
    assert c.roles_told(0) == [0]  # the second plan does not carry it again
    assert _plans(c, 1) == [(0, 5, 5), (0, 5, 5)]


def test_role_broadcast_once_across_epochs():
    # Scenario 39.
    c = Cluster(policy="sync", world_size=3, total=30, batch_size=4, epochs=3)
    c.join_all()
    assert c.run().ok
    for r in range(3):
        assert c.roles_told(r) == [0]
        assert "set_epoch_callback_role" not in c.out(r)  # every rank got it with a plan
        assert [p[0] for p in _plans(c, r)] == [0, 1, 2]


def test_role_reannounced_when_holder_dies():
    c = Cluster(policy="sync", world_size=3, total=30, batch_size=4, epochs=2)
    c.join_all()
    c.kill(0)
    assert c.run().ok
    assert c.roles_told(1) == [0, 1]


def test_total_samples_guard():
    # Scenario 40: no epoch size known -> a LocalViolation naming the requirement.
    st = initial_state(CoreConfig(policy="sync", world_size=2))
    with pytest.raises(LocalViolation, match="total_samples > 0"):
        SYNC.plans_for_epoch(st, 0)


def test_partitions_follow_the_survivors():
    c = Cluster(policy="sync", world_size=3, total=99, batch_size=10, epochs=2)
    c.join_all()
    c.kill(1)
    c.run_until(lambda: c.state.dispatch.last_dispatched == 1)
    assert c.state.dispatch.plans[1] == {0: (0, 50), 2: (50, 49)}
    assert _plans(c, 2)[-1] == (1, 50, 49)


def test_zero_share_gets_no_start_epoch_and_run_completes():
    c = Cluster(policy="sync", world_size=3, total=2, batch_size=4, epochs=2)
    c.join_all()
    assert c.out(2) == ["set_epoch_callback_role"]  # no plan to carry the role: told on its own
    assert c.roles_told(2) == [0]
    res = c.run()
    assert res.ok
    assert [e["missing"] for e in res.summary["coverage"]] == [0, 0]


# -- deaths: the remainder (§9.3 with committed semantics) ----------------------------------------


def test_extend_partition_split_equally_among_survivors():
    # Scenario 59: ws 3, total 30, bs 1; rank 2 silent, nothing processed.
    c = Cluster(policy="sync", world_size=3, total=30, batch_size=1, liveness_timeout_s=1.0)
    c.join_all()
    c.feed(HeartbeatSeen(now=1.5, rank=0))
    c.feed(HeartbeatSeen(now=1.5, rank=1))
    cmds = c.feed(Tick(now=1.5))
    assert _extensions(cmds) == [(0, 0, 20, 5), (1, 0, 25, 5)]
    assert c.state.dispatch.assigned[0] == {0: [(0, 10), (20, 5)], 1: [(10, 10), (25, 5)], 2: []}


def test_remainder_excludes_committed_and_includes_discarded():
    c = Cluster(policy="sync", world_size=2, total=40, batch_size=4)
    c.join_all()
    c.run_until(lambda: c.ranks[1].step >= 3 and c.state.unfolded(1) > 0)
    committed = [(e, o, n) for (e, o, n, s) in c.ranks[1].trained if s <= c.state.ranks[1].folded_step]
    cmds = c.kill(1)
    ext = _extensions(cmds)
    assert sum(x[3] for x in ext) == 20 - sum(n for _, _, n in committed)
    first = min(x[2] for x in ext)
    assert first == 20 + sum(n for _, _, n in committed)  # the tail after the committed prefix
    assert c.state.coverage.epochs[0].discarded == 4


def test_remainder_of_a_rank_that_held_an_extension():
    c = Cluster(policy="sync", world_size=3, total=30, batch_size=1)
    c.join_all()
    c.kill(2)  # ranks 0 and 1 get (20, 5) and (25, 5)
    c.kill(1)  # rank 1's whole plan (10, 10) and its extension (25, 5) go to rank 0
    assert _extensions(c, 0) == [(0, 0, 20, 5), (0, 0, 10, 10), (0, 0, 25, 5)]
    res = c.run()
    assert res.ok and res.summary["coverage"][0]["missing"] == 0


def test_survivor_that_was_idle_becomes_busy_with_its_extension():
    c = Cluster(policy="sync", world_size=2, total=20, batch_size=5)
    c.join_all()
    c.silence(1)
    c.run_until(lambda: SYNC.idle(c.state, 0))
    c.kill(1)
    assert not SYNC.idle(c.state, 0)
    res = c.run()
    assert res.ok and res.summary["coverage"][0] == {
        "epoch": 0, "expected": 20, "trained": 20, "duplicates": 0, "missing": 0, "discarded": 0,
    }


# -- batches must lie in the assignment -----------------------------------------------------------


def _batch(rank, offset, samples, step, epoch=0):
    return BatchDone(now=0.0, rank=rank, batch_ms=1.0, data_ms=0.0, step_count=step, loss=1.0,
                     samples=samples, epoch=epoch, offset=offset)


def test_batch_outside_assignment_is_violation_and_changes_nothing():
    c = Cluster(policy="sync", world_size=2, total=10, batch_size=2)
    c.join_all()
    before = copy.deepcopy(c.state)
    with pytest.raises(RankViolation, match=r"rank 0: batch \[4, 6\) of epoch 0 is outside its assignment"):
        c.feed(_batch(0, 4, 2, 1))
    assert c.state == before


def test_batch_of_wrong_epoch_is_violation():
    c = Cluster(policy="sync", world_size=2, total=10, batch_size=2)
    c.join_all()
    with pytest.raises(RankViolation, match="current epoch is 0"):
        c.feed(_batch(0, 0, 2, 1, epoch=1))


def test_batch_before_any_plan_is_violation():
    c = Cluster(policy="sync", world_size=2, total=10, batch_size=2)
    c.hello(0)
    with pytest.raises(RankViolation, match="current epoch is None"):
        c.feed(_batch(0, 0, 2, 1))


def test_duplicate_batch_is_ignored_not_violation():
    c = Cluster(policy="sync", world_size=2, total=10, batch_size=2)
    c.join_all()
    c.feed(_batch(0, 0, 2, 1))
    c.feed(_batch(0, 0, 2, 1))
    assert c.state.ranks[0].batches == 1
    assert c.state.ignored["duplicate BatchDone"] == 1
