"""A rank tells a restarted coordinator what it may have lost (docs/protocol.md,
"Coordinator restart"): the rank machine's report (``flodl.rank``), as the rank shell
(``flodl_worker.rank``) feeds it."""

from __future__ import annotations

from collections import deque

from flodl.rank import (
    AbandonRounds,
    Admitted,
    BatchTrained,
    Chunk,
    ConsensusReady,
    ControlReceived,
    IncarnationSeen,
    RankMachine,
    TrainBatch,
    Warn,
)
from flodl.wire import pb

from tests.unit.rank.test_machine import ctl, machine, request

def _batch(m: RankMachine, epoch: int, offset: int) -> None:
    m.handle(BatchTrained(epoch=epoch, offset=offset, samples=4, batch_ms=1.0, loss=0.5))


def test_a_new_incarnation_triggers_one_report_before_the_frame():
    m = RankMachine(0)
    assert m.handle(IncarnationSeen(incarnation=11)) == []  # before admission: nothing known
    assert m.incarnation is None
    assert m.handle(IncarnationSeen(incarnation=11, hello_ack=True)) == [] and m.incarnation == 11
    m.handle(Admitted(spec=pb.RunSpec(total_samples=200, batch_size=4, gamma=1.0)))
    for step in range(1, 4):
        _batch(m, 1, 4 * step)
    request(m, 1)
    m.handle(ConsensusReady(cycle=1, arrays=[]))  # a consensus folded steps 1..3
    for step in range(4, 8):
        _batch(m, 1, 4 * step)
    m.handle(ctl(41, start_epoch=pb.Control.StartEpoch()))
    m.finished += [pb.Metrics(epoch=0, chunk_seq=1), pb.Metrics(epoch=1, chunk_seq=2)]
    ea = pb.Control(command_id=42)
    ea.epoch_aggregated.metrics.epoch = 0
    m.handle(ControlReceived(control=ea))
    m.plans.clear()
    m.current = Chunk(epoch=1, seq=3, segments=deque([[32, 8], [100, 0]]))
    m.plans.append(Chunk(epoch=1, seq=4, segments=deque([[60, 12]])))
    m.throttled = True
    request(m, 5)
    assert m.handle(IncarnationSeen(incarnation=11)) == []  # same coordinator
    assert m.is_restart(12) and not m.is_restart(11)
    abandon, sent, warn = m.handle(IncarnationSeen(incarnation=12))  # restarted: report, then the frame
    assert abandon == AbandonRounds(cycles=(5,)) and isinstance(warn, Warn)
    r = sent.body
    assert sent.kind == "resync" and r.coordinator_incarnation == 12 and r.last_command_id == 42
    assert (r.local_step, r.folded_step, r.throttled, r.idle) == (7, 3, True, False)
    assert [b.step_count for b in r.batches] == [4, 5, 6, 7]
    assert [(p.epoch, p.partition_offset, p.partition_size) for p in r.held] == [(1, 32, 8), (1, 60, 12)]
    assert [(c.epoch, c.chunk_seq) for c in r.chunks] == [(1, 2)]
    assert m.snapshots == {}  # their rounds died with the old reducer; the credit stays
    assert m.steps_since_avg == 4
    assert m.handle(IncarnationSeen(incarnation=12)) == []  # once per incarnation
    (drop,) = m.handle(IncarnationSeen(incarnation=11))  # a straggler of the dead one
    assert drop.reason == "stale_incarnation"


def test_an_idle_rank_reports_idle_and_nothing_held():
    m = machine()
    _, sent, _ = m.handle(IncarnationSeen(incarnation=2))
    assert sent.body.idle and not sent.body.held and not sent.body.batches and sent.body.folded_step == 0


def test_a_batch_being_trained_is_held_neither_lost_nor_doubled():
    """A shell that handles frames while its device works (the simulator) reports the
    batch in hand as held; once trained it is a reported batch."""
    m = machine()
    m.handle(ControlReceived(control=pb.Control(start_epoch=pb.Control.StartEpoch(
        plan=pb.EpochPlan(epoch=0, partition_offset=0, partition_size=16)))))
    act = m.next_action(0.0)
    assert act == TrainBatch(epoch=0, offset=0, count=8)
    _, sent, _ = m.handle(IncarnationSeen(incarnation=2))
    assert [(p.partition_offset, p.partition_size) for p in sent.body.held] == [(0, 8), (8, 8)]
    m.handle(BatchTrained(epoch=0, offset=0, samples=8))
    _, sent, _ = m.handle(IncarnationSeen(incarnation=3))
    assert [(p.partition_offset, p.partition_size) for p in sent.body.held] == [(8, 8)]
    assert [(b.offset, b.samples) for b in sent.body.batches] == [(0, 8)]


def test_an_answer_to_a_repeated_hello_is_followed_by_a_report():
    """The first hello_ack (and the first plan) may have died with a coordinator that
    restarted; its successor acks the repeated hello of a member it awaits a resync from."""
    m = RankMachine(0)
    m.handle(IncarnationSeen(incarnation=7, hello_ack=True))
    abandon, sent, _ = m.handle(Admitted(spec=pb.RunSpec(total_samples=8, batch_size=4), hello_resent=True))
    assert abandon == AbandonRounds(cycles=()) and sent.kind == "resync"
    assert sent.body.coordinator_incarnation == 7 and sent.body.idle and sent.body.last_command_id == 0
    quiet = RankMachine(0)
    quiet.handle(IncarnationSeen(incarnation=7, hello_ack=True))
    assert quiet.handle(Admitted(spec=pb.RunSpec(total_samples=8, batch_size=4))) == []
