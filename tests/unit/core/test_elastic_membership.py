"""Elastic membership: a world that forms from a quorum (the join window, reference §1.8)."""

import pytest

from flodl.core import ACTIVE, JOINING, VACANT, CoreConfig, Reply, Tick, replay

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
