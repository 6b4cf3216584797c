"""Stateful property test of elastic membership: hypothesis interleaves training with
ranks joining the running world (a vacant slot, or a dead rank's slot taken by its
restarted process) and ranks dying, over the real core and the real rank machines
(tests/unit/core/cluster.py). After every step: a rank that is joining is in no round and
was sent no work, the core's coverage never counts a sample twice, no position is held
untrained by two live rank machines (Sync re-partitions a live epoch for a joiner: a
member's trimmed tail must leave it before the joiner gets it), and (the cluster
checks it on every batch) no joiner trains before it holds the seed consensus, and the
core's incremental views agree with a recount (``view_drift``). The coordinator may be
killed and restarted on its journal (what it had not delivered is lost). At
teardown the run is driven to its end: every epoch trained exactly once, and replaying
the journal rebuilds the same state."""

from __future__ import annotations

from core_cluster import Cluster
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from flodl.core import ACTIVE, DEAD, JOINING, TRAINING, VACANT, Send, replay, view_drift


WORK = ("start_epoch", "extend_partition", "request_params", "update", "throttle")


class ElasticWorld(RuleBasedStateMachine):
    @initialize(policy=st.sampled_from(["sync", "cadence", "async"]), report_ms=st.sampled_from([0.0, 25.0]))
    def form(self, policy, report_ms):
        self.c = Cluster(policy=policy, world_size=4, min_ranks=2, join_timeout_s=0.0, total=96, batch_size=8,
                         epochs=2, agent_reports_exit=True, anchor=2, batch_report_ms=report_ms)  # fmt: skip
        self.c.hello(0)
        self.c.hello(1)
        self.c.advance(0.01)
        self.seen = 0  # commands already checked
        self.restarts = 0

    def _training(self) -> bool:
        return self.c.finished is None and self.c.state.run.phase is TRAINING

    @rule(n=st.integers(1, 6))
    def pump(self, n):
        for _ in range(n):
            if self.c.finished is not None:
                return
            self.c.pump_once()

    @precondition(lambda self: self._training())
    @rule(slot=st.integers(0, 3))
    def join(self, slot):
        rec = self.c.state.ranks[slot]
        if rec.phase is VACANT and not self.c.ranks[slot].admitted:
            self.c.hello(slot)  # a new host's rank
        elif rec.phase is DEAD:
            self.c.respawn(slot, restart_count=1)  # its agent started it again

    @precondition(lambda self: self._training() and len(self.c.state.alive_ranks()) >= 2)
    @rule(data=st.data())
    def kill(self, data):
        victim = data.draw(st.sampled_from(self.c.state.alive_ranks()))
        self.c.kill(victim)

    @rule()
    def restart_coordinator(self):
        """kill -9 and restart on the journal: undelivered commands and seeds, and the open
        round, die with the process; the rank machines resync on the next frame they hear.
        (Always drawable, a no-op once the run ends or after two restarts: a precondition
        would make hypothesis give up on draws once the run has finished.)"""
        if not self._training() or self.restarts >= 2:
            return
        self.restarts += 1
        self.c.restart_coordinator(incarnation=self.restarts + 1)

    @invariant()
    def no_position_is_held_by_two_live_ranks(self):
        if not hasattr(self, "c"):
            return
        owner: dict = {}
        for r in self.c.ranks:
            if not r.active:
                continue
            for p in r.m.held_positions():
                for pos in range(p.partition_offset, p.partition_offset + p.partition_size):
                    other = owner.setdefault((p.epoch, pos), r.rank)
                    assert other == r.rank, f"position {pos} of epoch {p.epoch} held by ranks {other} and {r.rank}"

    @invariant()
    def joiners_get_no_work_and_no_round(self):
        if not hasattr(self, "c"):
            return
        s = self.c.state
        joining = {r.rank for r in s.ranks if r.phase is JOINING}
        # A joiner whose seed was asked is in no open round (once seeded it is ACTIVE, and a
        # round listing it would wait for a process that never got its RequestParams).
        # (A slot refilled while a round its dead process was in is still open: the round
        # does not wait for it, and its seed is asked only after that round.)
        seeding = {r.rank for r in s.ranks if r.phase is JOINING and r.seeding}
        pending = s.rounds.phase.__name__ == "PENDING"
        assert not (seeding & set(s.rounds.ranks if pending else ())), (seeding, s.rounds.ranks)
        assert not joining & s.index.waiting
        for c in self.c.commands[self.seen:]:
            if isinstance(c, Send) and c.kind in WORK:
                assert s.ranks[c.rank].phase is ACTIVE or c.rank not in joining, (c.rank, c.kind)
        self.seen = len(self.c.commands)
        assert all(ec.duplicates == 0 for ec in s.coverage.epochs.values())
        assert view_drift(s) == []  # the incremental views (rank index, Cadence's) stay exact across joins

    def teardown(self):
        if not hasattr(self, "c"):
            return
        fin = self.c.run()
        assert fin is not None
        trims = self.c.state.dispatch.trim_counts
        if trims:  # --hypothesis-show-statistics: how often Sync shared a live epoch
            event(f"{self.c.config.policy}: joiners got a share of the live epoch")
        if fin.ok:
            for cov in fin.summary["coverage"]:
                assert (cov["trained"], cov["duplicates"], cov["missing"]) == (cov["expected"], 0, 0), cov
        assert replay(self.c.config, self.c.journal) == self.c.state


ElasticWorld.TestCase.settings = settings(
    max_examples=25, stateful_step_count=25, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestElasticWorld = ElasticWorld.TestCase
