"""Elastic membership: a world that forms from a quorum (the join window, reference §1.8)."""

import pytest

from flodl.core import ACTIVE, JOINING, VACANT, CoreConfig, RankExitReported, Reply, Tick, replay

from .cluster import Cluster


def _ack(cmds):
    (reply,) = [c for c in cmds if isinstance(c, Reply)]
    return reply.ack


def _elastic(**cfg):
    base = dict(policy="sync", world_size=3, min_ranks=2, join_timeout_s=5.0, form_timeout_s=20.0)
    base.update(cfg)
    return Cluster(**base)


def test_quorum_in_waits_for_the_join_window_then_forms_without_the_missing_slot():
    c = _elastic()
    c.feed(Tick(now=0.0))
    c.hello(0)
    c.hello(1)
    c.feed(Tick(now=4.9))
    assert c.state.run.phase.__name__ == "FORMING"  # quorum met, window still open
    assert "join window is open" in c.state.reasons["advance"]
    c.feed(Tick(now=5.0))
    assert [r.phase for r in c.state.ranks] == [ACTIVE, ACTIVE, VACANT]
    (formed,) = [n for n in c.commands if getattr(n, "kind", "") == "world_formed"]
    assert formed.data["world_size"] == 2 and formed.data["ranks"] == [0, 1] and formed.data["capacity"] == 3


def test_a_full_world_forms_at_once_without_waiting_for_the_window():
    c = _elastic()
    c.feed(Tick(now=0.0))
    for r in range(3):
        c.hello(r)
    assert all(r.phase is ACTIVE for r in c.state.ranks)


def test_a_quorum_world_trains_every_sample_exactly_once_and_says_who_never_came():
    for policy in ("sync", "cadence", "async"):
        c = _elastic(policy=policy)
        c.feed(Tick(now=0.0))
        c.hello(0)
        c.hello(2)  # admission is by slot; rank 1 never comes
        c.advance(5.0)
        fin = c.run()
        assert fin.ok, (policy, fin.reason)
        for cov in fin.summary["coverage"]:
            assert cov["trained"] == cov["expected"] and cov["duplicates"] == 0 and cov["missing"] == 0, policy
        assert fin.summary["elastic"] == {"min_ranks": 2, "max_ranks": 3, "formed_with": [0, 2], "vacant": [1], "joins": []}
        assert replay(c.config, c.journal) == c.state  # the journal reproduces the quorum formation


def test_quorum_unmet_at_the_hard_cap_fails_naming_the_reason():
    c = _elastic()
    c.feed(Tick(now=0.0))
    c.hello(0)
    while c.now < 20.0:
        c.advance(1.0)  # rank 0 keeps beating: only the quorum is missing
    assert c.finished is None
    c.advance(0.5)
    assert c.finished is not None and not c.finished.ok
    r = c.finished.reason
    assert r.startswith("the world did not form within 20s (max_join_timeout_s): quorum unmet, 1 of min_ranks 2")
    assert "rank 1: never said hello" in r and "rank 2: never said hello" in r and "(admitted: [0])" in r


def test_an_elastic_world_admits_ranks_whose_world_size_is_in_its_range():
    c = _elastic(world_size=4)
    assert _ack(c.hello(0, world_size=2)).accepted
    assert _ack(c.hello(1, world_size=4)).accepted
    ack = _ack(c.hello(2, world_size=5))
    assert not ack.accepted
    assert ack.reason == "world_size 5 is outside the coordinator's elastic range [2, 4] (min_ranks, world_size)"
    assert c.state.ranks[2].phase is VACANT and c.state.ranks[1].phase is JOINING


@pytest.mark.parametrize(
    "cfg, msg",
    [
        (dict(world_size=3, min_ranks=4), "min_ranks must be in [1, world_size=3], got 4"),
        (dict(world_size=3, min_ranks=2, join_timeout_s=60.0, form_timeout_s=30.0), "must not exceed the hard cap"),
        (dict(world_size=3, min_ranks=2, join_timeout_s=-1.0), "join_timeout_s must be >= 0"),
    ],
)
def test_bad_elastic_settings_are_refused_by_name(cfg, msg):
    with pytest.raises(ValueError, match=msg.replace("[", r"\[").replace("]", r"\]")):
        CoreConfig(**cfg)


def test_a_fixed_world_ignores_the_join_window():
    cfg = CoreConfig(world_size=3, join_timeout_s=60.0, form_timeout_s=10.0)  # a window longer than the cap is fine
    assert (cfg.quorum, cfg.elastic) == (3, False)


# -- joining a running world -----------------------------------------------------------------


def _formed_with_two(policy="cadence", **cfg):
    c = _elastic(policy=policy, total=200, batch_size=8, epochs=3, join_timeout_s=0.0, **cfg)
    c.hello(0)
    c.hello(1)
    c.advance(0.01)
    assert [r.phase for r in c.state.ranks] == [ACTIVE, ACTIVE, VACANT]
    return c


def _exact(fin):
    for cov in fin.summary["coverage"]:
        assert (cov["trained"], cov["duplicates"], cov["missing"]) == (cov["expected"], 0, 0), cov


@pytest.mark.parametrize("policy", ["sync", "cadence", "async"])
def test_a_rank_joins_a_running_world_once_seeded_and_every_sample_stays_exactly_once(policy):
    c = _formed_with_two(policy)
    c.run_until(lambda: c.state.rounds.version >= 2)
    ack = _ack(c.hello(2))
    assert ack.accepted and ack.run.join_running  # told to wait for the seed
    rec = c.state.ranks[2]
    assert rec.phase is JOINING and 2 not in c.state.alive_ranks()  # no work, no round before the seed
    c.run_until(lambda: rec.phase is ACTIVE)
    seeds = [x for x in c.commands if type(x).__name__ == "SeedJoiner"]
    assert [s.rank for s in seeds] == [2]
    joined = [n for n in c.commands if getattr(n, "kind", "") == "rank_joined"]
    assert joined and joined[0].data["members"] == [0, 1, 2]
    fin = c.run()
    assert fin.ok, fin.reason
    _exact(fin)
    assert c.ranks[2].trained, "the joiner trained"  # (the cluster refuses a batch before the seed)
    (join,) = fin.summary["elastic"]["joins"]
    assert (join["rank"], join["refill"]) == (2, False)
    assert replay(c.config, c.journal) == c.state  # the journal records the join; replay reproduces it


def test_the_seed_waits_for_an_open_round_to_finish():
    c = _formed_with_two("sync", defer_acks=True)
    c.run_until(lambda: c.state.rounds.version >= 1 and c.state.rounds.phase.__name__ == "PENDING")
    c.hello(2)
    assert not c.ranks[2].seed_due and "seeded at the next averaging boundary" in c.state.reasons["seed_joiners"]
    for r in (0, 1):
        while c.deliver_one(r):  # their RequestParams: snapshots taken, acks held
            pass
    c.send_ack(0)
    assert not c.ranks[2].seed_due  # still one ack owed
    c.send_ack(1)
    assert c.ranks[2].seed_due  # the round finished: the boundary
    c.pump_once()
    assert c.state.ranks[2].phase is ACTIVE


def _ends_exact_with_one_refill(c, rank: int, restart_count: int) -> None:
    """The run ends ok, every sample once, one join: ``rank``'s restart into its own slot."""
    fin = c.run()
    assert fin.ok, fin.reason
    _exact(fin)
    (join,) = fin.summary["elastic"]["joins"]
    assert (join["rank"], join["refill"], join["restart_count"]) == (rank, True, restart_count)
    assert replay(c.config, c.journal) == c.state


def test_a_dead_ranks_slot_is_refilled_by_its_restart_and_max_failure_counts_ranks_down_now():
    c = Cluster(policy="cadence", world_size=3, total=300, batch_size=8, epochs=3, max_failure="2",
                agent_reports_exit=True)  # fmt: skip
    c.join_all()
    c.run_until(lambda: c.state.rounds.version >= 2)
    c.kill(1)
    assert c.state.ranks[1].phase.__name__ == "DEAD"
    ack = _ack(c.respawn(1, restart_count=1))
    assert ack.accepted and ack.run.join_running
    c.run_until(lambda: c.state.ranks[1].phase is ACTIVE)
    c.run_until(lambda: bool(c.ranks[1].trained))
    c.kill(2)  # one rank down now: under max_failure 2 (it would be 2 deaths ever)
    _ends_exact_with_one_refill(c, rank=1, restart_count=1)


def test_a_restart_lost_before_its_seed_leaves_the_slot_a_refill_for_the_next_one():
    """Seen in a netns partition run: the first restarted process was lost while joining
    (its seed broadcast failed), the second joined -- and was reported as a new rank."""
    c = Cluster(policy="cadence", world_size=3, total=300, batch_size=8, epochs=3, agent_reports_exit=True)
    c.join_all()
    c.run_until(lambda: c.state.rounds.version >= 2)
    c.kill(1)
    assert _ack(c.respawn(1, restart_count=1)).accepted
    c.silence(1)  # blocked before its seed reached it: its heartbeat goes stale
    for _ in range(120):
        if c.state.ranks[1].phase is VACANT:
            break
        c.advance(0.5)
    assert c.state.ranks[1].phase is VACANT  # the slot reopens
    ack = _ack(c.respawn(1, restart_count=2))
    assert ack.accepted and ack.run.join_running
    c.run_until(lambda: c.state.ranks[1].phase is ACTIVE)
    _ends_exact_with_one_refill(c, rank=1, restart_count=2)


def test_a_live_rank_id_is_still_refused_while_training():
    c = _formed_with_two()
    ack = _ack(c.hello(1, route=(b"impostor",), incarnation=99))
    assert not ack.accepted and ack.reason.startswith("rank 1 already admitted from another route or incarnation")


def test_the_collective_plane_admits_a_join_mid_run_and_seeds_it_by_broadcast_not_by_the_shell():
    c = _elastic(policy="sync", plane="collective", join_timeout_s=0.0)
    c.hello(0)
    c.hello(1)
    c.advance(0.01)
    ack = _ack(c.hello(2))
    assert ack.accepted and ack.run.join_running
    assert not [x for x in c.commands if type(x).__name__ == "SeedJoiner"]  # tests/unit/core/test_collective_join.py


def test_a_joiner_lost_before_its_seed_reopens_the_slot_and_the_run_goes_on():
    c = _formed_with_two("cadence", agent_reports_exit=True)
    c.run_until(lambda: c.state.rounds.version >= 1)
    c.hello(2)
    c.kill(2)  # before the seed reached it
    assert c.state.ranks[2].phase is VACANT and c.state.ranks[2].joined_at is None
    fin = c.run()
    assert fin.ok, fin.reason
    _exact(fin)
    assert fin.summary["elastic"]["joins"] == []


def test_an_exit_report_of_the_earlier_process_does_not_kill_its_restart():
    c = Cluster(policy="cadence", world_size=3, total=300, batch_size=8, epochs=2, agent_reports_exit=True)
    c.join_all()
    c.run_until(lambda: c.state.rounds.version >= 1)
    c.silence(1)  # died; silence declares it dead before its agent's report arrives
    while c.state.ranks[1].phase is ACTIVE:
        c.advance(1.0)  # the others keep beating
    assert c.state.ranks[1].phase.__name__ == "DEAD"
    c.respawn(1, restart_count=1)  # the restart's hello overtakes the old process's exit report
    c.feed(RankExitReported(now=c.now, rank=1, code=1, restart_count=0))
    assert c.state.ranks[1].phase is JOINING and c.state.ignored["exit report of an earlier process of the rank"] == 1
    fin = c.run()
    assert fin.ok, fin.reason
    _exact(fin)
