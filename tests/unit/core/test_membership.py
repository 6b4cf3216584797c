"""Membership and liveness: admission, refusals, deaths, clean exits, the beacon."""

import copy

import pytest

from flodl.core import (
    CoreConfig,
    ForgetRank,
    HeartbeatSeen,
    LocalViolation,
    RankExiting,
    RankExitReported,
    RankViolation,
    Reply,
    Send,
    SendFailed,
    Tick,
)
from flodl.core._membership import TRANSITIONS, transition
from flodl.core._state import ACTIVE, DEAD, JOINING, LEFT, VACANT, RankRecord
from flodl.wire import pb

from .cluster import Cluster


def _ack(cmds):
    (reply,) = [c for c in cmds if isinstance(c, Reply)]
    return reply.ack


def _refused(cmds):
    ack = _ack(cmds)
    assert not ack.accepted
    return ack.reason


# -- admission ---------------------------------------------------------------------------


def test_hello_accepted_carries_run_spec():
    c = Cluster(policy="sync", world_size=2, total=10, batch_size=4, epochs=5, seed=7, gamma=0.5)
    ack = _ack(c.hello(0))
    assert ack.accepted and ack.reason == ""
    run = ack.run
    assert (run.world_size, run.total_samples, run.batch_size, run.num_epochs, run.seed) == (2, 10, 4, 5, 7)
    assert run.policy == pb.POLICY_SYNC and run.plane == pb.PLANE_BUS
    assert run.gamma == 0.5
    assert run.heartbeat_interval_s == 1.0 and run.liveness_timeout_s == 10.0
    assert c.state.ranks[0].phase is JOINING


def test_hello_refused_rank_out_of_range():
    c = Cluster(policy="sync", world_size=2)
    assert _refused(c.hello(2)) == "rank 2 out of range [0, 2)"
    assert _refused(c.hello(-1)) == "rank -1 out of range [0, 2)"


def test_hello_refused_world_size_differs():
    c = Cluster(policy="sync", world_size=2)
    assert _refused(c.hello(0, world_size=3)) == "world_size 3 differs from the coordinator's 2"


def test_hello_refused_rank_already_admitted_from_another_route():
    c = Cluster(policy="sync", world_size=2)
    c.hello(0)
    reason = _refused(c.hello(0, route=(b"elsewhere",)))
    assert reason.startswith("rank 0 already admitted from another route or incarnation")


def test_hello_refused_rank_already_admitted_other_incarnation():
    c = Cluster(policy="sync", world_size=2)
    c.hello(0)
    assert "already admitted" in _refused(c.hello(0, incarnation=5))


def test_hello_refused_model_signature_differs():
    c = Cluster(policy="sync", world_size=2)
    c.hello(0)
    reason = _refused(c.hello(1, model_sig=b"\x01\x02"))
    assert reason.startswith("model signature differs from the cohort's (0102 vs 5a5a")


def test_hello_refused_dataset_len_differs_from_cohort():
    c = Cluster(policy="sync", world_size=2, total=100)
    c.hello(0)
    assert _refused(c.hello(1, dataset_len=99)) == "dataset_len 99 differs from the cohort's 100"


def test_hello_refused_dataset_len_differs_from_config_total():
    c = Cluster(policy="sync", world_size=2, total=100, total_samples=100)
    assert _refused(c.hello(0, dataset_len=50)) == "dataset_len 50 differs from total_samples 100"


def test_hello_refused_dataset_len_below_one():
    c = Cluster(policy="sync", world_size=2, total=0)
    assert _refused(c.hello(0)) == "dataset_len 0 < 1"


def test_hello_refusal_order_range_before_world_size():
    c = Cluster(policy="sync", world_size=2)
    assert "out of range" in _refused(c.hello(5, world_size=9))


def test_hello_refusal_order_world_size_before_signature():
    c = Cluster(policy="sync", world_size=2)
    c.hello(0)
    assert "world_size" in _refused(c.hello(1, world_size=3, model_sig=b"zz", dataset_len=0))


def test_hello_refusal_changes_nothing_but_the_reply():
    c = Cluster(policy="sync", world_size=2)
    c.hello(0)
    before = copy.deepcopy(c.state)
    cmds = c.hello(1, model_sig=b"other")
    assert [type(x) for x in cmds] == [Reply]
    assert c.state == before


def test_hello_retransmit_is_acked_again_idempotently():
    c = Cluster(policy="sync", world_size=2)
    c.join_all()
    starts = len(c.sends("start_epoch"))
    cmds = c.hello(0)
    assert _ack(cmds).accepted
    assert [type(x) for x in cmds] == [Reply]
    assert len(c.sends("start_epoch")) == starts


def test_hello_for_dead_rank_refused_no_rejoin():
    c = Cluster(policy="sync", world_size=2)
    c.join_all()
    c.kill(1)
    reason = _refused(c.hello(1, route=(b"new",), incarnation=1))
    assert reason.startswith("rank 1 already left the run (DEAD: killed by signal 9)")


def test_world_forms_when_all_admitted():
    c = Cluster(policy="sync", world_size=3)
    c.hello(0)
    c.hello(1)
    assert not c.sends("start_epoch")
    assert c.state.ranks[0].phase is JOINING
    c.hello(2)
    assert [s.rank for s in c.sends("start_epoch")] == [0, 1, 2]
    assert all(r.phase is ACTIVE for r in c.state.ranks)
    assert c.state.run.formed_at == c.now


def test_route_of_maps_rank_to_route_while_addressable():
    c = Cluster(policy="sync", world_size=2)
    assert c.state.route_of(0) is None
    c.hello(0)
    assert c.state.route_of(0) == (b"relay", b"rank-0")
    assert c.state.route_of(7) is None
    c.hello(1)
    c.kill(0)
    assert c.state.route_of(0) is None


# -- the transition table ------------------------------------------------------------------


def test_transition_table_terminal_phases_have_no_moves():
    assert not [k for k in TRANSITIONS if k[0] in (DEAD, LEFT)]


def test_transition_missing_entry_names_phase_and_trigger():
    rec = RankRecord(3, phase=DEAD)
    with pytest.raises(LocalViolation, match=r"rank 3: no transition from DEAD on 'admit'"):
        transition(rec, "admit")


# -- liveness ----------------------------------------------------------------------------------


def test_liveness_silence_equal_to_timeout_is_alive():
    c = Cluster(policy="sync", world_size=2)
    c.join_all()
    c.feed(Tick(now=10.0))
    assert c.state.ranks[1].phase is ACTIVE


def test_liveness_silence_strictly_over_timeout_is_dead():
    c = Cluster(policy="sync", world_size=2)
    c.join_all()
    c.feed(HeartbeatSeen(now=10.5, rank=0))
    cmds = c.feed(Tick(now=10.5))
    assert c.state.ranks[1].phase is DEAD
    assert c.state.ranks[0].phase is ACTIVE
    assert ForgetRank(1, "heartbeat stale (>10s)") in cmds


def test_liveness_every_frame_refreshes_last_seen():
    c = Cluster(policy="sync", world_size=1)
    c.join_all()
    c.feed(HeartbeatSeen(now=9.0, rank=0))
    c.feed(HeartbeatSeen(now=3.0, rank=0))  # a late, replayed frame cannot move it back
    assert c.state.ranks[0].last_seen == 9.0
    c.feed(Tick(now=19.0))
    assert c.state.ranks[0].phase is ACTIVE


def test_liveness_no_deaths_while_ranks_speak():
    # Scenario 60 (adapted): ranks that keep talking are never declared dead.
    c = Cluster(policy="sync", world_size=2)
    c.join_all()
    for _ in range(50):
        c.advance(1.0)
    assert [r.phase for r in c.state.ranks] == [ACTIVE, ACTIVE]


def test_liveness_joining_rank_silent_vacates_slot_and_can_rejoin():
    c = Cluster(policy="sync", world_size=2)
    c.hello(0)
    cmds = c.feed(Tick(now=11.0))
    assert c.state.ranks[0].phase is VACANT
    assert ForgetRank(0, "heartbeat stale (>10s)") in cmds
    c.now = 11.0
    assert _ack(c.hello(0, route=(b"again",), incarnation=1)).accepted
    assert c.state.route_of(0) == (b"again",)


def test_exit_report_nonzero_code_is_death_naming_code():
    c = Cluster(policy="sync", world_size=3)
    c.join_all()
    cmds = c.feed(RankExitReported(now=0.0, rank=1, code=3))
    assert ForgetRank(1, "exited with code 3") in cmds
    assert c.state.ranks[1].phase is DEAD


def test_exit_report_signal_is_death_naming_signal():
    c = Cluster(policy="sync", world_size=3)
    c.join_all()
    assert ForgetRank(2, "killed by signal 9") in c.kill(2, code=-9)


def test_exit_report_code_zero_without_exiting_is_death():
    c = Cluster(policy="sync", world_size=2)
    c.join_all()
    cmds = c.feed(RankExitReported(now=0.0, rank=0, code=0))
    assert ForgetRank(0, "exited without Shutdown (code 0)") in cmds
    assert c.state.ranks[0].phase is DEAD


def test_exiting_is_clean_leave_not_death():
    c = Cluster(policy="sync", world_size=2)
    c.join_all()
    cmds = c.feed(RankExiting(now=0.0, rank=1, param_digest="ab", steps=0))
    assert ForgetRank(1, "exited cleanly") in cmds
    assert c.state.ranks[1].phase is LEFT
    assert c.state.ranks[1].param_digest == "ab"


def test_forget_rank_sent_once_and_rank_never_addressed_again():
    c = Cluster(policy="sync", world_size=3)
    c.join_all()
    c.kill(2)
    c.feed(RankExitReported(now=0.0, rank=2, code=-9))
    c.feed(SendFailed(now=0.0, rank=2, what="update"))
    c.advance(20.0)
    assert [f.rank for f in c.of_type(ForgetRank)].count(2) == 1
    # Cluster asserts on every Send that the rank was not forgotten; run to the end.
    assert c.run().ok


def test_clean_exit_then_staleness_declares_nothing():
    # Scenario 69: Exiting{1} -> LEFT; a later stale heartbeat declares nothing.
    c = Cluster(policy="sync", world_size=2)
    c.join_all()
    c.feed(RankExiting(now=0.0, rank=1))
    c.feed(HeartbeatSeen(now=50.0, rank=0))
    cmds = c.feed(Tick(now=50.0))
    assert not [x for x in cmds if isinstance(x, ForgetRank)]
    assert c.state.ranks[1].phase is LEFT
    assert [s.rank for s in cmds if isinstance(s, Send)] == [0]


def test_reported_death_immediate_duplicates_ignored_out_of_range_refused():
    # Scenario 70.
    c = Cluster(policy="sync", world_size=2)
    c.join_all()
    c.feed(RankExitReported(now=0.1, rank=1, code=-9))
    assert c.state.ranks[1].phase is DEAD
    assert c.feed(RankExitReported(now=0.2, rank=1, code=-9)) == []
    assert c.state.ignored["exit report for a rank that is not in the run"] == 1
    with pytest.raises(RankViolation, match=r"rank 5 out of range \[0, 2\)"):
        c.feed(RankExitReported(now=0.3, rank=5, code=1))


def test_exit_report_after_clean_exit_ignored():
    c = Cluster(policy="sync", world_size=2)
    c.join_all()
    c.feed(RankExiting(now=0.0, rank=1))
    c.feed(RankExitReported(now=0.1, rank=1, code=0))
    assert c.state.ranks[1].phase is LEFT


def test_send_failed_declares_rank_unroutable():
    c = Cluster(policy="sync", world_size=2)
    c.join_all()
    cmds = c.feed(SendFailed(now=0.0, rank=0, what="start_epoch"))
    assert ForgetRank(0, "unroutable (send of start_epoch failed)") in cmds


def test_exited_rank_skipped_by_broadcasts():
    # Scenario 86 (adapted): a rank that left is not addressed by later broadcasts.
    c = Cluster(policy="sync", world_size=2, total=16, batch_size=4, epochs=1)
    c.join_all()
    c.feed(RankExiting(now=0.0, rank=1))
    n = len(c.ranks[1].received)
    c.run()
    assert len(c.ranks[1].received) == n
    assert c.out(0)[-1] == "shutdown"


# -- the coordinator's beacon -------------------------------------------------------------


def test_beacon_at_most_once_per_interval_to_addressable_ranks():
    c = Cluster(policy="sync", world_size=3, heartbeat_interval_s=1.0)
    c.hello(0)
    first = c.feed(Tick(now=0.0))
    assert [s.rank for s in first] == [0]  # JOINING ranks hear the beacon too
    assert c.feed(Tick(now=0.5)) == []
    c.hello(1)
    c.hello(2)
    beats = [s for s in c.feed(Tick(now=1.0)) if s.kind == "coord_heartbeat"]
    assert [s.rank for s in beats] == [0, 1, 2]
    assert beats[0].control.coord_heartbeat.beat == 2


def test_beacon_skips_dead_ranks():
    c = Cluster(policy="sync", world_size=3)
    c.join_all()
    c.kill(1)
    beats = [s.rank for s in c.feed(Tick(now=0.0)) if s.kind == "coord_heartbeat"]
    assert beats == [0, 2]


def test_beacon_nothing_without_ranks():
    c = Cluster(policy="sync", world_size=2)
    assert c.feed(Tick(now=0.0)) == []
    assert c.state.last_beacon is None


def test_config_liveness_reason_uses_configured_timeout():
    c = Cluster(config=CoreConfig(policy="sync", world_size=1, liveness_timeout_s=2.5))
    c.join_all()
    assert ForgetRank(0, "heartbeat stale (>2.5s)") in c.feed(Tick(now=3.0))
