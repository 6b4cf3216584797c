"""Protocol 1.3, the rank's side: where the coordinator's RunSpec says it reads them
(``batches_in_metrics``), a chunk's last unreported batches ride in the chunk's Metrics
frame instead of a frame of their own just before it; otherwise (a 1.2 coordinator) the
rank reports as before. The coordinator's side: tests/unit/core/test_chunk_events.py."""

from __future__ import annotations

from flodl.rank import BatchTrained, ControlReceived, SendMetrics, SendTiming, TrainBatch
from flodl.wire import pb
from flodl.rank._machine import MAX_BATCHES_PER_REPORT

from .test_machine import machine, plan


def _step(m, t=0.0):
    act = m.next_action(t)
    assert isinstance(act, TrainBatch), act
    return m.handle(BatchTrained(epoch=act.epoch, offset=act.offset, samples=act.count, batch_ms=2.0, loss=0.5))


def test_a_chunks_last_batch_rides_in_its_metrics_and_nothing_else_carries_it():
    m = machine(batches_in_metrics=True, batch_report_ms=0.0)  # a frame per batch, but the last
    m.handle(plan(0, 0, 24))
    first = [_step(m), _step(m)]
    assert [[type(c) for c in out] for out in first] == [[SendTiming], [SendTiming]]
    assert _step(m) == []  # the chunk's last batch: held for its Metrics
    act = m.next_action(1.0)
    assert isinstance(act, SendMetrics) and [b.offset for b in act.metrics.batches] == [16]
    assert act.metrics.batches_processed == 3 and act.metrics.batches[0].step_count == 3
    assert m.unsent == [] and not m.finished[-1].batches  # the resync report keeps the chunk's own


def test_without_the_coordinators_word_the_last_batch_goes_in_a_frame_of_its_own():
    m = machine(batch_report_ms=0.0)  # a 1.2 coordinator leaves batches_in_metrics false
    m.handle(plan(0, 0, 16))
    _step(m)
    (sent,) = _step(m)
    assert isinstance(sent, SendTiming) and sent.body.offset == 8
    act = m.next_action(1.0)
    assert isinstance(act, SendMetrics) and not act.metrics.batches


def test_a_coalesced_report_and_the_cap_still_hold_with_batches_in_metrics():
    # Stretched reports, the next plan queued (no early report to fetch one): the whole
    # chunk's batches go in its Metrics, as the one report it replaces would have.
    m = machine(batches_in_metrics=True, batch_report_ms=1e6, batch_size=1)
    m.handle(plan(0, 0, 5))
    assert _step(m) == []
    m.handle(plan(0, 10, 5))
    assert all(_step(m) == [] for _ in range(4))
    act = m.next_action(1.0)
    assert [b.offset for b in act.metrics.batches] == [0, 1, 2, 3, 4]
    # Past the per-frame cap a report goes at once, as before: the Metrics carries none.
    m = machine(batches_in_metrics=True, batch_report_ms=1e6, batch_size=1, total_samples=500)
    m.handle(plan(0, 0, MAX_BATCHES_PER_REPORT))
    outs = [_step(m)]
    m.handle(plan(0, 100, 5))  # (queued: no early report)
    outs += [_step(m) for _ in range(MAX_BATCHES_PER_REPORT - 1)]
    assert [len(o) for o in outs].count(1) == 1 and outs[-1] and len(outs[-1][0].body.batch) == MAX_BATCHES_PER_REPORT
    assert not m.next_action(1.0).metrics.batches


def test_an_extension_that_revives_the_chunk_before_its_metrics_sends_the_held_batches_at_once():
    # The worker drains control between a batch and its next action: an ExtendPartition
    # read there extends the exhausted chunk, whose Metrics is then a whole chunk away.
    m = machine(batches_in_metrics=True, batch_report_ms=1e6, batch_size=1)
    m.handle(plan(0, 0, 3))  # nothing queued behind it: the extension targets this chunk
    assert _step(m) == []
    (early,) = _step(m)  # one batch left, nothing queued: reported early, to fetch the next plan
    assert [b.offset for b in early.body.batch] == [0, 1]
    assert _step(m) == [] and m.held_for_metrics  # the chunk's last: held for its Metrics
    out = m.handle(ControlReceived(control=pb.Control(command_id=9, extend_partition=pb.Control.ExtendPartition(
        epoch=0, partition_offset=10, partition_size=2))))  # fmt: skip
    (sent,) = out
    assert isinstance(sent, SendTiming) and sent.body.offset == 2  # at once, not a chunk later
    assert m.unsent == [] and not m.held_for_metrics
    assert _step(m)  # (the early report again: one batch left)
    assert _step(m) == []  # the revived chunk's end, held again
    assert [b.offset for b in m.next_action(1.0).metrics.batches] == [11]


def test_an_extension_carried_in_a_request_params_reports_the_held_batches_before_the_snapshot():
    # Protocol 1.2 puts the extension inside the trigger: the snapshot the rank takes for
    # it counts the held batch, so the coordinator must hear that batch first -- it weighs
    # the snapshot by the steps it heard (a relay's folded weight was refused otherwise).
    m = machine(batches_in_metrics=True, batch_report_ms=1e6, batch_size=1)
    m.handle(plan(0, 0, 3))
    _step(m)
    _step(m)  # (the early report: one batch left, nothing queued)
    assert _step(m) == [] and m.held_for_metrics
    rp = pb.Control.RequestParams(cycle=1, extend=pb.Control.ExtendPartition(epoch=0, partition_offset=10, partition_size=2))
    out = m.handle(ControlReceived(control=pb.Control(command_id=9, request_params=rp)))
    assert [type(c).__name__ for c in out] == ["SendTiming", "TakeSnapshot"], out
    assert out[0].body.offset == 2 and out[1].step_count == 3
    assert m.unsent == [] and not m.held_for_metrics
