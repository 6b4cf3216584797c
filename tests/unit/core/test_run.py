"""Run phase: epoch advance, final round, final eval, shutdown, stop, loss of all ranks."""

import json

from flodl.core import (
    BatchDone,
    SyncAcked,
    FINAL_SCHEDULE_ID,
    EvalDone,
    Notice,
    OpenRound,
    RankExiting,
    RankExitReported,
    Reply,
    RunFinished,
    StopRequested,
    Tick,
)
from flodl.core import RUN as TRANSITIONS
from flodl.core import (
    FINAL_EVAL,
    FINISHED,
    LEFT,
    SHUTTING_DOWN,
    STOPPING,
    TRAINING,
)
from flodl.wire import pb

from .cluster import Cluster, controls


def test_epoch_transition_sync():
    # Scenario 49: ws 2, total 8, bs 4, epochs 2.
    c = Cluster(policy="sync", world_size=2, total=8, batch_size=4, epochs=2, final_eval=False)
    c.join_all()
    res = c.run()
    assert res.ok and res.reason == "completed"
    for r in (0, 1):
        out = c.out(r)
        assert out.count("start_epoch") == 2 and out.count("epoch_aggregated") == 2
        assert out[-1] == "shutdown"
        assert out.index("epoch_aggregated") < [i for i, k in enumerate(out) if k == "start_epoch"][1]
    assert c.state.metrics.last_aggregated == 1
    assert res.summary["epochs_completed"] == 2


def test_final_eval_then_shutdown():
    # Scenario 75: ExecuteEval to the eval role only, then Shutdown once it answers.
    c = Cluster(policy="sync", world_size=2, total=8, batch_size=4, epochs=1)
    c.join_all()
    c.run_until(lambda: c.state.run.phase is FINAL_EVAL)
    (x,) = controls(c.commands, "execute_eval")
    rank, ctl = x
    assert rank == 0
    ev = ctl.execute_eval
    assert (ev.schedule_id, ev.epoch, ev.target_rank, ev.final) == (FINAL_SCHEDULE_ID, 1, 0, True)
    assert "shutdown" not in c.out(0)
    res = c.run()
    assert c.out(0)[-2:] == ["execute_eval", "shutdown"]
    assert "execute_eval" not in c.out(1)
    assert res.summary["accuracy"] == 0.875


def test_no_final_eval_when_disabled():
    c = Cluster(policy="sync", world_size=2, total=8, batch_size=4, epochs=1, final_eval=False)
    c.join_all()
    res = c.run()
    assert not controls(c.commands, "execute_eval")
    assert res.summary["accuracy"] is None


def test_final_eval_error_skips_accuracy():
    c = Cluster(policy="sync", world_size=2, total=8, batch_size=4, epochs=1, eval_error="no held-out set")
    c.join_all()
    res = c.run()
    assert res.ok and res.summary["accuracy"] is None
    assert c.out(1)[-1] == "shutdown"


def test_final_eval_rank_death_resends_to_the_new_eval_role():
    # Roles: the death of the eval target while the final eval is pending resends it
    # to the re-resolved eval role (was: skip the accuracy and shut down).
    c = Cluster(policy="sync", world_size=2, total=8, batch_size=4, epochs=1)
    c.join_all()
    c.run_until(lambda: c.state.run.phase is FINAL_EVAL)
    c.kill(0)
    assert c.state.run.phase is FINAL_EVAL
    assert c.state.roles.eval_role == 1
    (x,) = controls(c.commands, "execute_eval")[1:]
    assert x[0] == 1 and x[1].execute_eval.final and x[1].execute_eval.target_rank == 1
    res = c.run()
    assert res.ok and res.summary["accuracy"] == 0.875


def test_final_eval_target_death_with_nobody_untried_skips_accuracy_and_shuts_down():
    c = Cluster(policy="sync", world_size=3, total=12, batch_size=4, epochs=1)
    for r in c.ranks:
        r.deaf.add("execute_eval")
    c.join_all()
    c.run_until(lambda: c.state.run.phase is FINAL_EVAL)
    final = dict(schedule_id=FINAL_SCHEDULE_ID, epoch=1, metric=0.0, final=True, error="boom")
    c.feed(EvalDone(now=c.now, rank=0, **final))
    c.feed(EvalDone(now=c.now, rank=1, **final))
    assert c.state.run.final_eval.tried == (0, 1, 2)
    c.kill(2)
    assert c.state.run.phase is SHUTTING_DOWN
    assert c.out(0)[-1] == "shutdown" and c.out(1)[-1] == "shutdown"
    res = c.run()
    assert res.ok and res.summary["accuracy"] is None


def test_eval_done_from_other_rank_or_not_final_ignored():
    c = Cluster(policy="sync", world_size=2, total=8, batch_size=4, epochs=1)
    c.join_all()
    c.run_until(lambda: c.state.run.phase is FINAL_EVAL)
    c.feed(EvalDone(now=c.now, rank=1, schedule_id=FINAL_SCHEDULE_ID, epoch=1, metric=0.1, final=True))
    c.feed(EvalDone(now=c.now, rank=0, schedule_id=3, epoch=1, metric=0.2))
    assert c.state.run.phase is FINAL_EVAL
    assert c.state.ignored["EvalDone not awaited"] == 2


def test_final_round_commits_an_unfolded_tail_before_the_end():
    # §11.3 step 1: after the last epoch aggregates, unfolded steps get a final round
    # before the eval, even with one rank. (A step over no samples is the only way to
    # leave one: everything with samples must be committed for the epoch to aggregate.)
    c = Cluster(policy="sync", world_size=1, total=4, batch_size=4, epochs=1)
    c.join_all()
    while c.deliver_one(0):
        pass
    c.train_one(0)  # BatchDone(step 1) + ChunkDone; round 1 opens
    c.feed(BatchDone(now=0.0, rank=0, batch_ms=1, data_ms=0, step_count=2, loss=1.0, samples=0, epoch=0, offset=0))
    cmds = c.feed(SyncAcked(now=0.0, rank=0, cycle=1, step_count=1))
    assert c.state.metrics.last_aggregated == 0
    assert OpenRound(2, (0,)) in cmds
    assert not controls(cmds, "execute_eval")
    cmds = c.feed(SyncAcked(now=0.0, rank=0, cycle=2, step_count=2))
    assert [k for _, k in ((r, ctl.WhichOneof("cmd")) for r, ctl in controls(cmds))] == [
        "update", "execute_eval",
    ]
    assert c.state.rounds.global_step == 2


def test_all_ranks_lost_fails_the_run():
    c = Cluster(policy="sync", world_size=2, total=40, batch_size=4)
    c.join_all()
    c.kill(0)
    cmds = c.kill(1)
    (fin,) = [x for x in cmds if isinstance(x, RunFinished)]
    assert not fin.ok and fin.reason == "all ranks lost"
    (n,) = [x for x in cmds if isinstance(x, Notice) and x.kind == "shutdown_with_save"]
    assert n.data["reason"] == "SAVE_REASON_ALL_RANKS_LOST" and n.data["ranks"] == []
    assert c.state.run.phase is FINISHED


def test_all_ranks_silent_fails_the_run_on_tick():
    c = Cluster(policy="sync", world_size=2, total=40, batch_size=4)
    c.join_all()
    cmds = c.feed(Tick(now=11.0))
    (fin,) = [x for x in cmds if isinstance(x, RunFinished)]
    assert not fin.ok and "all ranks lost" in fin.reason


def test_stop_requested_shuts_down_and_finishes_when_all_left():
    c = Cluster(policy="sync", world_size=2, total=40, batch_size=4)
    c.join_all()
    cmds = c.feed(StopRequested(now=0.0, reason="SIGTERM"))
    stops = controls(cmds, "shutdown")
    assert [r for r, _ in stops] == [0, 1]
    assert stops[0][1].shutdown.reason == "stopped: SIGTERM"
    assert c.state.run.phase is STOPPING
    res = c.run()
    assert not res.ok and res.reason == "stopped: SIGTERM"


def test_stop_finishes_after_liveness_timeout_if_ranks_stay():
    c = Cluster(policy="sync", world_size=2, total=40, batch_size=4)
    c.join_all()
    c.feed(StopRequested(now=0.0))
    for r in c.ranks:
        r.inbox.clear()  # they never see it, but keep heartbeating
    c.advance(5.0)
    assert c.finished is None
    c.advance(5.0)
    assert c.finished is not None and c.finished.reason == "stopped: stop requested"


def test_stop_before_world_forms():
    c = Cluster(policy="sync", world_size=3)
    c.hello(0)
    cmds = c.feed(StopRequested(now=0.0, reason="bye"))
    assert [r for r, _ in controls(cmds, "shutdown")] == [0]
    c.feed(RankExiting(now=0.1, rank=0))
    assert c.finished is not None and not c.finished.ok


def test_exit_report_code_zero_after_shutdown_is_clean():
    c = Cluster(policy="sync", world_size=2, total=8, batch_size=4, epochs=1, final_eval=False)
    c.join_all()
    c.ranks[1].deaf = {"shutdown"}
    c.run_until(lambda: c.state.run.phase is SHUTTING_DOWN)
    c.feed(RankExitReported(now=c.now, rank=1, code=0))  # the agent beat the Exiting frame
    assert c.state.ranks[1].phase is LEFT and c.state.ranks[1].reason == "exited after Shutdown"
    c.ranks[1].alive = False
    res = c.run()
    assert res.ok and res.reason == "completed"


def test_run_finished_summary_shape_is_json_safe():
    c = Cluster(policy="sync", world_size=3, total=50, batch_size=8, epochs=2)
    c.join_all()
    res = c.run()
    s = json.loads(json.dumps(res.summary))
    assert set(s) == {
        "world_size", "policy", "total_samples", "epochs_completed", "averages", "averaging_s", "global_step",
        "accuracy", "wall_s", "discarded_samples", "plan_wait_share", "ranks", "coverage", "epochs", "evals",
    }
    assert s["evals"] == []  # no eval intent was raised
    assert set(s["ranks"][0]) == {"rank", "host", "phase", "reason", "samples", "batches", "batch_frames", "train_s",
                                 "wait_s", "steps", "param_digest"}
    assert set(s["epochs"][0]) == {"epoch", "avg_loss", "epoch_ms", "per_rank_throughput"}
    assert s["ranks"][1]["param_digest"] == "digest-1" and s["ranks"][1]["phase"] == "LEFT"
    assert s["wall_s"] == c.state.now - c.state.run.formed_at


def test_events_after_finish_ignored_and_hello_refused():
    c = Cluster(policy="sync", world_size=1, total=4, batch_size=4, epochs=1)
    c.join_all()
    c.run()
    assert c.feed(Tick(now=c.now + 100)) == []
    (reply,) = [x for x in c.hello(0, route=(b"late",)) if isinstance(x, Reply)]
    assert not reply.ack.accepted and "not admitting" in reply.ack.reason


def test_run_transition_table_has_one_terminal_phase():
    assert not [k for k in TRANSITIONS if k[0] is FINISHED]
    assert {v for v in TRANSITIONS.values()} >= {TRAINING, FINAL_EVAL, SHUTTING_DOWN, STOPPING, FINISHED}


def test_shutdown_with_save_reason_enum_names():
    assert pb.SaveReason.Name(pb.SAVE_REASON_REDUCE_STALL) == "SAVE_REASON_REDUCE_STALL"
