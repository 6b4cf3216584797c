"""flodl.core._collective: process-group generations on the collective plane.

Reference §12 G scenarios 63-67 (NCCL re-rendezvous), in our terms: the UID generator is
the TCPStore host, ``RequestNewNcclId`` is the announcing ``Rendezvous{store_addr=""}``,
``NewNcclIdGenerated`` is ``StoreReady`` and ``NewNcclSession`` the ``Rendezvous`` with
the address. Difference (ARCHITECTURE.md wins): a lone survivor trains on in a group of
one instead of ``ShutdownWithSave(SingleSurvivor)``.
"""

from __future__ import annotations

import pytest

from flodl.core import (
    CollectiveFailed,
    CoreConfig,
    RunFinished,
    StoreReady,
    from_record,
    initial_state,
    replay,
    to_record,
)
from flodl.core import ACTIVE

from .cluster import Cluster, controls


class CollectiveCluster(Cluster):
    """The cluster, plus the store host's answer: a ``Rendezvous`` announcing a
    generation to ``new_rank`` 0 is answered ``StoreReady`` (unless the rank is ``mute``).
    The all-reduce itself is simulated by the base cluster (the ack comes straight back),
    and so is a generation's seed broadcast: a joiner named in ``seed_ranks`` loads it
    once the address reaches it (``send_seed``)."""

    def __init__(self, *a, mute=(), **kw):
        kw.setdefault("plane", "collective")
        super().__init__(*a, **kw)
        self.mute = set(mute)

    def deliver_one(self, rank: int) -> bool:
        r = self.ranks[rank]
        if not r.active or not r.inbox:
            return False
        ctl = r.inbox[0]
        if ctl.WhichOneof("cmd") == "rendezvous":
            r.inbox.popleft()
            m = ctl.rendezvous
            if not m.store_addr and m.new_rank == 0 and rank not in self.mute:
                self.feed(StoreReady(now=self.now, rank=rank, generation=m.generation, addr=f"10.0.0.{rank}:{29500 + m.generation}"))
            if m.store_addr and rank in m.seed_ranks and rank not in self.mute and r.m.accepts_seed():
                r.seed_due = True  # the group formed and broadcast the seed: ``send_seed`` loads it
            return True
        return super().deliver_one(rank)


def rendezvous(cmds, generation=None):
    """{rank: Rendezvous} of the ``Send``s in ``cmds`` (of one generation, if given)."""
    out = {}
    for r, c in controls(cmds, "rendezvous"):
        if generation is None or c.rendezvous.generation == generation:
            out[r] = c.rendezvous
    return out


def exact_coverage(summary):
    for c in summary["coverage"]:
        assert (c["trained"], c["duplicates"], c["missing"]) == (c["expected"], 0, 0), c


def test_world_formation_announces_generation_1_to_every_member_then_sends_the_address():
    c = CollectiveCluster(world_size=3, policy="sync", mute={0})
    c.join_all()
    cs = c.state.collective
    assert (cs.generation, cs.members, cs.store_host, cs.store_addr) == (1, (0, 1, 2), 0, "")
    ann = rendezvous(c.commands, 1)
    assert sorted(ann) == [0, 1, 2]
    for r, m in ann.items():
        assert (m.store_addr, m.new_rank, m.new_world_size, m.backend, m.timeout_s) == ("", r, 3, "gloo", 60.0)
    cmds = c.feed(StoreReady(now=c.now, rank=0, generation=1, addr="h0:1234"))
    full = rendezvous(cmds, 1)
    assert {r: (m.store_addr, m.new_rank, m.new_world_size) for r, m in full.items()} == {
        0: ("h0:1234", 0, 3), 1: ("h0:1234", 1, 3), 2: ("h0:1234", 2, 3),
    }  # fmt: skip
    # A second answer changes nothing.
    assert rendezvous(c.feed(StoreReady(now=c.now, rank=0, generation=1, addr="h0:9")), 1) == {}
    assert c.state.ignored["duplicate StoreReady"] == 1


def test_every_member_hears_the_generation_before_any_request_of_it():
    c = CollectiveCluster(world_size=3, policy="sync")
    c.join_all()
    fin = c.run()
    assert fin.ok, fin.reason
    for r in range(3):
        kinds = c.out(r)
        assert kinds.index("rendezvous") < kinds.index("request_params")
    exact_coverage(fin.summary)
    col = fin.summary["collective"]
    assert (col["backend"], col["generation"], col["reforms"], col["failures"]) == ("gloo", 1, 0, 0)


def test_63_death_reforms_the_survivors_with_dense_ranks_and_only_the_host_answers():
    c = CollectiveCluster(world_size=4, policy="sync", mute={0})
    c.join_all()
    c.feed(StoreReady(now=c.now, rank=0, generation=1, addr="h0:1"))
    c.run_until(lambda: c.state.rounds.version >= 1)
    cmds = c.kill(1)
    cs = c.state.collective
    assert (cs.generation, cs.members, cs.store_host, cs.reforms) == (2, (0, 2, 3), 0, 1)
    ann = rendezvous(cmds, 2)
    assert {r: (m.store_addr, m.new_rank, m.new_world_size) for r, m in ann.items()} == {
        0: ("", 0, 3), 2: ("", 1, 3), 3: ("", 2, 3),
    }  # fmt: skip
    assert rendezvous(c.feed(StoreReady(now=c.now, rank=2, generation=2, addr="h2:1"))) == {}
    assert c.state.ignored["stale StoreReady"] == 1
    full = rendezvous(c.feed(StoreReady(now=c.now, rank=0, generation=2, addr="h0:2")), 2)
    assert {r: (m.store_addr, m.new_rank) for r, m in full.items()} == {0: ("h0:2", 0), 2: ("h0:2", 1), 3: ("h0:2", 2)}


def test_65_store_host_death_fails_over_to_the_next_lowest_and_old_answers_are_stale():
    c = CollectiveCluster(world_size=3, policy="sync", mute={0, 1, 2})
    c.join_all()
    cmds = c.kill(0)  # the host dies before answering
    cs = c.state.collective
    assert (cs.generation, cs.members, cs.store_host) == (2, (1, 2), 1)
    assert {r: m.new_rank for r, m in rendezvous(cmds, 2).items()} == {1: 0, 2: 1}
    c.feed(StoreReady(now=c.now, rank=1, generation=1, addr="h1:old"))  # generation 1 is gone
    assert c.state.ignored["stale StoreReady"] == 1 and cs.store_addr == ""
    c.feed(StoreReady(now=c.now, rank=1, generation=2, addr="h1:2"))
    assert cs.store_addr == "h1:2"
    c.mute.clear()
    fin = c.run()
    assert fin.ok and fin.summary["collective"]["generation"] == 2
    exact_coverage(fin.summary)


def test_66_a_silent_store_host_is_tried_and_the_next_member_hosts():
    c = CollectiveCluster(world_size=3, policy="sync", mute={0}, collective_timeout_s=1.0)
    c.join_all()
    cs = c.state.collective
    c.advance(0.9)
    assert cs.generation == 1
    mark = len(c.commands)
    c.advance(0.2)  # 1.1 s > 1 s without the store address
    cmds = c.commands[mark:]
    assert (cs.generation, cs.members, cs.store_host, cs.tried) == (2, (1, 0, 2), 1, (0,))
    assert {r: m.new_rank for r, m in rendezvous(cmds, 2).items()} == {1: 0, 0: 1, 2: 2}
    while c.deliver_one(1):
        pass
    assert cs.store_addr == "10.0.0.1:29502"
    fin = c.run()
    assert fin.ok, fin.reason
    exact_coverage(fin.summary)


def test_67_every_host_tried_is_exhaustion_and_ends_the_run():
    c = CollectiveCluster(world_size=3, policy="sync", mute={0, 1, 2}, collective_timeout_s=1.0)
    c.join_all()
    for _ in range(8):
        c.advance(0.6)
        if c.finished is not None:
            break
    fin = c.finished
    assert isinstance(fin, RunFinished) and not fin.ok
    assert fin.reason.startswith("collective rendezvous exhausted"), fin.reason
    assert c.state.collective.tried == (0, 1, 2)
    assert [r for r, _ in controls(c.commands, "shutdown_with_save")] == [0, 1, 2]


def test_64_a_lone_survivor_trains_on_in_a_group_of_one():
    c = CollectiveCluster(world_size=2, policy="sync")
    c.join_all()
    c.run_until(lambda: c.state.rounds.version >= 1 and c.state.unfolded(1) > 0)
    cmds = c.kill(1)
    assert {r: (m.new_rank, m.new_world_size) for r, m in rendezvous(cmds, 2).items()} == {0: (0, 1)}
    fin = c.run()
    assert fin.ok, fin.reason
    exact_coverage(fin.summary)
    assert fin.summary["collective"]["members"] == [0]


def test_a_failed_group_reforms_the_same_members_and_stale_failures_are_ignored():
    c = CollectiveCluster(world_size=3, policy="cadence")
    c.join_all()
    c.run_until(lambda: c.state.rounds.version >= 2)
    cs = c.state.collective
    g = cs.generation
    cmds = c.feed(CollectiveFailed(now=c.now, rank=2, generation=g, cycle=c.state.rounds.cycle, reason="peer closed"))
    assert (cs.generation, cs.members, cs.store_host, cs.failures, cs.tried) == (g + 1, (0, 1, 2), 0, 1, ())
    assert sorted(rendezvous(cmds, g + 1)) == [0, 1, 2]
    assert rendezvous(c.feed(CollectiveFailed(now=c.now, rank=1, generation=g, cycle=1, reason="x"))) == {}
    assert c.state.ignored["stale CollectiveFailed"] == 1
    # A generation that fails to *form* blames its store host: the next one tries rank 1.
    c.feed(CollectiveFailed(now=c.now, rank=2, generation=g + 1, cycle=0, reason="store unreachable"))
    assert (cs.generation, cs.store_host, cs.members, cs.tried) == (g + 2, 1, (1, 0, 2), (0,))
    fin = c.run()
    assert fin.ok, fin.reason
    exact_coverage(fin.summary)
    assert fin.summary["collective"]["failures"] == 2


def test_a_death_mid_round_excuses_the_dead_and_the_run_replays_bit_for_bit():
    c = CollectiveCluster(world_size=3, policy="cadence")
    c.join_all()
    c.run_until(lambda: c.state.rounds.version >= 1)
    c.ranks[1].deaf.add("request_params")  # rank 1 never answers the next round (a hung reduce)
    rs = c.state.rounds
    c.run_until(lambda: rs.phase.__name__ == "PENDING" and set(rs.acked) == {0, 2})
    assert c.state.collective.generation == 1
    cmds = c.kill(1)  # the round was waiting for rank 1 only: it finishes, the group re-forms
    assert rs.phase.__name__ == "IDLE" or rs.cycle > 2
    assert sorted(rendezvous(cmds, 2)) == [0, 2]
    fin = c.run()
    assert fin.ok, fin.reason
    exact_coverage(fin.summary)
    assert [r["phase"] for r in fin.summary["ranks"]] == ["LEFT", "DEAD", "LEFT"]
    again = replay(c.config, [from_record(to_record(e)) for e in c.journal])
    assert again == c.state


def test_the_bus_plane_never_rendezvous():
    c = Cluster(world_size=3, policy="sync")
    c.join_all()
    fin = c.run()
    assert fin.ok and not c.sends("rendezvous") and "collective" not in fin.summary
    assert c.state.collective is None


def test_store_ready_and_failures_from_outside_the_generation_change_nothing():
    c = CollectiveCluster(world_size=3, policy="sync", mute={0, 1, 2})
    c.join_all()
    cs = c.state.collective
    c.feed(StoreReady(now=c.now, rank=0, generation=1, addr=""))
    assert c.state.ignored["StoreReady without an address"] == 1 and cs.store_addr == ""
    c.feed(CollectiveFailed(now=c.now, rank=0, generation=7, cycle=0))
    assert c.state.ignored["stale CollectiveFailed"] == 1 and cs.generation == 1
    assert all(c.state.ranks[r].phase is ACTIVE for r in range(3))


@pytest.mark.parametrize(
    "over, match",
    [
        (dict(collective_backend="mpi"), "collective_backend must be one of"),
        (dict(collective_timeout_s=0.0), "collective_timeout_s must be > 0"),
        (dict(collective_timeout_s=float("nan")), "collective_timeout_s must be > 0"),
    ],
)
def test_config_validation(over, match):
    with pytest.raises(ValueError, match=match):
        CoreConfig(world_size=2, plane="collective", **over)


def test_events_journal_round_trip():
    for ev in (
        StoreReady(now=1.5, rank=0, generation=3, addr="10.0.0.1:29500"),
        CollectiveFailed(now=2.0, rank=2, generation=3, cycle=9, reason="Connection closed by peer"),
    ):
        assert from_record(to_record(ev)) == ev


def test_nccl_backend_reaches_the_rendezvous():
    st = initial_state(CoreConfig(world_size=1, plane="collective", collective_backend="nccl", collective_timeout_s=5))
    assert st.collective.generation == 0
    c = CollectiveCluster(world_size=1, policy="sync", collective_backend="nccl", collective_timeout_s=5.0)
    c.join_all()
    (m,) = rendezvous(c.commands, 1).values()
    assert (m.backend, m.timeout_s, m.new_world_size) == ("nccl", 5.0, 1)
