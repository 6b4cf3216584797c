"""Stateful property test of the collective plane's orchestration (flodl.core._collective).

Hypothesis interleaves training, deaths, restarts of dead ranks (they join the running
world: issue 12), group failures (current, stale, and of a seed broadcast), stale store
answers, silent store hosts and time passing. A model built only from the commands the
core emits checks, after every step:

* every ``RequestParams`` reaches a rank whose latest ``Rendezvous`` announced the newest
  generation (the rank binds the request to it: all members agree on the group);
* generations only grow; each announcement gives the members dense ranks 0..n-1, the
  store host first, and goes to exactly the ACTIVE ranks;
* while training, the current generation's members are exactly the ACTIVE ranks and the
  joiners it seeds, and its store host is an ACTIVE member not tried;
* no ``RequestParams`` goes out while the newest generation still seeds a joiner (every
  member's all-reduce would wait for a rank that is not in the round), and a joiner never
  trains before it loaded the seed (the cluster raises).

At teardown the store hosts answer again and the run is driven to its end: it completes
with every epoch committed exactly once (or ended by rendezvous exhaustion, loudly), and
the journal replays to the same state.
"""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from flodl.core import CollectiveFailed, Notice, RankExitReported, Send, StoreReady, replay
from flodl.core import ACTIVE, DEAD, JOINING, TRAINING
from test_core_stateful import Cluster  # the one loader of tests/unit/core/cluster.py




class StoreCluster(Cluster):
    """Store hosts answer an announcement with ``StoreReady`` unless muted; a joiner named
    in ``seed_ranks`` loads the seed broadcast once the address reaches it."""

    def __init__(self, *a, **kw):
        super().__init__(*a, plane="collective", **kw)
        self.mute: set[int] = set()

    def deliver_one(self, rank: int) -> bool:
        r = self.ranks[rank]
        if not r.active or not r.inbox:
            return False
        ctl = r.inbox[0]
        if ctl.WhichOneof("cmd") != "rendezvous":
            return super().deliver_one(rank)
        r.inbox.popleft()
        m = ctl.rendezvous
        if not m.store_addr and m.new_rank == 0 and rank not in self.mute:
            self.feed(StoreReady(now=self.now, rank=rank, generation=m.generation, addr=f"h{rank}:{m.generation}"))
        if m.store_addr and rank in m.seed_ranks and r.m.accepts_seed():
            r.seed_due = True  # ``send_seed`` loads it
        return True


class CollectiveMachine(RuleBasedStateMachine):
    @initialize(
        policy=st.sampled_from(["sync", "cadence"]),
        world=st.integers(2, 4),
        timeout=st.sampled_from([0.5, 2.0]),
    )
    def setup(self, policy, world, timeout):
        self.c = StoreCluster(world_size=world, total=60, batch_size=4, epochs=2, policy=policy, collective_timeout_s=timeout)
        self.c.join_all()
        self.seen = 0  # commands checked so far
        self.newest = 0  # newest generation announced
        self.announced: dict[int, int] = {}  # rank -> generation of its latest Rendezvous
        self.seeding: set[int] = set()  # joiners the newest generation seeds, not joined yet
        self.restarts: dict[int, int] = {}

    # -- rules -----------------------------------------------------------------------

    @rule(n=st.integers(1, 6))
    def pump(self, n):
        for _ in range(n):
            if self.c.finished is None:
                self.c.pump_once()

    @precondition(lambda self: self.c.finished is None and len(self.c.state.alive_ranks()) > 1)
    @rule(i=st.integers(0, 3))
    def kill(self, i):
        alive = self.c.state.alive_ranks()
        rank = alive[i % len(alive)]
        self.c.kill(rank, report=False)  # the agent's report names the process it saw die:
        self.c.feed(RankExitReported(now=self.c.now, rank=rank, code=-9, restart_count=self.restarts.get(rank, 0)))

    @precondition(lambda self: self.c.finished is None and any(r.phase is DEAD for r in self.c.state.ranks))
    @rule(i=st.integers(0, 3))
    def restart(self, i):
        """The agent starts a dead rank again: it joins the running world."""
        dead = [r.rank for r in self.c.state.ranks if r.phase is DEAD]
        rank = dead[i % len(dead)]
        self.restarts[rank] = self.restarts.get(rank, 0) + 1
        self.c.respawn(rank, restart_count=self.restarts[rank])

    @precondition(lambda self: self.c.finished is None and self.c.state.collective.joiners)
    @rule(i=st.integers(0, 3))
    def seed_broadcast_fails(self, i):
        cs, alive = self.c.state.collective, self.c.state.alive_ranks()
        self.c.feed(CollectiveFailed(now=self.c.now, rank=alive[i % len(alive)], generation=cs.generation,
                                     reason="seed", seeding=True))  # fmt: skip

    @precondition(lambda self: self.c.finished is None and self.c.state.collective.generation > 0)
    @rule(i=st.integers(0, 3), stale=st.booleans(), cycle=st.integers(0, 3))
    def group_fails(self, i, stale, cycle):
        cs = self.c.state.collective
        alive = self.c.state.alive_ranks()
        if alive:
            g = cs.generation - 1 if stale else cs.generation
            self.c.feed(CollectiveFailed(now=self.c.now, rank=alive[i % len(alive)], generation=g, cycle=cycle, reason="x"))

    @precondition(lambda self: self.c.finished is None and self.c.state.collective.generation > 1)
    @rule(i=st.integers(0, 3))
    def stale_store_answer(self, i):
        alive = self.c.state.alive_ranks()
        if alive:
            g = self.c.state.collective.generation - 1
            self.c.feed(StoreReady(now=self.c.now, rank=alive[i % len(alive)], generation=g, addr="old:1"))

    @rule(i=st.integers(0, 3), on=st.booleans())
    def mute(self, i, on):
        r = i % self.c.config.world_size
        (self.c.mute.add if on else self.c.mute.discard)(r)

    @precondition(lambda self: self.c.finished is None)
    @rule(dt=st.sampled_from([0.3, 1.0]))
    def time_passes(self, dt):
        self.c.advance(dt)

    # -- the model -------------------------------------------------------------------

    @invariant()
    def commands_respect_generations(self):
        cmds = self.c.commands
        batch: dict[int, object] = {}
        for cmd in cmds[self.seen :]:
            if isinstance(cmd, Notice) and cmd.kind in ("rank_joined", "rank_lost"):
                self.seeding.discard(cmd.data["rank"])
            if not isinstance(cmd, Send):
                continue
            kind = cmd.kind
            if kind == "rendezvous":
                m = cmd.control.rendezvous
                assert m.generation >= self.newest, "generations only grow"
                if m.generation > self.newest:
                    self._check_batch(batch)
                    batch = {}
                    self.newest = m.generation
                    self.seeding = set(m.seed_ranks)
                self.announced[cmd.rank] = m.generation
                if not m.store_addr:
                    batch[cmd.rank] = m
            elif kind == "request_params":
                assert not self.seeding, f"RequestParams while generation {self.newest} seeds {sorted(self.seeding)}"
                assert self.announced.get(cmd.rank) == self.newest, (
                    f"RequestParams to rank {cmd.rank} bound to generation {self.announced.get(cmd.rank)}, "
                    f"newest is {self.newest}"
                )
        self._check_batch(batch)
        self.seen = len(cmds)

    def _check_batch(self, batch):
        if not batch:
            return
        size = {m.new_world_size for m in batch.values()}
        assert len(size) == 1 and size.pop() == len(batch)
        assert sorted(m.new_rank for m in batch.values()) == list(range(len(batch)))

    @invariant()
    def members_are_the_active_ranks(self):
        s = self.c.state
        cs = s.collective
        if s.run.phase is TRAINING and cs.generation > 0:
            assert set(cs.members) == set(s.alive_ranks()) | set(cs.joiners)
            assert cs.store_host == cs.members[0] and cs.store_host not in cs.tried
            assert s.ranks[cs.store_host].phase is ACTIVE  # the seed's source has parameters
            assert all(s.ranks[r].phase is JOINING and s.ranks[r].seeding for r in cs.joiners)
            assert all(s.ranks[r].phase is ACTIVE for r in cs.members if r not in cs.joiners)

    def teardown(self):
        c = getattr(self, "c", None)
        if c is None:
            return
        c.mute.clear()
        fin = c.finished or c.run()
        self.commands_respect_generations()
        if fin.ok:
            for cov in fin.summary["coverage"]:
                assert (cov["trained"], cov["duplicates"], cov["missing"]) == (cov["expected"], 0, 0), cov
        else:
            assert fin.reason.startswith("collective rendezvous exhausted"), fin.reason
        assert replay(c.config, c.journal) == c.state


CollectiveMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestCollective = CollectiveMachine.TestCase
