"""Membership and liveness: admission, refusals, deaths, clean exits, the beacon."""

import copy

import pytest

from flodl.core import (
    CoreConfig,
    ForgetRank,
    LastWord,
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
from flodl.core import MEMBERSHIP as TRANSITIONS
from flodl.core._membership import transition
from flodl.core import ACTIVE, DEAD, JOINING, LEFT, SHUTTING_DOWN, STOPPING, VACANT, StopRequested
from flodl.core._state import RankRecord
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
    assert _refused(c.hello(-2)) == "rank -2 out of range [0, 2)"  # (-1 is UNPINNED: the core picks)


def test_hello_refused_world_size_differs():
    c = Cluster(policy="sync", world_size=2)
    assert _refused(c.hello(0, world_size=3)) == "world_size 3 differs from the coordinator's 2"


def test_hello_refused_rank_already_admitted_from_another_route():
    c = Cluster(policy="sync", world_size=2)
    c.join_all()
    reason = _refused(c.hello(0, route=(b"elsewhere",)))
    assert reason.startswith("rank 0 already admitted from another route or incarnation")


def test_hello_refused_rank_already_admitted_other_incarnation():
    c = Cluster(policy="sync", world_size=2)
    c.join_all()
    assert "already admitted" in _refused(c.hello(0, incarnation=5))


def test_before_the_world_forms_a_slot_held_by_another_process_defers_the_hello():
    # (a stale or squatting process holds the slot: the real one waits, it is not refused)
    c = Cluster(policy="sync", world_size=2)
    c.hello(0)
    ack = _ack(c.hello(0, route=(b"elsewhere",), incarnation=5))
    assert not ack.accepted and ack.deferred and "already admitted from another route" in ack.reason


def test_hello_with_another_model_is_deferred_not_refused_before_the_world_forms():
    # One early foreign hello must not get every real rank refused for good (squatting):
    # a cohort conflict before formation is answered "deferred" and the rank keeps asking.
    c = Cluster(policy="sync", world_size=2)
    c.hello(0)
    ack = _ack(c.hello(1, model_sig=b"\x01\x02"))
    assert not ack.accepted and ack.deferred
    assert ack.reason.startswith("model signature differs from the cohort's (0102 vs 5a5a")
    assert c.state.ranks[1].phase is VACANT
    assert c.state.run.not_admitted[1].startswith("hello deferred: model signature differs")


def test_hello_with_another_dataset_len_is_deferred_before_the_world_forms():
    c = Cluster(policy="sync", world_size=2, total=100)
    c.hello(0)
    ack = _ack(c.hello(1, dataset_len=99))
    assert ack.deferred and ack.reason.startswith("dataset_len 99 differs from the cohort's 100")


def test_configured_model_signature_refuses_another_model_outright():
    c = Cluster(policy="sync", world_size=2, model_signature=b"\x5a" * 32)
    ack = _ack(c.hello(0))  # the Cluster's ranks present 8 bytes of 0x5a: not the pinned sha256
    assert not ack.accepted and not ack.deferred
    assert "differs from the configured model_signature 5a5a5a5a5a5a" in ack.reason
    ok = _ack(c.hello(1, model_sig=b"\x5a" * 32))
    assert ok.accepted


def test_squatter_that_vanishes_releases_the_cohort():
    # A foreign hello takes slot 0 and fixes the cohort; it never speaks again. When its
    # liveness runs out the slot reopens and the cohort is released: the real ranks form.
    c = Cluster(policy="sync", world_size=2)
    c.hello(0, model_sig=b"evil", route=(b"squatter",), incarnation=99)
    assert _ack(c.hello(1)).deferred
    c.feed(HeartbeatSeen(now=10.5, rank=0))  # (the squatter's slot: silent from now on)
    c.feed(Tick(now=21.0))
    assert c.state.ranks[0].phase is VACANT and c.state.cohort_sig is None
    assert "admitted, then lost before the world formed" in c.state.run.not_admitted[0]
    c.now = 21.0
    c.ranks[0].forgotten = False  # (the cluster's rank 0 is the real one; the squatter was forgotten)
    assert _ack(c.hello(1)).accepted
    assert _ack(c.hello(0)).accepted
    assert all(r.phase is ACTIVE for r in c.state.ranks)


def test_squatter_on_a_real_ranks_slot_is_evicted_by_the_quorum_and_that_rank_admitted():
    c = Cluster(policy="sync", world_size=3)
    c.hello(0, model_sig=b"evil", route=(b"squatter",), incarnation=99)
    assert _ack(c.hello(0)).deferred  # the real rank 0: its slot is taken -- a vote, not a refusal
    cmds = c.hello(1)  # 2 voters (slots 0, 1) > 1 holder: evicted
    assert ForgetRank(0, c.state.ranks[0].reason) in cmds
    assert c.state.ranks[1].phase is JOINING
    c.ranks[0].forgotten = False  # (the cluster's rank 0 is the real one)
    assert _ack(c.hello(0)).accepted and _ack(c.hello(2)).accepted
    assert all(r.phase is ACTIVE for r in c.state.ranks) and c.state.cohort_sig == b"\x5a" * 8


def test_quorum_of_deferred_hellos_evicts_a_squatting_minority():
    c = Cluster(policy="sync", world_size=3)
    c.hello(0, model_sig=b"evil", route=(b"squatter",), incarnation=99)
    assert _ack(c.hello(1)).deferred  # 1 voter vs 1 holder: not yet
    cmds = c.hello(2)  # 2 voters > 1 holder: the squatter is evicted, rank 2 admitted
    assert ForgetRank(0, c.state.ranks[0].reason) in cmds
    assert c.state.ranks[0].phase is VACANT and "evicted before the world formed" in c.state.ranks[0].reason
    assert any(isinstance(x, Send) and x.kind == "shutdown" and x.rank == 0 for x in cmds)
    assert c.state.ranks[2].phase is JOINING and c.state.cohort_sig == b"\x5a" * 8
    c.ranks[0].forgotten = False  # (the cluster's rank 0 is the real one; the squatter was forgotten)
    assert _ack(c.hello(1)).accepted and _ack(c.hello(0)).accepted  # the real ones' resends
    assert all(r.phase is ACTIVE for r in c.state.ranks)


def test_world_that_does_not_form_in_time_fails_naming_who_is_missing_and_why():
    c = Cluster(policy="sync", world_size=4, form_timeout_s=30.0)
    c.feed(Tick(now=0.0))
    c.hello(0)
    c.hello(1, dataset_len=7)  # deferred: another dataset
    c.hello(2, world_size=9)  # refused outright
    c.feed(HeartbeatSeen(now=25.0, rank=0))
    c.feed(Tick(now=30.0))
    assert c.finished is None  # not strictly over the deadline yet
    cmds = c.feed(Tick(now=30.5))  # (any event past the deadline ends it)
    assert c.finished is not None and not c.finished.ok
    r = c.finished.reason
    assert r.startswith("the world did not form within 30s: ")
    assert "rank 1: hello deferred: dataset_len 7 differs from the cohort's 100" in r
    assert "rank 2: refused: world_size 9 differs from the coordinator's 4" in r
    assert "rank 3: never said hello" in r and "(admitted: [0])" in r
    assert any(isinstance(x, Send) and x.kind == "shutdown" and x.rank == 0 for x in cmds)
    deferred_answer = [x for x in cmds if isinstance(x, Reply) and x.route == c.ranks[1].route]
    assert deferred_answer and not deferred_answer[0].ack.accepted and not deferred_answer[0].ack.deferred


def test_rank_lost_before_the_world_forms_is_named_at_the_deadline():
    c = Cluster(policy="sync", world_size=2, form_timeout_s=5.0, agent_reports_exit=True)
    c.feed(Tick(now=0.0))
    c.hello(0)

    c.feed(RankExitReported(now=1.0, rank=0, code=-9, restarting=True))  # (its agent restarts it: wait)
    assert c.finished is None
    c.feed(Tick(now=6.0))
    assert c.finished is not None and not c.finished.ok
    assert "rank 0: killed by signal 9 before the world formed; its agent starts it again" in c.finished.reason
    assert "rank 1: never said hello" in c.finished.reason


def test_form_timeout_zero_waits_forever():
    c = Cluster(policy="sync", world_size=2, form_timeout_s=0.0)
    c.feed(Tick(now=0.0))
    c.hello(0)
    c.feed(HeartbeatSeen(now=1e6, rank=0))
    c.feed(Tick(now=1e6))
    assert c.finished is None


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
    c.join_all()
    before = copy.deepcopy(c.state)
    cmds = c.hello(1, route=(b"other",))
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


def test_hello_for_dead_rank_from_a_new_process_takes_the_slot_again_but_the_dead_one_cannot():
    c = Cluster(policy="sync", world_size=2)
    c.join_all()
    old = c.ranks[1]
    c.kill(1)
    reason = _refused(c.hello(1, route=old.route, incarnation=old.incarnation))  # the dead process's late hello
    assert reason.startswith("rank 1: this process already left the run (DEAD: killed by signal 9)")
    ack = _ack(c.hello(1, route=(b"new",), incarnation=77))  # its restart (elastic membership)
    assert ack.accepted and ack.run.join_running
    assert c.state.ranks[1].phase is JOINING and c.state.ranks[1].refill


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


def test_transition_table_gone_phases_move_only_by_a_new_admission():
    assert {k[1] for k in TRANSITIONS if k[0] in (DEAD, LEFT)} == {"admit"}


def test_transition_missing_entry_names_phase_and_trigger():
    rec = RankRecord(3, phase=DEAD)
    with pytest.raises(LocalViolation, match=r"rank 3: no transition from DEAD on 'form'"):
        transition(rec, "form")


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
    _heard_nothing_since(c)
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


def _heard_nothing_since(c):
    """As if the coordinator sent no rank anything since its last beacon (which skips
    those it did: ``test_beacon_skips_the_ranks_sent_a_command_since_the_last``)."""
    c.state.sent_since_beacon.clear()


def test_beacon_at_most_once_per_interval_to_addressable_ranks():
    c = Cluster(policy="sync", world_size=3, heartbeat_interval_s=1.0)
    c.hello(0)
    _heard_nothing_since(c)
    first = c.feed(Tick(now=0.0))
    assert [s.rank for s in first] == [0]  # JOINING ranks hear the beacon too
    assert c.feed(Tick(now=0.5)) == []
    c.hello(1)
    c.hello(2)
    _heard_nothing_since(c)
    beats = [s for s in c.feed(Tick(now=1.0)) if s.kind == "coord_heartbeat"]
    assert [s.rank for s in beats] == [0, 1, 2]
    assert beats[0].control.coord_heartbeat.beat == 2


def test_beacon_skips_the_ranks_sent_a_command_since_the_last():
    # Every frame is liveness to a rank: one sent a command since the last beacon heard
    # the coordinator in the interval. At 1,024 paced ranks the beacon was a seventh of
    # the frames the coordinator sent, all of a second's in one burst.
    c = Cluster(policy="sync", world_size=3, heartbeat_interval_s=1.0, liveness_timeout_s=10.0)
    c.join_all()
    _heard_nothing_since(c)
    assert [s.rank for s in c.feed(Tick(now=c.now + 1.0)) if s.kind == "coord_heartbeat"] == [0, 1, 2]
    c.state.send(out := [], 1, coord_heartbeat=pb.Control.CoordHeartbeat(beat=0))  # rank 1 hears something
    assert [s.rank for s in c.feed(Tick(now=c.now + 2.0)) if s.kind == "coord_heartbeat"] == [0, 2]
    # The beacon itself is not other traffic: the next one goes to every rank again.
    assert [s.rank for s in c.feed(Tick(now=c.now + 3.0)) if s.kind == "coord_heartbeat"] == [0, 1, 2]
    # A liveness timeout under three intervals: two of silence could trip it, so everyone.
    tight = Cluster(policy="sync", world_size=3, heartbeat_interval_s=1.0, liveness_timeout_s=2.5)
    tight.join_all()
    assert tight.state.sent_since_beacon  # (its dispatch)
    assert [s.rank for s in tight.feed(Tick(now=tight.now + 1.0)) if s.kind == "coord_heartbeat"] == [0, 1, 2]


def test_beacon_skips_dead_ranks():
    c = Cluster(policy="sync", world_size=3)
    c.join_all()
    c.kill(1)
    _heard_nothing_since(c)
    beats = [s.rank for s in c.feed(Tick(now=0.0)) if s.kind == "coord_heartbeat"]
    assert beats == [0, 2]


@pytest.mark.parametrize("end", ["completed", "stopped"])
def test_no_beacon_once_every_rank_was_told_to_shut_down(end):
    # A rank exits on its Shutdown; its process may be gone before its exit is stepped (a
    # busy coordinator at 1,024 ranks), and a beacon to it then failed as host unreachable:
    # a dropped frame and a rank forgotten as lost, in a run that went well.
    c = Cluster(policy="sync", world_size=3, total=48, epochs=1, heartbeat_interval_s=1.0)
    c.join_all()
    for r in c.ranks:
        r.deaf.add("shutdown")  # told, not exited yet: as while their exits wait in the queue
    c.feed(Tick(now=c.now))  # (it skips the ranks just sent their plans; the next one does not)
    beats = [s.rank for s in c.feed(Tick(now=c.now + 1.0)) if s.kind == "coord_heartbeat"]
    assert beats == [0, 1, 2]  # (while they train, the beacon goes out)
    if end == "completed":
        c.run_until(lambda: c.state.run.phase is SHUTTING_DOWN)
    else:
        c.feed(StopRequested(now=c.now, reason="operator"))
        assert c.state.run.phase is STOPPING
    assert c.state.addressable_ranks() == [0, 1, 2]
    assert all("shutdown" in c.out(r) for r in range(3))
    later = c.state.last_beacon + 5.0
    assert [s for s in c.feed(Tick(now=later)) if s.kind == "coord_heartbeat"] == []
    # A restarted coordinator's Shutdowns may have died with the old process: the ranks
    # awaiting resync hear the beacon (the new incarnation), and their report brings the
    # Shutdown again (tests/sim/test_sim_restart.py: a run that never ended without it).
    c.now = later
    c.restart_coordinator(2)
    cmds = c.feed(Tick(now=later + 5.0))
    beats = [s.rank for s in cmds if isinstance(s, Send) and s.kind == "coord_heartbeat"]
    assert beats == [0, 1, 2] and sorted(c.state.resync.awaiting) == [0, 1, 2]


def test_beacon_nothing_without_ranks():
    c = Cluster(policy="sync", world_size=2)
    assert c.feed(Tick(now=0.0)) == []
    assert c.state.last_beacon is None


def test_config_liveness_reason_uses_configured_timeout():
    c = Cluster(config=CoreConfig(policy="sync", world_size=1, liveness_timeout_s=2.5))
    c.join_all()
    assert ForgetRank(0, "heartbeat stale (>2.5s)") in c.feed(Tick(now=3.0))


def test_an_evicted_squatter_is_told_why_on_its_own_route_though_its_slot_is_refilled_in_the_same_step():
    # The real rank 0's hello tips the vote: the squatter is evicted and rank 0 admitted
    # by one step. The shell resolves a Send's route after the step -- rank 0's is the real
    # one's by then -- so the eviction's Shutdown is a LastWord, carrying the squatter's.
    c = Cluster(policy="sync", world_size=3)
    c.hello(0, model_sig=b"evil", route=(b"squatter",), incarnation=99)
    assert _ack(c.hello(1)).deferred
    cmds = c.hello(0)
    (last,) = [x for x in cmds if isinstance(x, LastWord)]
    assert last.rank == 0 and last.route == (b"squatter",)
    assert "evicted before the world formed" in last.control.shutdown.reason
    assert c.state.ranks[0].phase is JOINING and c.state.route_of(0) == c.ranks[0].route != last.route
