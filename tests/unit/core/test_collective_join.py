"""Joining a running world on the collective plane (issue 12, shown-by (d)).

A rank admitted while training is seeded by a broadcast in a new generation that
includes it (``flodl.core._collective``): the core's part -- who is in that generation,
that no round opens before the joiner holds the parameters, deaths and failures during
the seeding, a coordinator restart mid re-formation -- on the rank machines of the
cluster (``CollectiveCluster`` simulates the broadcast: a joiner named in
``seed_ranks`` loads it once the group's address reaches it).
"""

from __future__ import annotations

import pytest

from flodl.core import ACTIVE, JOINING, VACANT, CollectiveFailed, LastWord, Reply, replay
from flodl.core._collective import SEED_ATTEMPTS

from .cluster import controls
from .test_collective import CollectiveCluster, exact_coverage, rendezvous
from .test_resync import CrashCluster


def _ack(cmds):
    (reply,) = [c for c in cmds if isinstance(c, Reply)]
    return reply.ack


def _two_of_three(policy="cadence", **kw):
    c = CollectiveCluster(world_size=3, min_ranks=2, join_timeout_s=0.0, policy=policy, total=240, batch_size=8,
                          epochs=3, **kw)  # fmt: skip
    c.hello(0)
    c.hello(1)
    c.advance(0.01)
    assert [r.phase for r in c.state.ranks] == [ACTIVE, ACTIVE, VACANT]
    c.run_until(lambda: c.state.rounds.version >= 2)
    return c


@pytest.mark.parametrize("policy", ["sync", "cadence"])  # async needs the bus plane
def test_a_joiner_is_seeded_by_a_broadcast_in_a_generation_that_includes_it_before_it_trains(policy):
    c = _two_of_three(policy)
    g = c.state.collective.generation
    ack = _ack(c.hello(2))
    assert ack.accepted and ack.run.join_running
    rec = c.state.ranks[2]
    c.run_until(lambda: c.state.collective.generation > g)
    cs = c.state.collective
    assert (cs.members, cs.joiners, cs.store_host) == ((0, 1, 2), (2,), 0)  # the host is a member with parameters
    ann = rendezvous(c.commands, cs.generation)
    assert sorted(ann) == [0, 1, 2] and all(list(m.seed_ranks) == [2] for m in ann.values())
    assert all(m.seed_cycle == c.state.rounds.cycle for m in ann.values())
    start = len(c.commands)
    assert "is seeding joiner(s) [2]" in c.state.rounds.gate_reason
    c.run_until(lambda: rec.phase is ACTIVE)
    joined = next(i for i, x in enumerate(c.commands) if getattr(x, "kind", "") == "rank_joined")
    assert not controls(c.commands[start:joined], "request_params"), "a round opened before the joiner was seeded"
    c.run_until(lambda: bool(controls(c.commands[joined:], "request_params")))
    reqs = [(ctl.request_params.cycle, r) for r, ctl in controls(c.commands[joined:], "request_params")]
    assert sorted(r for cy, r in reqs if cy == reqs[0][0]) == [0, 1, 2]  # the next round counts it
    assert cs.joiners == () and cs.seeds == 1
    assert not [x for x in c.commands if type(x).__name__ == "SeedJoiner"]  # no consensus from the coordinator
    fin = c.run()
    assert fin.ok, fin.reason
    exact_coverage(fin.summary)
    assert c.ranks[2].trained, "the joiner trained"  # (the cluster refuses a batch before the seed)
    (join,) = fin.summary["elastic"]["joins"]
    assert (join["rank"], join["cycle"]) == (2, ann[2].seed_cycle)
    assert fin.summary["collective"]["seeds"] == 1
    assert replay(c.config, c.journal) == c.state


def test_a_killed_rank_restarted_by_its_agent_rejoins_the_next_generation():
    c = CollectiveCluster(world_size=3, policy="cadence", total=300, batch_size=8, epochs=3, max_failure="2",
                          agent_reports_exit=True)  # fmt: skip
    c.join_all()
    c.run_until(lambda: c.state.rounds.version >= 2)
    cmds = c.kill(1)
    assert sorted(rendezvous(cmds, 2)) == [0, 2]  # the survivors re-form at once
    ack = _ack(c.respawn(1, restart_count=1))
    assert ack.accepted and ack.run.join_running
    c.run_until(lambda: c.state.ranks[1].phase is ACTIVE)
    cs = c.state.collective
    assert cs.members == (0, 1, 2) and cs.generation == 3 and cs.seeds == 1
    c.run_until(lambda: bool(c.ranks[1].trained))
    fin = c.run()
    assert fin.ok, fin.reason
    exact_coverage(fin.summary)
    (join,) = fin.summary["elastic"]["joins"]
    assert (join["rank"], join["refill"], join["restart_count"]) == (1, True, 1)
    assert replay(c.config, c.journal) == c.state


def test_a_joiner_lost_while_seeding_reforms_the_group_without_it_and_rounds_resume():
    c = _two_of_three("cadence", mute={2}, agent_reports_exit=True)  # rank 2 never loads the seed
    c.hello(2)
    c.run_until(lambda: c.state.collective.joiners == (2,))
    g = c.state.collective.generation
    for _ in range(5):
        c.pump_once()
    v = c.state.rounds.version
    assert c.state.ranks[2].phase is JOINING and c.state.rounds.version == v
    cmds = c.kill(2)
    cs = c.state.collective
    assert (cs.generation, cs.members, cs.joiners) == (g + 1, (0, 1), ())
    assert all(not m.seed_ranks for m in rendezvous(cmds, g + 1).values())
    assert c.state.ranks[2].phase is VACANT
    fin = c.run()
    assert fin.ok, fin.reason
    exact_coverage(fin.summary)
    assert fin.summary["elastic"]["joins"] == []


def test_a_member_lost_while_seeding_reforms_the_group_with_the_joiner_again():
    c = _two_of_three("sync", mute={2}, agent_reports_exit=True)
    c.hello(2)
    c.run_until(lambda: c.state.collective.joiners == (2,))
    g = c.state.collective.generation
    c.mute.discard(2)
    cmds = c.kill(1)  # the seed source's peer dies mid-broadcast
    cs = c.state.collective
    assert (cs.generation, cs.members, cs.joiners) == (g + 1, (0, 2), (2,))
    assert all(list(m.seed_ranks) == [2] for m in rendezvous(cmds, g + 1).values())
    c.run_until(lambda: c.state.ranks[2].phase is ACTIVE)
    fin = c.run()
    assert fin.ok, fin.reason
    exact_coverage(fin.summary)


def test_failed_seed_broadcasts_reform_without_blame_then_drop_the_joiner_by_name():
    c = _two_of_three("cadence", mute={2})
    c.hello(2)
    c.run_until(lambda: c.state.collective.joiners == (2,))
    cs = c.state.collective
    for _ in range(SEED_ATTEMPTS):
        g = cs.generation
        cmds = c.feed(CollectiveFailed(now=c.now, rank=0, generation=g, cycle=0, reason="Connection closed", seeding=True))
        assert cs.generation == g + 1 and cs.tried == ()  # the store host is not to blame: the group had formed
    assert cs.joiners == () and cs.members == (0, 1)
    rec = c.state.ranks[2]
    assert rec.phase is VACANT and f"seed broadcast of the collective group failed {SEED_ATTEMPTS} times" in rec.reason
    (down,) = [ctl for r, ctl in controls(cmds, "shutdown") if r == 2]
    assert "GLOO_SOCKET_IFNAME" in down.shutdown.reason
    # Sent as a LastWord: the shell resolves routes after the step, when rank 2 has none.
    (last,) = [x for x in cmds if isinstance(x, LastWord)]
    assert last.rank == 2 and last.route == c.ranks[2].route and last.control is down
    fin = c.run()
    assert fin.ok, fin.reason
    exact_coverage(fin.summary)


class CrashingCollective(CollectiveCluster, CrashCluster):
    """A collective cluster whose coordinator can crash and restart on its journal."""


def test_a_coordinator_restart_mid_reformation_reforms_with_the_joiner_and_seeds_it():
    c = CrashingCollective(world_size=3, min_ranks=2, join_timeout_s=0.0, policy="cadence", total=240, batch_size=8,
                           epochs=3, mute={2})  # fmt: skip
    c.hello(0)
    c.hello(1)
    c.advance(0.01)
    c.run_until(lambda: c.state.rounds.version >= 2)
    c.hello(2)
    c.run_until(lambda: c.state.collective.joiners == (2,))
    g = c.state.collective.generation
    journal = c.crash()
    c.mute.discard(2)
    c.restart(journal)
    cs = c.state.collective
    assert cs.generation == g + 1 and cs.joiners == (2,) and cs.reforms >= 1
    c.resync_all()
    c.run_until(lambda: c.state.ranks[2].phase is ACTIVE)
    fin = c.run()
    assert fin.ok, fin.reason
    exact_coverage(fin.summary)
    assert c.trained_once()
    assert replay(c.config, c.journal) == c.state
