"""Formation fails fast (issue 13): a slot whose process ended for good before the world
formed, when the world cannot form without it, ends the run at once (``_formation``)."""

import copy

import pytest

from flodl.core import (
    UNPLACED,
    ForgetRank,
    HeartbeatSeen,
    Notice,
    RankExitReported,
    RankViolation,
    Reply,
    Send,
    Tick,
    VACANT,
    replay,
)

from .cluster import Cluster

TRACEBACK = ("Traceback (most recent call last):", '  File "train.py", line 1', "ModuleNotFoundError: No module named 'x'")


def _exit(c, rank, code=1, **kw):
    return c.feed(RankExitReported(now=c.now, rank=rank, code=code, **kw))


def _forming(**over):
    c = Cluster(policy="sync", **{"world_size": 3, "form_timeout_s": 300.0, **over})
    c.feed(Tick(now=0.0))
    return c


def test_a_fixed_world_fails_at_once_when_a_slot_that_never_said_hello_ends_for_good():
    c = _forming()
    c.hello(0)
    c.hello(2)
    cmds = _exit(c, 1, last_lines=TRACEBACK)
    fin = c.finished
    assert fin is not None and not fin.ok and c.now == 0.0  # not a 300 s wait
    assert fin.reason.startswith("the world can no longer form (every slot is needed): rank 1: exited with code 1")
    assert "its last line: ModuleNotFoundError: No module named 'x'" in fin.reason
    assert "its agent does not start it again" in fin.reason and "(admitted: [0, 2])" in fin.reason
    assert {x.rank for x in cmds if isinstance(x, Send) and x.kind == "shutdown"} == {0, 2}
    (gone,) = [x for x in cmds if isinstance(x, Notice) and x.kind == "slot_gone"]
    assert gone.data["rank"] == 1 and gone.data["last_lines"] == list(TRACEBACK)


def test_an_admitted_rank_lost_for_good_before_forming_fails_the_run_at_once():
    c = _forming(world_size=2, agent_reports_exit=True)
    c.hello(0)
    cmds = _exit(c, 0, code=-9)
    assert ForgetRank(0, "killed by signal 9") in cmds
    assert c.finished is not None and not c.finished.ok
    assert "rank 0: killed by signal 9 before the world formed; its agent does not start it again" in c.finished.reason


def test_a_slot_its_agent_restarts_keeps_the_world_waiting_until_the_last_restart_fails():
    c = _forming()
    c.hello(0)
    _exit(c, 1, restarting=True, last_lines=TRACEBACK)
    assert c.finished is None
    assert c.state.run.not_admitted[1].startswith("exited with code 1 before the world formed; its last line: ")
    assert c.state.run.not_admitted[1].endswith("; its agent starts it again")
    c.feed(Tick(now=5.0))
    assert c.finished is None
    _exit(c, 1, restart_count=1, last_lines=TRACEBACK)  # the restart failed too: no restarts left
    assert c.finished is not None and "rank 1: exited with code 1" in c.finished.reason


def test_a_report_of_an_earlier_process_of_the_slot_is_ignored():
    c = _forming()
    c.hello(1, restart_count=2)
    c.feed(RankExitReported(now=0.0, rank=1, code=1))  # restart 0's exit, after restart 2's hello
    assert c.finished is None and c.state.ignored["exit report of an earlier process of the rank"] == 1


def test_an_elastic_world_fails_only_when_the_possible_slots_drop_below_min_ranks():
    c = _forming(world_size=4, min_ranks=2, join_timeout_s=5.0, form_timeout_s=60.0)
    c.hello(0)
    _exit(c, 1)
    _exit(c, 2)
    assert c.finished is None  # slots 0 and 3 can still make the quorum
    _exit(c, 3, code=0)  # a script that returns early is gone too
    fin = c.finished
    assert fin is not None and not fin.ok
    assert fin.reason.startswith("the world can no longer form (1 of 4 slots can still be filled, below min_ranks 2)")
    assert "rank 3: exited without Shutdown (code 0) before the world formed" in fin.reason


def test_a_gone_slot_taken_by_another_process_counts_again():
    c = _forming(world_size=3, min_ranks=2, join_timeout_s=5.0, form_timeout_s=60.0)
    _exit(c, 1)
    c.hello(1)  # another agent pinned to it (or the report overtook a restart's hello)
    assert 1 not in c.state.run.gone
    _exit(c, 2)
    assert c.finished is None  # slots 0, 1 still possible
    c.hello(0)
    c.feed(Tick(now=6.0))
    assert c.state.run.formed_with == (0, 1)


def test_a_deferred_hello_waiting_for_a_gone_slot_keeps_it_possible():
    c = _forming(world_size=2)
    c.hello(0)
    c.hello(1, model_sig=b"\x01\x02")  # deferred (another model): it waits for the slot
    _exit(c, 1)  # (another process of slot 1 ended)
    assert c.finished is None


def test_a_refusal_is_named_with_the_exit_it_caused():
    c = _forming(world_size=2)
    c.hello(0)
    c.hello(1, world_size=9)  # refused outright: the rank exits 2, its agent does not retry
    _exit(c, 1, code=2)
    assert "rank 1: exited with code 2 (refused: world_size 9 differs from the coordinator's 2)" in c.finished.reason


def test_the_exit_of_an_evicted_holder_costs_its_slot_nothing():
    c = _forming()
    c.hello(0, model_sig=b"evil", route=(b"squatter",), incarnation=99)
    c.hello(0)  # deferred: its slot is taken
    c.hello(1)  # 2 voters > 1 holder: the squatter is evicted, rank 1 admitted
    assert 0 in c.state.run.evicted
    _exit(c, 0, code=0)  # the squatter leaves as told
    assert c.finished is None and c.state.ignored["exit report of an evicted holder"] == 1


def test_an_unpinned_process_that_ends_for_good_before_taking_a_slot_leaves_one_fewer():
    c = _forming(world_size=2)
    c.hello(0)
    _exit(c, UNPLACED, agent="ab" * 32, local_rank=1, restarting=True)
    assert c.finished is None
    _exit(c, UNPLACED, agent="ab" * 32, local_rank=1, last_lines=TRACEBACK)
    fin = c.finished
    assert fin is not None and "an unpinned process (agent abababababababab/1) exited with code 1" in fin.reason


def test_after_forming_an_exit_report_of_a_vacant_slot_changes_nothing():
    c = Cluster(policy="sync", world_size=3, min_ranks=2, join_timeout_s=1.0)
    c.feed(Tick(now=0.0))
    c.hello(0)
    c.hello(1)
    c.feed(HeartbeatSeen(now=2.0, rank=0))
    c.feed(HeartbeatSeen(now=2.0, rank=1))
    c.feed(Tick(now=2.0))
    assert c.state.run.formed_with == (0, 1)
    _exit(c, 2)
    _exit(c, UNPLACED, agent="cd", local_rank=0)
    assert c.state.ranks[2].phase is VACANT and not c.state.run.gone and c.finished is None
    assert c.state.ignored["exit report for a rank that is not in the run"] == 1


def test_the_journal_replays_to_the_same_failure():
    c = _forming()
    c.hello(0)
    _exit(c, 2, restarting=True)
    _exit(c, 2, restart_count=1, last_lines=TRACEBACK)
    record: list = []
    st = replay(c.config, c.journal, record=record)
    assert st == c.state and record == c.commands
    assert not st.run.ok and "rank 2: exited with code 1" in st.run.reason
    assert any(isinstance(x, Reply) for x in record)


def test_an_exit_report_out_of_range_is_refused_and_changes_nothing():
    c = _forming()
    c.hello(0)
    before = copy.deepcopy(c.state)
    with pytest.raises(RankViolation, match=r"rank 7 out of range \[0, 3\)"):
        c.feed(RankExitReported(now=5.0, rank=7, code=1))
    assert c.state == before and c.state.now == before.now


def test_unpinned_processes_gone_never_count_against_the_admitted_ranks():
    c = _forming(world_size=3, min_ranks=2, join_timeout_s=5.0, form_timeout_s=60.0)
    c.hello(0)
    c.hello(1)
    for local in (0, 1):  # more unpinned processes gone than there are vacant slots
        _exit(c, UNPLACED, agent="ef", local_rank=local)
    assert c.finished is None  # the quorum is in: 2 admitted, 0 vacant slots still possible
    c.feed(HeartbeatSeen(now=5.0, rank=0))
    c.feed(HeartbeatSeen(now=5.0, rank=1))
    c.feed(Tick(now=5.0))
    assert c.state.run.formed_with == (0, 1)
