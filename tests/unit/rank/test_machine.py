"""flodl.rank.RankMachine: the rank's protocol decisions, events in, commands out."""

from __future__ import annotations

from flodl.rank import (
    WAIT_PLAN,
    WAIT_THROTTLE,
    Admitted,
    ApplyConsensus,
    BatchTrained,
    ConsensusReady,
    ControlReceived,
    Drop,
    Exit,
    FormGroup,
    IncarnationSeen,
    RankMachine,
    RunEpochFn,
    RunEval,
    SaveCheckpoint,
    SendMetrics,
    SendTiming,
    TakeSnapshot,
    TrainBatch,
    Warn,
)
from flodl.wire import pb


def machine(rank: int = 0, **spec) -> RankMachine:
    m = RankMachine(rank)
    m.handle(IncarnationSeen(incarnation=1, hello_ack=True))
    base = dict(total_samples=100, batch_size=8, gamma=1.0, policy=pb.POLICY_CADENCE)
    base.update(spec)
    m.handle(Admitted(spec=pb.RunSpec(**base)))
    return m


def ctl(cid: int = 0, **body) -> ControlReceived:
    return ControlReceived(control=pb.Control(command_id=cid, **body))


def plan(epoch: int, off: int, size: int, cid: int = 0) -> ControlReceived:
    return ctl(cid, start_epoch=pb.Control.StartEpoch(plan=pb.EpochPlan(epoch=epoch, partition_offset=off, partition_size=size)))


def train(m: RankMachine, now: float = 0.0) -> TrainBatch:
    act = m.next_action(now)
    assert isinstance(act, TrainBatch), act
    (sent,) = m.handle(BatchTrained(epoch=act.epoch, offset=act.offset, samples=act.count, batch_ms=2.0, loss=0.5))
    assert isinstance(sent, SendTiming) and sent.kind == "batch"
    return act


def request(m: RankMachine, cycle: int) -> TakeSnapshot:
    (snap,) = m.handle(ctl(request_params=pb.Control.RequestParams(cycle=cycle)))
    assert isinstance(snap, TakeSnapshot)
    return snap


def checkpoint(m: RankMachine, version: int, cycle: int, path: str = "/x/model.pt", target: int = 0) -> list:
    return m.handle(ctl(checkpoint=pb.Control.Checkpoint(version=version, target_rank=target, path=path, cycle=cycle)))


# -- plans -----------------------------------------------------------------------------


def test_plans_batches_never_straddle_a_segment_and_metrics_follow_the_last():
    m = machine()
    assert m.next_action(0.0) is WAIT_PLAN
    m.handle(plan(0, 0, 20))
    m.handle(ctl(extend_partition=pb.Control.ExtendPartition(epoch=0, partition_offset=50, partition_size=4)))
    # The extension arrived before the chunk started: it extends that queued plan (the
    # rest of a window, sent right behind it), one chunk, one metrics frame.
    got = [(b.offset, b.count) for b in (train(m, 1.0), train(m), train(m), train(m))]
    assert got == [(0, 8), (8, 8), (16, 4), (50, 4)]
    act = m.next_action(3.0)
    assert isinstance(act, SendMetrics) and act.metrics.batches_processed == 4
    assert act.metrics.samples_processed == 24 and act.metrics.epoch_ms == 2000.0
    m.handle(plan(0, 70, 8))
    assert train(m).offset == 70
    m.handle(ctl(extend_partition=pb.Control.ExtendPartition(epoch=0, partition_offset=60, partition_size=8)))
    assert (train(m).offset, m.current.seq) == (60, 2)  # appended to the chunk in training
    assert isinstance(m.next_action(0.0), SendMetrics) and m.next_action(0.0) is WAIT_PLAN
    # Of another epoch than every plan it holds: a chunk of its own.
    m.handle(ctl(extend_partition=pb.Control.ExtendPartition(epoch=1, partition_offset=0, partition_size=8)))
    assert (train(m).epoch, m.current.seq) == (1, 3)


def test_a_plan_beyond_the_epoch_is_dropped_and_a_second_queued_one_warned():
    m = machine()
    assert m.handle(plan(0, 96, 8)) == [Drop(reason="bad_plan", detail="StartEpoch [96, 104) exceeds 100 samples")]
    assert m.handle(plan(0, 0, 8)) == []
    (w,) = m.handle(plan(0, 8, 8))
    assert isinstance(w, Warn) and "keeping both" in w.text
    assert [p.partition_offset for p in m.held_positions()] == [0, 8]


def test_throttle_waits_but_a_finished_chunk_still_reports():
    m = machine()
    m.handle(plan(0, 0, 8))
    train(m)
    m.handle(ctl(throttle=pb.Control.Throttle()))
    assert isinstance(m.next_action(0.0), SendMetrics)  # reporting is not training
    m.handle(plan(0, 8, 8))
    assert m.next_action(0.0) is WAIT_THROTTLE
    nxt = pb.EpochPlan(epoch=1, partition_offset=0, partition_size=8)
    assert m.handle(ctl(update=pb.Control.Update(version=1, next_plan=nxt))) == []
    assert not m.throttled and train(m).offset == 8


# -- credit ------------------------------------------------------------------------------


def test_credit_is_taken_off_by_the_snapshot_and_steps_in_the_round_keep_theirs():
    m = machine(gamma=0.5)
    m.handle(plan(0, 0, 64))
    for _ in range(4):
        train(m)
    snap = request(m, 1)
    assert (snap.n, snap.step_count, snap.weight) == (4, 4, 2.0)
    train(m)  # Cadence: the next window trains while the round is open
    (apply,) = m.handle(ConsensusReady(cycle=1, arrays=["c"]))
    assert apply == ApplyConsensus(cycle=1, arrays=["c"], ack_step=4, moved=True)
    assert (m.steps_since_avg, m.folded_step) == (1, 4)
    # Not included (weight 0, a dropped fold): keep local, ack the last folded step.
    request(m, 2)
    (apply,) = m.handle(ConsensusReady(cycle=2, arrays=None))
    assert (apply.ack_step, apply.arrays, apply.moved) == (4, None, False)
    assert (m.steps_since_avg, m.folded_step) == (1, 4)
    assert m.handle(ConsensusReady(cycle=9, arrays=[]))[0].reason == "unknown_cycle"


def test_an_idle_rank_snapshots_weight_zero():
    m = machine()
    assert request(m, 1).weight == 0.0


# -- checkpoints ----------------------------------------------------------------------


def test_a_checkpoint_asked_first_is_armed_and_saved_right_after_its_consensus():
    m = machine()
    m.handle(plan(0, 0, 64))
    train(m)
    request(m, 1)
    assert checkpoint(m, 5, 1) == []  # armed
    assert checkpoint(m, 6, 3) == []  # armed for a later cycle
    apply, save = m.handle(ConsensusReady(cycle=1, arrays=["a1"]))
    assert isinstance(apply, ApplyConsensus) and isinstance(save, SaveCheckpoint)
    assert (save.command.version, save.params) == (5, ["a1"])
    train(m)
    request(m, 4)  # cycle 3 never reached this rank
    apply, warn, res = m.handle(ConsensusReady(cycle=4, arrays=["a4"]))
    assert isinstance(warn, Warn) and res.kind == "checkpoint_result"
    assert res.body.version == 6 and "consensus of cycle 3 never reached this rank" in res.body.error


def test_the_held_consensus_is_saved_after_steps_since_and_an_older_one_refused_by_name():
    m = machine()
    m.handle(plan(0, 0, 64))
    train(m)
    request(m, 1)
    m.handle(ConsensusReady(cycle=1, arrays=["a1"]))
    train(m)
    train(m)
    (save,) = checkpoint(m, 7, 1)
    assert save.params == ["a1"]
    request(m, 2)
    m.handle(ConsensusReady(cycle=2, arrays=None))  # not included: nothing held
    train(m)
    _, res = checkpoint(m, 8, 2)
    assert "consensus of cycle 2 is no longer held" in res.body.error and "last applied cycle 2" in res.body.error
    assert checkpoint(m, 9, 0) == [SaveCheckpoint(command=pb.Control.Checkpoint(version=9, path="/x/model.pt"))]
    assert checkpoint(m, 10, 0, target=1) == []  # another rank's duty
    _, res = checkpoint(m, 11, 0, path="")
    assert "no path" in res.body.error


# -- the rest of the control vocabulary ---------------------------------------------------


def test_evals_roles_rendezvous_and_shutdown():
    m = machine(rank=1)
    assert m.handle(ctl(execute_eval=pb.Control.ExecuteEval(schedule_id=3, target_rank=0))) == []
    (ev,) = m.handle(ctl(execute_eval=pb.Control.ExecuteEval(schedule_id=3, target_rank=1)))
    assert isinstance(ev, RunEval) and ev.command.schedule_id == 3
    ea = pb.Control()
    ea.epoch_aggregated.metrics.epoch = 0
    assert m.handle(ControlReceived(control=ea)) == []
    m.handle(ctl(set_epoch_callback_role=pb.Control.SetEpochCallbackRole(rank=1)))
    assert isinstance(m.handle(ControlReceived(control=ea))[0], RunEpochFn)
    (d,) = m.handle(ctl(rendezvous=pb.Control.Rendezvous(generation=1)))
    assert d.reason == "unsupported_control"  # bus plane
    coll = machine(plane=pb.PLANE_COLLECTIVE)
    assert isinstance(coll.handle(ctl(rendezvous=pb.Control.Rendezvous(generation=1)))[0], FormGroup)
    assert m.handle(ControlReceived(control=pb.Control()))[0].reason == "malformed"
    assert m.handle(ctl(coord_heartbeat=pb.Control.CoordHeartbeat(beat=1))) == []
    m.handle(ctl(set_global_step=pb.Control.SetGlobalStep(global_step=12)))
    assert m.global_step == 12
    assert m.handle(ctl(shutdown_with_save=pb.Control.ShutdownWithSave())) == [Exit(reason="shutdown_with_save", steps=0)]
    assert m.handle(plan(0, 0, 8)) == []  # gone: nothing more is decided


def test_a_plan_that_carries_the_epoch_role_names_who_runs_epoch_fn():
    ea = pb.Control()
    ea.epoch_aggregated.metrics.epoch = 0
    holder, other = machine(rank=1), machine(rank=0)
    carrying = pb.Control.StartEpoch(plan=pb.EpochPlan(epoch=0, partition_size=8), epoch_callback_role=1)
    for m in (holder, other):
        assert m.handle(ctl(start_epoch=carrying)) == []
        assert m.epoch_role == 1
    assert isinstance(holder.handle(ControlReceived(control=ea))[0], RunEpochFn)
    assert other.handle(ControlReceived(control=ea)) == []
    holder.handle(plan(0, 8, 8))  # a plan without it keeps the role told before
    assert holder.epoch_role == 1


def test_upcoming_lists_the_batches_next_action_will_hand_out_without_taking_them():
    m = machine()
    m.handle(plan(0, 0, 20))
    m.handle(ctl(extend_partition=pb.Control.ExtendPartition(epoch=0, partition_offset=90, partition_size=5)))
    m.handle(ctl(update=pb.Control.Update(next_plan=pb.EpochPlan(epoch=1, partition_offset=40, partition_size=9))))
    ahead = m.upcoming(10)
    assert ahead == [(0, 0, 8), (0, 8, 8), (0, 16, 4), (0, 90, 5), (1, 40, 8), (1, 48, 1)]
    assert m.upcoming(2) == ahead[:2] and m.upcoming(0) == []
    handed = []
    while True:
        act = m.next_action(0.0)
        if isinstance(act, SendMetrics):
            continue
        if not isinstance(act, TrainBatch):
            break
        assert m.upcoming(10) == ahead[len(handed) + 1 :]  # in hand: no longer upcoming
        m.handle(BatchTrained(epoch=act.epoch, offset=act.offset, samples=act.count))
        handed.append((act.epoch, act.offset, act.count))
    assert handed == ahead


def test_set_global_step_carries_the_runs_committed_samples():
    m = machine()
    m.handle(ctl(set_global_step=pb.Control.SetGlobalStep(global_step=12, samples_committed=96)))
    assert (m.global_step, m.samples_committed) == (12, 96)


def test_a_rounds_update_carries_the_runs_progress():
    # Protocol 1.1: the global step rides in the Update; an Update without it (none of a
    # 1.0 coordinator's) leaves the progress where its SetGlobalStep put it.
    m = machine()
    m.handle(ctl(update=pb.Control.Update(version=1, cycle=1, global_step=12, samples_committed=96)))
    assert (m.global_step, m.samples_committed) == (12, 96)
    m.handle(ctl(update=pb.Control.Update(version=2, cycle=2)))
    assert (m.global_step, m.samples_committed) == (12, 96)


def test_admission_starts_the_runs_progress_where_the_coordinator_is():
    m = RankMachine(0)
    spec = pb.RunSpec(total_samples=100, batch_size=8, gamma=1.0, global_step=40, samples_committed=320)
    m.handle(Admitted(spec=spec, global_step=35))  # a resume's checkpoint said 35; the run is at 40
    assert (m.global_step, m.samples_committed) == (40, 320)
