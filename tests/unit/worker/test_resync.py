"""``flodl_worker.resync``: a rank tells a restarted coordinator what it may have lost."""

from __future__ import annotations

from collections import deque
from types import SimpleNamespace

from flodl.wire import pb
from flodl_worker.plans import Chunk
from flodl_worker.resync import RankResync


class FakeRank:
    def __init__(self) -> None:
        self.spec = None
        self.averager = SimpleNamespace(folded_step=0, snapshots={})
        self.current = None
        self.plans: deque = deque()
        self.local_step = 0
        self.throttled = False
        self.sent: list = []
        self.drops: list = []

    def _timing(self, **event) -> None:
        self.sent.append(event)

    def _drop(self, reason: str, detail: str) -> None:
        self.drops.append(reason)


def _env(incarnation: int, body: str = "control") -> pb.Envelope:
    env = pb.Envelope(seq=1)
    env.sender.kind = pb.Sender.KIND_COORDINATOR
    env.sender.incarnation = incarnation
    if body == "hello_ack":
        env.hello_ack.accepted = True
    else:
        env.control.coord_heartbeat.beat = 1
    return env


def _batch(step: int, offset: int) -> pb.Timing.Batch:
    return pb.Timing.Batch(step_count=step, epoch=1, offset=offset, samples=4, batch_ms=1.0, batch_loss=0.5)


def test_a_new_incarnation_triggers_one_report_before_the_frame():
    r = FakeRank()
    rs = RankResync(r)
    assert rs.on_frame(_env(11, "control"))  # before admission: nothing known, nothing to do
    assert rs.incarnation is None
    assert rs.on_frame(_env(11, "hello_ack")) and rs.incarnation == 11
    r.spec = pb.RunSpec()
    for step in range(1, 7):
        rs.note_batch(_batch(step, 4 * step))
    r.averager.folded_step = 3  # a consensus folded steps 1..3
    rs.note_batch(_batch(7, 28))
    rs.on_control(pb.Control(command_id=41, start_epoch=pb.Control.StartEpoch()))
    rs.note_metrics(pb.Metrics(epoch=0, chunk_seq=1))
    rs.note_metrics(pb.Metrics(epoch=1, chunk_seq=2))
    ea = pb.Control(command_id=42)
    ea.epoch_aggregated.metrics.epoch = 0
    rs.on_control(ea)
    r.current = Chunk(epoch=1, seq=3, segments=deque([[32, 8], [100, 0]]))
    r.plans.append(Chunk(epoch=1, seq=4, segments=deque([[60, 12]])))
    r.local_step, r.throttled = 7, True
    r.averager.snapshots[5] = object()
    assert rs.on_frame(_env(11)) and r.sent == []  # same coordinator
    assert rs.on_frame(_env(12))  # restarted: report, then handle the frame
    (ev,) = r.sent
    m = ev["resync"]
    assert m.coordinator_incarnation == 12 and m.last_command_id == 42
    assert (m.local_step, m.folded_step, m.throttled, m.idle) == (7, 3, True, False)
    assert [b.step_count for b in m.batches] == [4, 5, 6, 7]
    assert [(p.epoch, p.partition_offset, p.partition_size) for p in m.held] == [(1, 32, 8), (1, 60, 12)]
    assert [(c.epoch, c.chunk_seq) for c in m.chunks] == [(1, 2)]
    assert r.averager.snapshots == {}  # their rounds died with the old reducer
    assert rs.on_frame(_env(12)) and len(r.sent) == 1  # once per incarnation
    assert not rs.on_frame(_env(11))  # a straggler of the dead one
    assert r.drops == ["stale_incarnation"]


def test_an_idle_rank_reports_idle_and_nothing_held():
    r = FakeRank()
    rs = RankResync(r)
    rs.on_frame(_env(1, "hello_ack"))
    r.spec = pb.RunSpec()
    rs.on_frame(_env(2))
    m = r.sent[0]["resync"]
    assert m.idle and not m.held and not m.batches and m.folded_step == 0
