"""A rank tells a restarted coordinator what it may have lost (docs/protocol.md,
"Coordinator restart"): the rank machine's report (``flodl.rank``), as the rank shell
(``flodl_worker.rank``) feeds it."""

from __future__ import annotations

from flodl.rank import AbandonRounds, Admitted, BatchTrained, ConsensusReady, ControlReceived, IncarnationSeen, RankMachine, Warn
from flodl.wire import pb

from tests.unit.rank.test_machine import ctl, machine, plan, request

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
    m.handle(plan(1, 32, 8))
    m.next_action(0.0)  # the chunk in training: [32, 8) minus its first batch
    m.current.segments = type(m.current.segments)([[32, 8], [100, 0]])
    m.handle(plan(1, 60, 12))
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
