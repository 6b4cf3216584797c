"""Coalesced batch reports (``RunSpec.batch_report_ms``): fewer frames, nothing late.

A rank reports its batches at most once per ``batch_report_ms`` of training time, but
never holds one back past a moment the coordinator decides on: its plan running out,
a throttle, or any other frame it sends (a snapshot is weighed, an ack commits and a
trim is read by the batches the coordinator heard)."""

from __future__ import annotations

from flodl.rank import (
    Admitted,
    ApplyConsensus,
    BatchTrained,
    ConsensusReady,
    ControlReceived,
    HeartbeatDue,
    IncarnationSeen,
    RankMachine,
    SendTiming,
    TakeSnapshot,
    TrainBatch,
)
from flodl.rank._machine import MAX_BATCHES_PER_REPORT
from flodl.wire import pb


def machine(report_ms: float, batch_size: int = 1) -> RankMachine:
    m = RankMachine(0)
    m.handle(IncarnationSeen(incarnation=1, hello_ack=True))
    m.handle(Admitted(spec=pb.RunSpec(total_samples=1000, batch_size=batch_size, gamma=1.0,
                                      policy=pb.POLICY_CADENCE, batch_report_ms=report_ms)))  # fmt: skip
    return m


def plan(epoch: int, off: int, size: int) -> ControlReceived:
    return ControlReceived(control=pb.Control(start_epoch=pb.Control.StartEpoch(
        plan=pb.EpochPlan(epoch=epoch, partition_offset=off, partition_size=size))))  # fmt: skip


def train(m: RankMachine, ms: float = 4.0) -> list:
    act = m.next_action(0.0)
    assert isinstance(act, TrainBatch), act
    return m.handle(BatchTrained(epoch=act.epoch, offset=act.offset, samples=act.count, batch_ms=ms, data_ms=1.0))


def reported(cmds: list) -> list[tuple[int, int]]:
    """(step_count, offset) of every batch the commands send, in order."""
    out = []
    for c in cmds:
        if isinstance(c, SendTiming) and c.kind == "batch":
            out.append((c.body.step_count, c.body.offset))
        elif isinstance(c, SendTiming) and c.kind == "batches":
            out += [(b.step_count, b.offset) for b in c.body.batch]
    return out


def test_zero_sends_a_frame_per_batch():
    m = machine(0.0)
    m.handle(plan(0, 0, 10))
    for i in range(3):
        (c,) = train(m)
        assert c.kind == "batch" and c.body.step_count == i + 1


def test_fast_batches_go_several_to_a_frame_once_their_time_is_due():
    m = machine(20.0)  # 5 ms a batch (4 compute + 1 data): a frame every 4 batches
    m.handle(plan(0, 0, 100))
    frames = [train(m) for _ in range(12)]
    sent = [f for f in frames if f]
    assert [len(f) for f in frames] == [0, 0, 0, 1] * 3
    assert all(f[0].kind == "batches" and len(f[0].body.batch) == 4 for f in sent)
    assert reported([c for f in frames for c in f]) == [(s, s - 1) for s in range(1, 13)]  # every batch, in order


def test_slow_batches_are_reported_one_by_one_as_before():
    m = machine(20.0)
    m.handle(plan(0, 0, 10))
    for _ in range(3):
        (c,) = train(m, ms=30.0)
        assert c.kind == "batch"


def test_a_plan_down_to_its_last_batch_is_reported_and_its_last_batch_goes_at_once():
    m = machine(1000.0)
    m.handle(plan(0, 0, 3))
    assert train(m) == []
    (c,) = train(m)  # one batch left, nothing queued: the next plan can come while it trains it
    assert reported([c]) == [(1, 0), (2, 1)]
    (c,) = train(m)  # the plan ran out: the coordinator plans the next one by this
    assert reported([c]) == [(3, 2)]


def test_a_plan_down_to_its_last_batch_with_another_queued_is_not_reported_early():
    m = machine(1000.0)
    m.handle(plan(0, 0, 3))
    m.handle(plan(0, 3, 3))  # queued behind it: nothing to run dry of
    assert train(m) == [] and train(m) == []
    (c,) = train(m)  # the plan ran out: reported at once, as always
    assert reported([c]) == [(1, 0), (2, 1), (3, 2)]


def test_a_frame_never_exceeds_its_bound():
    m = machine(999.0)
    m.handle(plan(0, 0, 500))
    frames = [f for f in (train(m, ms=0.0) for _ in range(MAX_BATCHES_PER_REPORT * 2)) if f]
    assert [len(f[0].body.batch) for f in frames] == [MAX_BATCHES_PER_REPORT] * 2


def test_unsent_batches_go_before_the_snapshot_that_counts_them():
    m = machine(1000.0)
    m.handle(plan(0, 0, 100))
    train(m), train(m)
    cmds = m.handle(ControlReceived(control=pb.Control(request_params=pb.Control.RequestParams(cycle=1))))
    assert [type(c) for c in cmds] == [SendTiming, TakeSnapshot]
    assert reported(cmds) == [(1, 0), (2, 1)] and cmds[1].n == 2  # the weight the coordinator checks
    assert m.unsent == []


def test_unsent_batches_go_before_the_ack_that_commits_them():
    m = machine(1000.0)
    m.handle(plan(0, 0, 100))
    train(m)
    m.handle(ControlReceived(control=pb.Control(request_params=pb.Control.RequestParams(cycle=1))))
    train(m)  # trained during the round: not in the snapshot, unsent
    cmds = m.handle(ConsensusReady(cycle=1, arrays=[0.0]))
    assert [type(c) for c in cmds][:2] == [SendTiming, ApplyConsensus] and reported(cmds) == [(2, 1)]


def test_a_throttle_sends_what_is_unsent():
    m = machine(1000.0)
    m.handle(plan(0, 0, 100))
    train(m), train(m)
    act = m.next_action(0.0)  # on the device when the throttle comes
    cmds = m.handle(ControlReceived(control=pb.Control(throttle=pb.Control.Throttle())))
    assert reported(cmds) == [(1, 0), (2, 1)]
    done = m.handle(BatchTrained(epoch=act.epoch, offset=act.offset, samples=act.count, batch_ms=1.0))
    assert reported(done) == [(3, 2)]  # throttled: at once too


def test_a_coordinator_restart_reports_unsent_batches_in_the_resync_once():
    m = machine(1000.0)
    m.handle(plan(0, 0, 100))
    train(m), train(m)
    cmds = m.handle(IncarnationSeen(incarnation=2))
    (resync,) = [c for c in cmds if isinstance(c, SendTiming)]
    assert resync.kind == "resync" and [b.step_count for b in resync.body.batches] == [1, 2]
    assert m.unsent == []  # not sent again as batches
    assert reported(train(m, ms=2000.0)) == [(3, 2)]


def test_the_step_that_ends_the_window_goes_at_once():
    m = machine(1000.0)
    m.handle(plan(0, 0, 100))
    train(m)
    m.handle(ControlReceived(control=pb.Control(update=pb.Control.Update(version=1, cycle=1, report_at_step=3))))
    assert train(m) == []  # step 2
    assert reported(train(m)) == [(1, 0), (2, 1), (3, 2)]  # step 3: the next round waits for it
    assert train(m) == []  # once: later batches coalesce again


def test_a_due_heartbeat_is_the_report_of_the_batches_held_else_a_heartbeat():
    # The shell says a heartbeat interval passed with no timing frame: the batches held
    # for the next report go now -- that frame is the heartbeat -- and with none held,
    # a heartbeat goes (with the local step).
    m = machine(100.0)
    m.handle(plan(0, 0, 100))
    assert train(m) == [] and train(m) == []  # 10 ms of a 100 ms report: held
    (c,) = m.handle(HeartbeatDue())
    assert c.kind == "batches" and reported([c]) == [(1, 0), (2, 1)]
    (c,) = m.handle(HeartbeatDue())
    assert c.kind == "heartbeat" and c.body.step_count == 2
    assert train(m) == []  # the next report starts from nothing held: no batch twice
    (c,) = m.handle(HeartbeatDue())
    assert reported([c]) == [(3, 2)]


def test_a_stretched_interval_still_reports_every_report_batches_past_its_floor():
    """``RunSpec.report_batches``: with the interval stretched to 128 ms, a rank holding 4
    batches and at least ``report_floor_ms`` (25) of training reports them; short batches
    (4 of 5 ms: 20 ms) wait for the floor; 0 is no cap."""
    def capped(cap: int) -> RankMachine:
        m = RankMachine(0)
        m.handle(IncarnationSeen(incarnation=1, hello_ack=True))
        m.handle(Admitted(spec=pb.RunSpec(total_samples=1000, batch_size=1, gamma=1.0, policy=pb.POLICY_CADENCE,
                                          batch_report_ms=128.0, report_batches=cap, report_floor_ms=25.0)))  # fmt: skip
        m.handle(plan(0, 0, 100))
        return m

    m = capped(4)
    assert [reported(train(m, ms=9.0)) for _ in range(4)] == [[], [], [], [(1, 0), (2, 1), (3, 2), (4, 3)]]  # 40 ms
    m = capped(4)  # 5 ms batches (4 + 1 ms data): 4 of them are 20 ms, the floor is met at the 5th
    assert [bool(reported(train(m))) for _ in range(5)] == [False] * 4 + [True]
    m = capped(0)  # no cap: the stretched interval alone (128 ms: 13 batches of 10 ms)
    assert [bool(reported(train(m, ms=9.0))) for _ in range(13)] == [False] * 12 + [True]
