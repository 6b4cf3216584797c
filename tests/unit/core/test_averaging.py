"""Averaging (Sync, bus plane): the gate, the trigger, acks, finish, stall."""

import pytest

from flodl.core import (
    BatchDone,
    HeartbeatSeen,
    OpenRound,
    RunFinished,
    SyncAcked,
    Tick,
    should_average,
)
from flodl.core import ROUND as TRANSITIONS
from flodl.core import IDLE, PENDING
from flodl.wire import pb

from flodl.core._dispatch import SYNC

from .cluster import Cluster, controls


def _two_ranks_one_batch_each(**kw):
    """ws 2, total 16, bs 4: both ranks have their plan and trained one batch."""
    c = Cluster(policy="sync", world_size=2, total=16, batch_size=4, **kw)
    c.join_all()
    for r in (0, 1):
        while c.deliver_one(r):
            pass
    c.train_one(0)
    c.train_one(1)
    return c


def _ack(c, rank, step, cycle=1, divergence=0.05):
    return c.feed(SyncAcked(now=c.now, rank=rank, cycle=cycle, step_count=step, divergence=divergence))


def test_sync_cycle_request_throttle_then_update_and_global_step():
    # Scenario 3.
    c = _two_ranks_one_batch_each()
    for r in (0, 1):
        assert c.out(r) == ["start_epoch", "request_params", "throttle"]
    assert c.state.rounds.phase is PENDING and c.state.rounds.version == 0
    _ack(c, 0, 1)
    _ack(c, 1, 1)
    for r in (0, 1):
        assert c.out(r)[-1:] == ["update"]  # the global step rides in it (protocol 1.1): no SetGlobalStep
        update = c.ranks[r].received[-1]
        assert (update.update.version, update.update.cycle) == (1, 1)
        assert update.update.HasField("global_step") and update.update.global_step == 2
        assert update.update.samples_committed == 8  # both ranks' batch of 4: the LR schedules' clock
    assert c.state.rounds.phase is IDLE and c.state.rounds.version == 1


def test_trigger_command_order_open_round_then_requests_then_throttles():
    c = Cluster(policy="sync", world_size=2, total=16, batch_size=4)
    c.join_all()
    for r in (0, 1):
        while c.deliver_one(r):
            pass
    c.train_one(0)
    cmds = c.feed(BatchDone(now=0.0, rank=1, batch_ms=1, data_ms=0, step_count=1, loss=1.0, samples=4,
                            epoch=0, offset=8))
    assert cmds[0] == OpenRound(1, (0, 1))
    assert [(x.rank, x.kind) for x in cmds[1:]] == [
        (0, "request_params"), (1, "request_params"), (0, "throttle"), (1, "throttle"),
    ]
    assert cmds[1].control.request_params.cycle == 1


def test_finish_waits_for_every_ack():
    # Scenario 4.
    c = _two_ranks_one_batch_each()
    _ack(c, 0, 1)
    for _ in range(5):
        c.advance(1.0)
    assert c.state.rounds.phase is PENDING and c.state.rounds.version == 0
    assert "update" not in c.out(0)
    _ack(c, 1, 1)
    assert c.out(0).count("update") == 1 and c.out(1).count("update") == 1
    assert c.state.rounds.version == 1


def test_gate_idle_window_never_fires():
    # Scenario 10.
    c = Cluster(policy="sync", world_size=2, total=16, batch_size=4)
    c.join_all()
    # Nobody moved yet: said before looking for a blocker (asked in O(1); the blocker is
    # named once some rank stepped, test_gate_waits_for_rank_that_has_work_but_no_step).
    assert should_average(c.state) == (False, "no rank has stepped since the last average")
    c2 = Cluster(policy="sync", world_size=2, total=16, batch_size=4)
    c2.join_all()
    c2.state.dispatch.reported[0] = {0: 8, 1: 8}  # everyone idle, nobody moved
    assert should_average(c2.state) == (False, "no rank has stepped since the last average")


def test_gate_waits_for_rank_that_has_work_but_no_step():
    c = Cluster(policy="sync", world_size=2, total=16, batch_size=4)
    c.join_all()
    for r in (0, 1):
        while c.deliver_one(r):
            pass
    c.train_one(0)
    assert should_average(c.state) == (False, "rank 1 has not stepped since the last average")
    assert c.state.rounds.gate_reason == "rank 1 has not stepped since the last average"


def test_gate_idle_rank_does_not_block_the_tail():
    # Scenario 13 (adapted): total 17, bs 8 -> rank 0 has 9 samples (2 batches), rank 1 has 8
    # (1 batch). After the first round rank 1 is idle with 0 steps: the tail still averages.
    c = Cluster(policy="sync", world_size=2, total=17, batch_size=8)
    c.join_all()
    c.run_until(lambda: c.state.rounds.cycle == 2)
    assert c.state.rounds.ranks == (0, 1)
    assert c.state.unfolded(0) == 1 and c.state.unfolded(1) == 0
    assert SYNC.idle(c.state, 1)  # rank 1 had nothing left: it did not block the round


def test_gate_no_active_rank_and_wrong_phase():
    c = Cluster(policy="sync", world_size=2)
    assert should_average(c.state)[1] == "run is FORMING"


def test_pending_round_blocks_the_gate():
    c = _two_ranks_one_batch_each()
    assert should_average(c.state) == (False, "round 1 pending")


def test_round_transition_table():
    assert TRANSITIONS == {
        (IDLE, "trigger"): PENDING,
        (PENDING, "finish"): IDLE,
        (PENDING, "stall"): IDLE,
        (PENDING, "abandon"): IDLE,  # a coordinator restart (_resync)
    }


def test_ack_stale_cycle_ignored():
    c = _two_ranks_one_batch_each()
    _ack(c, 0, 1, cycle=0)
    assert c.state.rounds.acked == {}
    assert c.state.ignored["SyncAcked for a round that is not open"] == 1


def test_ack_duplicate_ignored():
    c = _two_ranks_one_batch_each()
    _ack(c, 0, 1)
    _ack(c, 0, 1)
    assert c.state.ignored["duplicate SyncAcked"] == 1
    assert c.state.rounds.window_steps == 1


def test_ack_commits_batches_up_to_its_step():
    c = _two_ranks_one_batch_each()
    _ack(c, 0, 1)
    ec = c.state.coverage.epochs[0]
    assert (ec.unique, ec.trained) == (4, 4)
    assert c.state.coverage.pending[1] == [(0, 8, 4, 1)]


def test_ack_ahead_of_its_batch_commits_the_batch_on_arrival():
    c = _two_ranks_one_batch_each()
    _ack(c, 0, 2)  # the snapshot saw step 2; its BatchDone is still on the wire
    assert c.state.unfolded(0) == 0
    c.feed(BatchDone(now=0.0, rank=0, batch_ms=1, data_ms=0, step_count=2, loss=1.0, samples=4, epoch=0, offset=4))
    assert c.state.coverage.epochs[0].unique == 8
    assert c.state.coverage.pending.get(0) == []


def test_global_step_adds_folded_steps():
    c = Cluster(policy="sync", world_size=3, total=60, batch_size=4, epochs=2)
    c.join_all()
    res = c.run()
    assert res.summary["global_step"] == sum(r.step for r in c.ranks)
    assert c.state.rounds.version == res.summary["averages"]


def test_divergence_recorded_per_rank():
    c = _two_ranks_one_batch_each()
    _ack(c, 0, 1, divergence=0.25)
    _ack(c, 1, 1, divergence=0.5)
    assert c.state.rounds.divergence == {0: 0.25, 1: 0.5}
    assert c.state.ranks[1].divergence == 0.5


def test_dead_rank_unblocks_the_gate():
    # Scenario 58: ws 3, timeout 1 s; ranks 0 and 1 step, rank 2 silent.
    c = Cluster(policy="sync", world_size=3, total=30, batch_size=2, liveness_timeout_s=1.0)
    c.join_all()
    for r in (0, 1):
        while c.deliver_one(r):
            pass
        c.train_one(r)
    assert c.state.rounds.phase is IDLE
    c.feed(HeartbeatSeen(now=1.5, rank=0))
    c.feed(HeartbeatSeen(now=1.5, rank=1))
    cmds = c.feed(Tick(now=1.5))
    assert OpenRound(1, (0, 1)) in cmds
    assert [r for r, _ in controls(cmds, "request_params")] == [0, 1]
    _ack(c, 0, 1)
    _ack(c, 1, 1)
    assert c.state.rounds.version == 1


def test_death_mid_round_is_excused_and_update_skips_it():
    c = Cluster(policy="sync", world_size=3, total=30, batch_size=2)
    c.join_all()
    for r in range(3):
        while c.deliver_one(r):
            pass
        c.train_one(r)
    assert c.state.rounds.ranks == (0, 1, 2)
    _ack(c, 0, 1)
    _ack(c, 1, 1)
    cmds = c.kill(2)
    assert [r for r, _ in controls(cmds, "update")] == [0, 1]
    assert c.state.rounds.version == 1
    assert c.state.coverage.epochs[0].discarded == 2


def test_reduce_stall_ends_the_run():
    c = _two_ranks_one_batch_each(reduce_stall_s=5.0)
    c.advance(5.0)
    assert c.finished is None
    cmds = c.advance(0.5)
    saves = controls(cmds, "shutdown_with_save")
    assert [r for r, _ in saves] == [0, 1]
    assert saves[0][1].shutdown_with_save.reason == pb.SAVE_REASON_REDUCE_STALL
    (fin,) = [x for x in cmds if isinstance(x, RunFinished)]
    assert not fin.ok and fin.reason == "reduce stall: round 1 pending > 5s"


@pytest.mark.parametrize("ws", [1, 2, 4])
def test_every_round_gets_an_ack_from_every_participant(ws):
    c = Cluster(policy="sync", world_size=ws, total=37, batch_size=3, epochs=2)
    c.join_all()
    assert c.run().ok
    acks = [e for e in c.journal if isinstance(e, SyncAcked)]
    assert len(acks) == ws * c.state.rounds.version
