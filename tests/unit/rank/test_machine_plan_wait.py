"""The plan wait (``Timing.Batch.wait_ms``): how long a rank that has trained sat with
nothing to train, told with the batch that ended the wait.

The coordinator cannot see it: its clock starts when a frame is decoded, after the
transport's and its own queue's delays. The rank's is the real one -- the turnaround
that ElChe's window growth amortises and the summary's ``plan_wait_share`` reports."""

from __future__ import annotations

import pytest

from flodl.rank import WAIT_PLAN, WAIT_THROTTLE, BatchTrained, ControlReceived, SendMetrics, TrainBatch
from flodl.wire import pb

from .test_machine_batch_reports import machine, plan, reported


def train_at(m, now: float) -> list:
    act = m.next_action(now)
    assert isinstance(act, TrainBatch), act
    return m.handle(BatchTrained(epoch=act.epoch, offset=act.offset, samples=act.count, batch_ms=4.0, data_ms=0.0))


def waits(cmds: list) -> list[float]:
    out = []
    for c in cmds:
        if getattr(c, "kind", None) == "batch":
            out.append(c.body.wait_ms)
        elif getattr(c, "kind", None) == "batches":
            out += [b.wait_ms for b in c.body.batch]
    return out


def run_out(m, now: float) -> None:
    """The chunk is trained: the metrics go, then the rank has nothing to do."""
    assert isinstance(m.next_action(now), SendMetrics)
    assert m.next_action(now) is WAIT_PLAN


def test_the_wait_for_the_next_chunk_goes_with_its_first_batch_and_only_that_one():
    m = machine(0.0)
    m.handle(plan(0, 0, 2))
    sent = train_at(m, 0.0) + train_at(m, 0.01)
    run_out(m, 0.02)
    assert m.next_action(0.10) is WAIT_PLAN  # still waiting: the first moment counts, not the last
    m.handle(plan(0, 2, 2))
    sent += train_at(m, 0.27) + train_at(m, 0.28)
    assert waits(sent) == [0.0, 0.0, pytest.approx(250.0), 0.0]
    assert reported(sent) == [(1, 0), (2, 1), (3, 2), (4, 3)]


def test_a_plan_queued_behind_the_chunk_costs_no_wait():
    m = machine(0.0)
    m.handle(plan(0, 0, 1))
    m.handle(plan(0, 1, 1))  # the next chunk arrived while the first trains
    sent = train_at(m, 0.0)
    assert isinstance(m.next_action(0.5), SendMetrics)
    sent += train_at(m, 0.5)
    assert waits(sent) == [0.0, 0.0]


def test_the_wait_for_the_first_plan_is_not_a_plan_wait():
    m = machine(0.0)
    assert m.next_action(0.0) is WAIT_PLAN  # formation, the seed: not a turnaround
    m.handle(plan(0, 0, 2))
    assert waits(train_at(m, 5.0)) == [0.0]


def test_a_throttle_is_not_a_plan_wait():
    m = machine(0.0)
    m.handle(plan(0, 0, 4))
    sent = train_at(m, 0.0)
    m.handle(ControlReceived(control=pb.Control(throttle=pb.Control.Throttle())))
    assert m.next_action(0.01) is WAIT_THROTTLE
    m.handle(ControlReceived(control=pb.Control(update=pb.Control.Update())))
    sent += train_at(m, 0.50)
    assert waits(sent) == [0.0, 0.0]


def test_a_coalesced_frame_carries_each_batch_its_own_wait():
    m = machine(1000.0)  # a frame when the plan runs out, not before
    m.handle(plan(0, 0, 1))
    assert train_at(m, 0.0)  # the plan ran out: its one batch goes at once
    run_out(m, 0.01)
    m.handle(plan(0, 1, 3))
    sent = train_at(m, 0.11) + train_at(m, 0.12) + train_at(m, 0.13)
    assert [c.kind for c in sent] == ["batches", "batch"]  # (its last batch left, then its last)
    assert waits(sent) == [pytest.approx(100.0), 0.0, 0.0]
