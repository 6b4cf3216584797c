"""flodl.rank.RankMachine: ``TrimPartition`` gives back the tail of what the rank holds of
an epoch, and its answer names exactly what left (Sync, a rank joined mid-epoch)."""

from __future__ import annotations

from flodl.rank import BatchTrained, SendTiming, TrainBatch
from flodl.wire import pb

from .test_machine import ctl, machine, plan, train


def trim(m, epoch: int, keep: int, cid: int = 9) -> pb.Timing.PartitionTrimmed:
    (sent,) = m.handle(ctl(cid, trim_partition=pb.Control.TrimPartition(epoch=epoch, keep=keep)))
    assert isinstance(sent, SendTiming) and sent.kind == "partition_trimmed"
    return sent.body


def extend(epoch: int, off: int, size: int) -> object:
    return ctl(extend_partition=pb.Control.ExtendPartition(epoch=epoch, partition_offset=off, partition_size=size))


def spans(body) -> list[tuple[int, int]]:
    return [(s.offset, s.size) for s in body.released]


def test_the_tail_beyond_keep_leaves_every_segment_and_the_answer_names_it():
    m = machine()
    m.handle(plan(0, 0, 20))
    train(m)  # [0, 8) trained; the chunk holds [8, 20) and then an extension
    m.handle(extend(0, 50, 10))
    body = trim(m, epoch=0, keep=7, cid=41)
    assert (body.command_id, body.epoch, body.kept) == (41, 0, 7)
    assert spans(body) == [(15, 5), (50, 10)]
    assert [(p.partition_offset, p.partition_size) for p in m.held_positions()] == [(8, 7)]
    got = []
    while isinstance(act := m.next_action(0.0), TrainBatch):
        got.append((act.offset, act.count))
        m.handle(BatchTrained(epoch=0, offset=act.offset, samples=act.count, batch_ms=1.0, loss=0.5))
    assert got == [(8, 7)]  # never a position it gave back


def test_the_batch_on_the_device_is_kept_and_other_epochs_are_untouched():
    m = machine()
    m.handle(plan(0, 0, 24))
    m.handle(plan(1, 0, 30))  # the next epoch, queued (another plan: a warning, kept)
    act = m.next_action(0.0)  # handed out, not trained yet: in hand
    assert (act.offset, act.count) == (0, 8)
    body = trim(m, epoch=0, keep=10)
    assert body.kept == 10 and spans(body) == [(10, 14)]  # 8 in hand + 2 more stay
    held = [(p.epoch, p.partition_offset, p.partition_size) for p in m.held_positions()]
    assert held == [(0, 0, 8), (0, 8, 2), (1, 0, 30)]


def test_a_queued_plan_emptied_by_the_trim_is_dropped_not_reported():
    m = machine()
    m.handle(plan(0, 0, 8))
    m.handle(plan(0, 40, 8))  # a second chunk of the same epoch, queued
    body = trim(m, epoch=0, keep=8)
    assert spans(body) == [(40, 8)] and len(m.plans) == 1
    assert body.kept == 8


def test_keep_beyond_what_is_held_gives_back_nothing():
    m = machine()
    m.handle(plan(0, 0, 16))
    train(m)
    body = trim(m, epoch=0, keep=100)
    assert spans(body) == [] and body.kept == 8
    assert trim(m, epoch=3, keep=0).kept == 0  # an epoch it holds nothing of
