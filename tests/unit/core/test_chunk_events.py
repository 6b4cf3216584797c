"""Protocol 1.3, the coordinator's side: a chunk's Metrics frame that carries its last
batches is read as the two frames it replaces -- the batch report, then the ChunkDone --
so the core steps the same events either way (the rank's side:
tests/unit/rank/test_batches_in_metrics.py)."""

from __future__ import annotations

from flodl.core import BatchDone, BatchesDone, ChunkDone, chunk_events, metrics_event, timing_event
from flodl.core._membership import run_spec
from flodl.rank import SendMetrics, SendTiming
from flodl.wire import pb

from .cluster import Cluster


def _batch(step, off):
    return pb.Timing.Batch(batch_ms=2.0, step_count=step, samples=4, epoch=0, offset=off, batch_loss=0.5, lr=0.1)


def test_a_metrics_frame_is_the_report_it_carries_then_its_chunk():
    m = pb.Metrics(rank=3, epoch=0, chunk_seq=2, batches_processed=2, samples_processed=8)
    assert chunk_events(1.5, m) == [metrics_event(1.5, m)]
    m.batches.append(_batch(7, 24))
    one = chunk_events(1.5, m)
    assert one == [timing_event(1.5, pb.Timing(rank=3, batch=_batch(7, 24))), metrics_event(1.5, m)]
    assert [type(e) for e in one] == [BatchDone, ChunkDone]
    m.batches.append(_batch(8, 28))
    two = chunk_events(1.5, m)
    run = pb.Timing(rank=3, batches=pb.Timing.BatchRun(batch=[_batch(7, 24), _batch(8, 28)]))
    assert two == [timing_event(1.5, run), metrics_event(1.5, m)] and type(two[0]) is BatchesDone


def _run(carry):
    c = Cluster(world_size=3, total=120, batch_size=4, epochs=2, policy="cadence", speeds=[10, 20, 40],
                carry_batches=carry)  # fmt: skip
    frames = {"report": 0, "metrics": 0, "carrying": 0}
    do = c._do

    def count(r, cmds):  # what the ranks sent, frame by frame
        for x in cmds:
            if isinstance(x, SendTiming) and x.kind in ("batch", "batches"):
                frames["report"] += 1
            elif isinstance(x, SendMetrics):
                frames["metrics"] += 1
                frames["carrying"] += bool(x.metrics.batches)
        return do(r, cmds)

    c._do = count
    c.join_all()
    return c, c.run(), frames


def test_the_coordinator_says_it_reads_them_and_a_run_with_them_is_exact_in_fewer_frames():
    c, res, carried = _run(True)
    assert run_spec(c.state, 0).batches_in_metrics
    assert res.ok
    assert [(e["trained"], e["duplicates"], e["missing"]) for e in res.summary["coverage"]] == [(120, 0, 0)] * 2
    _, res_12, apart = _run(False)  # the ranks frame it as 1.2 did
    assert res_12.ok and res_12.summary["coverage"] == res.summary["coverage"]
    assert carried["carrying"] > 0 and apart["carrying"] == 0
    # Every chunk's last report rode in its Metrics: that many frames fewer.
    assert carried["metrics"] == apart["metrics"]
    assert carried["report"] == apart["report"] - carried["carrying"]
