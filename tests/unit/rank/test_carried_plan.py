"""Protocol 1.2, the rank's side: a window carried in a round's ``RequestParams`` is taken
before the snapshot, as the ``StartEpoch`` / ``ExtendPartition`` sent before it was
(the core's side: tests/unit/core/test_carried_plans.py)."""

from __future__ import annotations

from flodl.rank import ControlReceived, TakeSnapshot, TrainBatch, Warn
from flodl.wire import pb

from .test_machine import machine, plan


def _rp(cycle, **carried):
    return ControlReceived(control=pb.Control(command_id=5, request_params=pb.Control.RequestParams(cycle=cycle, **carried)))


def test_the_rank_takes_a_carried_plan_before_its_snapshot_and_trains_it():
    m = machine()
    out = m.handle(_rp(1, next_plan=pb.EpochPlan(epoch=0, partition_offset=16, partition_size=16)))
    assert [type(c) for c in out] == [TakeSnapshot] and out[0].cycle == 1
    act = m.next_action(0.0)
    assert isinstance(act, TrainBatch) and (act.epoch, act.offset) == (0, 16)
    assert m.last_command_id == 5


def test_a_carried_extension_extends_the_plan_queued_before_it():
    m = machine()
    m.handle(plan(0, 0, 8))
    out = m.handle(_rp(1, extend=pb.Control.ExtendPartition(epoch=0, partition_offset=40, partition_size=8)))
    assert [type(c) for c in out] == [TakeSnapshot]  # no warning: one plan, extended
    assert m.upcoming(4) == [(0, 0, 8), (0, 40, 8)]


def test_a_carried_plan_beyond_the_epoch_is_dropped_by_name_and_a_second_plan_warned():
    m = machine()
    out = m.handle(_rp(1, next_plan=pb.EpochPlan(epoch=0, partition_offset=96, partition_size=16)))
    assert any("RequestParams.next_plan" in getattr(c, "detail", "") for c in out)
    assert isinstance(out[-1], TakeSnapshot)  # the snapshot is still taken
    m.handle(plan(0, 0, 8))
    out = m.handle(_rp(2, next_plan=pb.EpochPlan(epoch=0, partition_offset=8, partition_size=8)))
    assert any(isinstance(c, Warn) and "RequestParams.next_plan" in c.text for c in out)
