"""Metrics: the aggregation math (scenarios 50-51), readiness, the broadcast."""

import math

import pytest

from flodl.core import ChunkDone, Notice, RankViolation
from flodl.core._metrics import aggregate, is_ready, to_pb

from .cluster import Cluster


def _chunk(rank, epoch=0, seq=0, *, loss=0.5, b=10, ms=100.0, n=80, share=0.0, scalars=()):
    return ChunkDone(now=0.0, rank=rank, epoch=epoch, chunk_seq=seq, batches=b, samples=n, avg_loss=loss,
                     epoch_ms=ms, share_complete_ms=share, scalars=scalars)


def test_aggregate_math_scenario_51():
    chunks = {
        0: [_chunk(0, loss=0.5, b=60, ms=1000.0, n=1920, scalars=(("loss", 3.0, 3), ("acc", 1.8, 3)))],
        1: [_chunk(1, loss=0.7, b=40, ms=1200.0, n=1280, scalars=(("loss", 4.0, 2), ("acc", 0.8, 2)))],
    }
    m = aggregate(0, chunks, 2)
    assert m["avg_loss"] == pytest.approx(0.58)
    assert m["epoch_ms"] == 1200.0
    assert m["scalars"] == {"acc": pytest.approx(0.52), "loss": pytest.approx(1.4)}
    assert m["per_rank_throughput"] == pytest.approx([1920.0, 1066.6667], rel=1e-6)  # samples/s
    assert m["per_rank"] == [{"acc": pytest.approx(0.6), "loss": 1.0}, {"acc": pytest.approx(0.4), "loss": 2.0}]
    assert m["per_rank_loss"] == [0.5, 0.7]
    assert m["per_rank_samples"] == [1920, 1280] and m["per_rank_batches"] == [60, 40]
    assert m["per_rank_batch_share"] == [0.6, 0.4]


def test_aggregate_sums_chunks_per_rank():
    # Scenario 51, chunked: r0 3 x 300 ms, r1 2 x 500 ms.
    chunks = {
        0: [_chunk(0, seq=i, b=20, ms=300.0, n=640) for i in range(3)],
        1: [_chunk(1, seq=i, b=20, ms=500.0, n=640) for i in range(2)],
    }
    m = aggregate(0, chunks, 2)
    assert m["per_rank_throughput"] == pytest.approx([1920 / 900 * 1000, 1280 / 1000 * 1000])
    assert m["epoch_ms"] == 1000.0


def test_aggregate_share_complete_ms_wins_when_positive():
    m = aggregate(0, {0: [_chunk(0, ms=1000.0, n=100, share=500.0)]}, 1)
    assert m["per_rank_throughput"] == [200.0]


def test_aggregate_custom_scalar_scenario_50():
    chunks = {r: [_chunk(r, scalars=(("custom_metric", 10.0 + r, 1),))] for r in (0, 1)}
    m = aggregate(0, chunks, 2)
    assert m["scalars"]["custom_metric"] == 10.5
    assert [p["custom_metric"] for p in m["per_rank"]] == [10.0, 11.0]
    wire = to_pb(m)
    assert wire.scalars["custom_metric"] == 10.5
    assert [p.values["custom_metric"] for p in wire.per_rank] == [10.0, 11.0]


def test_a_scalar_no_rank_counted_has_no_mean_and_does_not_break_the_epoch():
    # A rank's frame may name a scalar with count 0 (an odd recorder, a hostile peer): the
    # epoch still aggregates -- it divided by zero inside the step before.
    chunks = {0: [_chunk(0, scalars=(("acc", 0.0, 0), ("loss", 2.0, 4)))], 1: [_chunk(1, scalars=(("acc", 5.0, 0),))]}
    m = aggregate(0, chunks, 2)
    assert m["scalars"] == {"loss": 0.5}
    assert m["per_rank"] == [{"acc": 0.0, "loss": 0.5}, {"acc": 0.0, "loss": 0.0}]
    assert "acc" not in to_pb(m).scalars and to_pb(m).per_rank[1].values["acc"] == 0.0
    m = aggregate(0, {0: [_chunk(0, b=0, scalars=(("acc", 1.0, 0),))]}, 1)  # no batch either
    assert m["scalars"] == {}


def test_aggregate_rank_without_chunks_is_zero_and_loss_none():
    m = aggregate(0, {0: [_chunk(0)]}, 2)
    assert m["per_rank_loss"] == [0.5, None]
    assert m["per_rank_throughput"][1] == 0.0
    assert to_pb(m).per_rank_loss[1] == 0.0
    assert aggregate(0, {}, 2)["avg_loss"] == 0.0


def test_epoch_aggregated_broadcast_once_per_epoch_to_every_rank():
    c = Cluster(policy="sync", world_size=3, total=30, batch_size=4, epochs=2, scalars={"acc": 0.5})
    c.join_all()
    c.run()
    role = c.state.dispatch.announced_role
    assert role is not None
    for r in range(3):
        aggs = [ctl.epoch_aggregated.metrics for ctl in c.ranks[r].received
                if ctl.WhichOneof("cmd") == "epoch_aggregated"]
        assert [m.epoch for m in aggs] == [0, 1]
        assert aggs[0].scalars["acc"] == pytest.approx(0.5) and aggs[0].avg_loss > 0
        # The per-rank arrays go to the epoch-callback role only (it runs epoch_fn with
        # them); the others get the cohort's values: O(N) per epoch, not O(N^2).
        assert list(aggs[0].per_rank_samples) == ([10, 10, 10] if r == role else [])


def test_epoch_notice_for_the_operator():
    c = Cluster(policy="sync", world_size=2, total=20, batch_size=5, epochs=1)
    c.join_all()
    c.run()
    (n,) = [x for x in c.commands if isinstance(x, Notice) and x.kind == "epoch"]
    assert n.data["epoch"] == 0
    assert len(n.data["samples_per_s"]) == 2
    assert n.data["wall_s"] >= 0 and math.isfinite(n.data["avg_loss"])
    assert n.data["coverage"]["missing"] == 0


def test_not_ready_without_chunk_done_even_if_covered():
    c = Cluster(policy="sync", world_size=2, total=16, batch_size=4, epochs=1, defer_chunks=True)
    c.hold_chunks = True
    c.join_all()
    c.run_until(lambda: c.state.coverage.epochs[0].unique == 16 and c.state.rounds.version >= 2)
    for _ in range(3):
        c.advance(0.1)
    assert c.state.metrics.last_aggregated is None and not is_ready(c.state, 0)
    c.send_chunk(0)
    assert not is_ready(c.state, 0)
    c.send_chunk(1)
    assert c.state.metrics.last_aggregated == 0


def test_not_ready_until_coverage_complete():
    c = Cluster(policy="sync", world_size=2, total=16, batch_size=8, epochs=1)
    c.join_all()
    for r in (0, 1):
        while c.deliver_one(r):
            pass
        c.train_one(r)  # one batch each: the whole plan, ChunkDone sent, nothing folded yet
    assert all(c.state.metrics.chunks[0].get(r) for r in (0, 1))
    assert not is_ready(c.state, 0)
    c.run()
    assert c.state.metrics.last_aggregated == 0


def test_duplicate_chunk_done_ignored_and_late_one_counted():
    c = Cluster(policy="sync", world_size=2, total=16, batch_size=8, epochs=2)
    c.join_all()
    while c.deliver_one(0):
        pass
    c.train_one(0)
    (chunk,) = [e for e in c.journal if isinstance(e, ChunkDone)]
    c.feed(chunk)
    assert c.state.ignored["duplicate ChunkDone"] == 1
    assert len(c.state.metrics.chunks[0][0]) == 1
    c.run_until(lambda: c.state.metrics.last_aggregated == 0)
    c.feed(chunk)
    assert c.state.metrics.late_chunks == 1


def test_chunk_done_for_undispatched_epoch_is_violation():
    c = Cluster(policy="sync", world_size=2, total=16, batch_size=4)
    c.join_all()
    with pytest.raises(RankViolation, match="epoch 5, which was never dispatched"):
        c.feed(_chunk(0, epoch=5))
