"""The step: validation before mutation, determinism, replay, command numbering."""

import copy
import json

import pytest

from flodl.core import (
    BatchDone,
    CheckpointDone,
    CoreConfig,
    ForgetRank,
    HeartbeatSeen,
    IntentRaised,
    LocalViolation,
    ProtocolViolation,
    RankViolation,
    Send,
    SyncAcked,
    Tick,
    from_record,
    initial_state,
    replay,
    step,
    to_record,
)

from .cluster import Cluster


def _run_with_death():
    c = Cluster(policy="sync", world_size=3, total=100, batch_size=8, epochs=2)
    c.join_all()
    c.run_until(lambda: c.ranks[2].step >= 2 and c.state.unfolded(2) > 0)
    c.kill(2)
    c.run()
    return c


def test_every_policy_has_an_engine():
    # sync, cadence and async (flodl.core.cadence._async) all register a dispatcher and a gate.
    from flodl.core._config import POLICIES
    from flodl.core._policy import GATES
    from flodl.core._policy import DISPATCHERS

    assert set(POLICIES) <= set(DISPATCHERS) and set(POLICIES) <= set(GATES)
    for policy in POLICIES:
        initial_state(CoreConfig(world_size=2, policy=policy))


def test_initial_state_accepts_the_collective_plane():
    st = initial_state(CoreConfig(policy="sync", world_size=2, plane="collective"))
    assert st.collective is not None  # flodl.core._collective (tests: test_collective.py)
    assert initial_state(CoreConfig(policy="sync", world_size=2)).collective is None


def test_protocol_violation_is_abstract():
    with pytest.raises(TypeError):
        ProtocolViolation("x")
    err = RankViolation("bad frame")
    assert (err.reason, err.hint) == ("bad frame", "drop")
    assert LocalViolation("bug").hint == "crash"


def test_step_refuses_a_non_event():
    st = initial_state(CoreConfig(policy="sync", world_size=1))
    with pytest.raises(LocalViolation, match="not an event: str"):
        step(st, "tick")


def test_violation_changes_nothing():
    c = Cluster(policy="sync", world_size=2, total=10, batch_size=2)
    c.join_all()
    before = copy.deepcopy(c.state)
    with pytest.raises(RankViolation, match=r"rank 9 out of range \[0, 2\)"):
        c.feed(HeartbeatSeen(now=5.0, rank=9))
    with pytest.raises(RankViolation):
        c.feed(BatchDone(now=5.0, rank=0, batch_ms=1, data_ms=0, step_count=1, loss=1, samples=2, epoch=0, offset=9))
    assert c.state == before


def test_late_frames_from_a_dead_rank_are_ignored_and_counted():
    c = Cluster(policy="sync", world_size=2, total=10, batch_size=2)
    c.join_all()
    c.kill(1)
    before = copy.deepcopy(c.state)
    assert c.feed(SyncAcked(now=0.0, rank=1, cycle=1, step_count=3)) == []
    assert c.feed(BatchDone(now=0.0, rank=1, batch_ms=1, data_ms=0, step_count=1, loss=1, samples=2,
                            epoch=7, offset=99)) == []
    assert c.state.ignored["SyncAcked from a rank that is not in the run"] == 1
    assert c.state.ignored["BatchDone from a rank that is not in the run"] == 1
    before.ignored = c.state.ignored
    assert c.state == before


def test_unsupported_events_refresh_liveness_only():
    c = Cluster(policy="sync", world_size=1, total=4, batch_size=4)
    c.join_all()
    c.feed(CheckpointDone(now=3.0, rank=0, version=1))
    c.feed(IntentRaised(now=4.0, rank=0, kind="bogus"))
    assert c.state.ranks[0].last_seen == 4.0
    assert c.state.ignored["IntentRaised of unknown kind 'bogus'"] == 1


def test_send_refuses_a_rank_that_is_gone():
    c = Cluster(policy="sync", world_size=2)
    c.join_all()
    c.kill(1)
    with pytest.raises(LocalViolation, match=r"refusing to address rank 1 \(DEAD\)"):
        c.state.send([], 1, throttle={})


def test_command_ids_strictly_increase_from_one():
    c = Cluster(policy="sync", world_size=3, total=30, batch_size=4, epochs=1)
    c.join_all()
    c.run()
    ids = [s.control.command_id for s in c.commands if isinstance(s, Send)]
    assert ids == list(range(1, len(ids) + 1))


def test_same_events_same_commands_twice():
    a, b = _run_with_death(), _run_with_death()
    assert a.journal == b.journal
    assert a.commands == b.commands
    assert a.state == b.state


def test_replay_rebuilds_identical_state_and_commands():
    c = _run_with_death()
    record = []
    st = replay(c.config, c.journal, record=record)
    assert st == c.state
    assert record == c.commands


def test_replay_through_json_records():
    c = _run_with_death()
    text = json.dumps([to_record(e) for e in c.journal])
    events = [from_record(r) for r in json.loads(text)]
    assert events == c.journal
    record = []
    st = replay(c.config, events, record=record)
    assert st == c.state and record == c.commands
    assert c.finished.summary == record[-1].summary


def test_replay_skips_refused_frames():
    c = Cluster(policy="sync", world_size=2, total=10, batch_size=2)
    c.join_all()
    bad = BatchDone(now=0.0, rank=0, batch_ms=1, data_ms=0, step_count=1, loss=1, samples=2, epoch=0, offset=9)
    with pytest.raises(RankViolation):
        c.feed(bad)
    c.run()
    assert replay(c.config, c.journal) == c.state


def test_fixed_point_one_event_can_cascade_to_the_end():
    # The last ack folds the tail, completes coverage, aggregates the last epoch and
    # sends the final eval: all in one step, in the documented priority order.
    c = Cluster(policy="sync", world_size=1, total=4, batch_size=4, epochs=1)
    c.join_all()
    while c.deliver_one(0):
        pass
    c.train_one(0)
    cmds = c.feed(SyncAcked(now=0.0, rank=0, cycle=1, step_count=1))
    kinds = [getattr(x, "kind", type(x).__name__) for x in cmds]
    assert kinds == ["update", "epoch_aggregated", "epoch", "execute_eval"]


def test_tick_deaths_then_beacon_to_survivors():
    c = Cluster(policy="sync", world_size=3)
    c.join_all()
    c.feed(HeartbeatSeen(now=11.0, rank=0))
    cmds = c.feed(Tick(now=11.0))
    forgets = [x.rank for x in cmds if isinstance(x, ForgetRank)]
    beats = [x.rank for x in cmds if isinstance(x, Send) and x.kind == "coord_heartbeat"]
    heard = {x.rank for x in cmds if isinstance(x, Send)}
    # The survivor hears the coordinator: the beacon, or (here) the dead ranks' work,
    # which makes the beacon skip it (_membership.beacon); no dead rank is beaconed.
    assert forgets == [1, 2] and 0 in heard and beats in ([], [0])


def test_rules_run_in_priority_order_and_keep_their_last_reason():
    from flodl.core._events import EVENT_TYPES
    from flodl.core._step import HANDLERS, RULES

    names = [r.name for r in RULES]
    assert names == ["fail", "reform_group", "finish_round", "stall", "seed_joiners", "open_round", "aggregate",
                     "advance"]  # fmt: skip
    assert set(HANDLERS) == set(EVENT_TYPES.values())
    c = Cluster(world_size=2, total=32, epochs=1)
    c.join_all()
    # the last pass of a step asks every row, and none fired: each says why
    assert set(names) <= set(c.state.reasons)
    assert c.state.reasons["open_round"] == c.state.rounds.gate_reason
