"""Reference §12 H (stalls and shutdown gating), scenarios 72-75, against the real core.

Already covered elsewhere: 72/73's basic stall -- ``test_averaging.py::test_reduce_stall_ends_the_run``;
75 -- ``test_run.py::test_final_eval_then_shutdown`` and (one rank)
``test_final_round_commits_an_unfolded_tail_before_the_end``.

Deliberate differences from upstream (ARCHITECTURE.md wins):

* 72 and 74 are NCCL scenarios. On the bus plane the same rules read: a round pending
  longer than ``reduce_stall_s`` ends the run with ``ShutdownWithSave{REDUCE_STALL}``, and
  the run never shuts down while a round is open.
* 73's ceiling is the configured ``reduce_stall_s`` (default 300 s), not
  ``max(10 x heartbeat timeout, 300 s)``.
* 74's "rank 1 dead with acks [T,F] -> shutdown": here a death returns the positions of
  the dead rank's unfolded window to the survivors (ARCHITECTURE §6, committed
  coverage), so the run first trains them and shuts down after that.
"""

from __future__ import annotations

from flodl.core import BatchDone, CoreConfig, OpenRound, RunFinished, SyncAcked
from flodl.core import FINISHED, PENDING, SHUTTING_DOWN, TRAINING
from flodl.wire import pb

from .cluster import Cluster, controls


def _pending_round(ws: int = 2, **kw) -> Cluster:
    """Sync, one epoch, every rank trained its whole partition: round 1 pending, no acks."""
    c = Cluster(policy="sync", world_size=ws, total=4 * ws, batch_size=4, epochs=1, defer_acks=True, **kw)
    c.join_all()
    for r in range(ws):
        while c.deliver_one(r):
            pass
        c.train_one(r)
    for r in range(ws):
        while c.deliver_one(r):  # read RequestParams: the acks are now due
            pass
    assert c.state.rounds.phase is PENDING and c.state.rounds.cycle == 1
    return c


# -- 72 / 73 ---------------------------------------------------------------------------------


def test_73_the_stall_ceiling_defaults_to_300_s():
    assert CoreConfig(world_size=2).reduce_stall_s == 300.0


def test_72_73_one_rank_missing_its_ack_stalls_the_run_strictly_after_the_ceiling():
    c = _pending_round(reduce_stall_s=5.0)
    opened = c.state.rounds.opened_at
    c.send_ack(0)
    c.advance(opened + 5.0 - c.now)  # exactly at the ceiling: nothing yet
    assert c.finished is None and c.state.rounds.phase is PENDING
    cmds = c.advance(0.25)
    saves = controls(cmds, "shutdown_with_save")
    assert [r for r, _ in saves] == [0, 1]
    assert {x.shutdown_with_save.reason for _, x in saves} == {pb.SAVE_REASON_REDUCE_STALL}
    assert pb.SAVE_REASON_REDUCE_STALL == 4
    (fin,) = [x for x in cmds if isinstance(x, RunFinished)]
    assert not fin.ok and fin.reason == "reduce stall: round 1 pending > 5s"


def test_72_a_round_that_finished_never_stalls():
    c = _pending_round(reduce_stall_s=5.0, final_eval=False)
    c.send_ack(0)
    c.send_ack(1)
    assert c.state.rounds.phase is not PENDING
    res = c.run()
    assert res.ok and res.reason == "completed"


def test_73_a_cadence_round_stalls_the_same_way():
    c = Cluster(policy="cadence", world_size=2, total=64, batch_size=2, epochs=1, reduce_stall_s=5.0, defer_acks=True)
    c.join_all()
    c.run_until(lambda: c.state.rounds.phase is PENDING)
    while c.deliver_one(0):
        pass
    assert c.send_ack(0)  # rank 1 keeps heartbeating but never answers its RequestParams
    cycle, opened = c.state.rounds.cycle, c.state.rounds.opened_at
    c.advance(opened + 5.0 - c.now)
    assert c.finished is None
    cmds = c.advance(0.25)
    assert {x.shutdown_with_save.reason for _, x in controls(cmds, "shutdown_with_save")} == {pb.SAVE_REASON_REDUCE_STALL}
    assert c.finished.reason == f"reduce stall: round {cycle} pending > 5s"


# -- 74 ----------------------------------------------------------------------------------------


def test_74_shutdown_waits_for_the_open_round_to_settle():
    c = _pending_round(final_eval=False)
    cmds = c.feed(SyncAcked(now=c.now, rank=0, cycle=1, step_count=1))
    assert not controls(cmds, "shutdown") and c.state.run.phase is TRAINING
    cmds = c.feed(SyncAcked(now=c.now, rank=1, cycle=1, step_count=1))
    assert [r for r, _ in controls(cmds, "shutdown")] == [0, 1]
    assert c.state.run.phase is SHUTTING_DOWN


def test_74_a_death_with_its_ack_missing_hands_its_window_back_before_the_shutdown():
    c = _pending_round(final_eval=False)
    c.feed(SyncAcked(now=c.now, rank=0, cycle=1, step_count=1))
    c.ranks[1].ack_due = None
    cmds = c.kill(1)
    assert not controls(cmds, "shutdown")
    ext = [(r, x.extend_partition.partition_offset, x.extend_partition.partition_size)
           for r, x in controls(cmds, "extend_partition")]  # fmt: skip
    assert ext == [(0, 4, 4)]  # rank 1's unfolded batch goes to the survivor
    assert c.state.run.phase is TRAINING
    c.defer_acks = False
    res = c.run()
    assert res.ok and c.out(0)[-1] == "shutdown"
    row = res.summary["coverage"][0]
    assert (row["trained"], row["duplicates"], row["missing"], row["discarded"]) == (8, 0, 0, 4)


# -- 75 ----------------------------------------------------------------------------------------


def test_75_trailing_steps_on_two_ranks_get_a_final_round_before_the_final_eval():
    c = _pending_round()
    for r in (0, 1):  # a step over no samples after the snapshot: unfolded, nothing to train
        c.feed(BatchDone(now=c.now, rank=r, batch_ms=1, data_ms=0, step_count=2, loss=1.0, samples=0, epoch=0, offset=0))
    c.feed(SyncAcked(now=c.now, rank=0, cycle=1, step_count=1))
    cmds = c.feed(SyncAcked(now=c.now, rank=1, cycle=1, step_count=1))
    assert c.state.metrics.last_aggregated == 0
    assert OpenRound(2, (0, 1)) in cmds and not controls(cmds, "execute_eval")
    c.feed(SyncAcked(now=c.now, rank=0, cycle=2, step_count=2))
    cmds = c.feed(SyncAcked(now=c.now, rank=1, cycle=2, step_count=2))
    (ev,) = controls(cmds, "execute_eval")
    assert ev[0] == c.state.roles.eval_role and ev[1].execute_eval.final
    assert c.state.rounds.global_step == 4
    res = c.run()
    assert res.ok and c.state.run.phase is FINISHED
