"""Stateful property test of flodl.core against an independent ledger of positions.

Hypothesis picks the policy (Sync, or Cadence with a small anchor and maybe a Throttle
spread), and the order in which the ranks -- each the real rank machine (``flodl.rank``,
driven by tests/unit/core/cluster.py) -- join, train, ack, report chunks, die, go
silent, repeat old frames, in which time passes, and when the coordinator is killed and
restarted on its journal (the commands not yet handled and the open round are lost; the
rank machines send their own resync reports). A separate model -- built only
from the events fed and the commands emitted, never from the core's state -- tracks who
owns each position and what was committed. Invariants after every step: a position is
owned by at most one live rank, is never committed twice, the core's counts agree with
the model, the core's incremental views agree with a recount (``view_drift``), the
epoch never goes back, no rank machine drops a control the core sent, and (the Cluster
checks it on every command) no command reaches a rank the core already forgot. At teardown the run is driven to its end: every epoch must have trained every
sample exactly once (unless every rank was lost), and replaying the journal must
rebuild the same state.
"""

from __future__ import annotations

from core_cluster import Cluster
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from flodl.core import (
    BatchDone,
    BatchesDone,
    ChunkDone,
    CoordinatorRestarted,
    ForgetRank,
    HeartbeatSeen,
    OpenRound,
    RankHello,
    RankResynced,
    Send,
    SyncAcked,
    Tick,
    replay,
    view_drift,
)
from flodl.core import FORMING, TRAINING
from flodl.core.cadence import _views
from flodl.core.cadence._views import REFILL




class Ledger:
    """The model: ownership and commits of (epoch, position), from events and commands only."""

    def __init__(self, world_size: int, streams: bool = False) -> None:
        # ``streams``: Cadence and Async stream into epoch e+1 while e is live, and a dead
        # rank's reclaimed hole in e may follow a chunk of e+1; an aggregated epoch is
        # still never handed out again.
        self.streams = streams
        self.aggregated = -1
        self.owner: dict[tuple[int, int], int] = {}
        self.committed: set[tuple[int, int]] = set()
        self.pending: dict[int, list[tuple[int, int, int, int]]] = {r: [] for r in range(world_size)}
        self.last = [0] * world_size
        self.folded = [0] * world_size
        self.gone: set[int] = set()
        self.round: list | None = None  # [cycle, participants, acked]
        self.discarded = 0
        self.max_epoch = -1

    def _commit(self, epoch: int, offset: int, n: int) -> None:
        for p in range(offset, offset + n):
            assert (epoch, p) not in self.committed, f"position {p} of epoch {epoch} committed twice"
            self.committed.add((epoch, p))

    def event(self, ev) -> None:
        if isinstance(ev, BatchesDone):  # one frame of several batches: each as if alone
            for b in ev.batches:
                self.event(b)
        elif isinstance(ev, BatchDone) and ev.rank not in self.gone and ev.step_count > self.last[ev.rank]:
            self.last[ev.rank] = ev.step_count
            for p in range(ev.offset, ev.offset + ev.samples):
                assert self.owner.get((ev.epoch, p)) == ev.rank, "a rank trained a position it does not own"
            if ev.step_count <= self.folded[ev.rank]:
                self._commit(ev.epoch, ev.offset, ev.samples)
            else:
                self.pending[ev.rank].append((ev.epoch, ev.offset, ev.samples, ev.step_count))
        elif isinstance(ev, SyncAcked):
            rd = self.round
            if ev.rank in self.gone or rd is None or ev.cycle != rd[0] or ev.rank not in rd[1] or ev.rank in rd[2]:
                return
            rd[2].add(ev.rank)
            self._fold(ev.rank, ev.step_count)
        elif isinstance(ev, CoordinatorRestarted):
            self.round = None  # the open round died with the old process
        elif isinstance(ev, RankResynced) and ev.rank not in self.gone:
            self._fold(ev.rank, ev.folded_step)  # a consensus the rank applied holds its steps up to it
            # Batches it had not reported yet (coalesced reports) or whose frames died with the
            # old process, as the core ingests them: in step order, each as a BatchDone.
            for step_count, epoch, offset, samples, *_ in sorted(ev.batches):
                if step_count > ev.folded_step:
                    self.event(BatchDone(now=ev.now, rank=ev.rank, batch_ms=0.0, data_ms=0.0, step_count=step_count,
                                         loss=0.0, samples=samples, epoch=epoch, offset=offset))  # fmt: skip

    def _fold(self, rank: int, step: int) -> None:
        self.folded[rank] = max(self.folded[rank], step)
        keep = []
        for item in self.pending[rank]:
            if item[3] <= step:
                self._commit(*item[:3])
            else:
                keep.append(item)
        self.pending[rank] = keep

    def _assign(self, rank: int, epoch: int, offset: int, size: int) -> None:
        assert rank not in self.gone
        for p in range(offset, offset + size):
            # Again to the same rank only: a plan the coordinator's restart lost is resent.
            assert self.owner.get((epoch, p), rank) == rank, f"position {p} of epoch {epoch} assigned twice"
            assert (epoch, p) not in self.committed, "a committed position was handed out again"
            self.owner[(epoch, p)] = rank

    def command(self, c) -> None:
        if isinstance(c, OpenRound):
            self.round = [c.cycle, set(c.ranks), set()]
        elif isinstance(c, ForgetRank):
            self.gone.add(c.rank)
            self.discarded += sum(item[2] for item in self.pending[c.rank])
            self.pending[c.rank] = []
            for key in [k for k, r in self.owner.items() if r == c.rank and k not in self.committed]:
                del self.owner[key]
        elif isinstance(c, Send) and c.kind == "epoch_aggregated":
            self.aggregated = max(self.aggregated, c.control.epoch_aggregated.metrics.epoch)
        elif isinstance(c, Send) and (c.kind == "start_epoch" or (
                c.kind == "request_params" and c.control.request_params.HasField("next_plan"))):
            # (a round's trigger carries a rank's lone plan: protocol 1.2)
            ctl = c.control
            p = ctl.start_epoch.plan if c.kind == "start_epoch" else ctl.request_params.next_plan
            if self.streams:
                assert p.epoch > self.aggregated, "a plan of an aggregated epoch"
            else:
                assert p.epoch >= self.max_epoch, "the epoch went back"
            self.max_epoch = max(self.max_epoch, p.epoch)
            self._assign(c.rank, p.epoch, p.partition_offset, p.partition_size)
        elif isinstance(c, Send) and (c.kind == "extend_partition" or (
                c.kind == "request_params" and c.control.request_params.HasField("extend"))):
            ctl = c.control
            x = ctl.extend_partition if c.kind == "extend_partition" else ctl.request_params.extend
            self._assign(c.rank, x.epoch, x.partition_offset, x.partition_size)
        elif isinstance(c, Send) and c.kind == "update":
            u = c.control.update
            if u.HasField("next_plan"):  # Cadence: the next window rides in the Update
                assert u.next_plan.epoch > self.aggregated, "a plan of an aggregated epoch"
                self._assign(c.rank, u.next_plan.epoch, u.next_plan.partition_offset, u.next_plan.partition_size)
            if self.round and u.cycle == self.round[0]:
                self.round = None


class CoreMachine(RuleBasedStateMachine):
    @initialize(
        ws=st.integers(1, 4),
        total=st.integers(1, 40),
        bs=st.integers(1, 8),
        epochs=st.integers(1, 3),
        prejoin=st.booleans(),
        race=st.booleans(),
        policy=st.sampled_from(["sync", "cadence"]),
        anchor=st.integers(1, 4),
        max_batch_diff=st.sampled_from([None, 1, 3]),
        report_ms=st.sampled_from([0.0, 25.0]),  # a frame per batch, or ~3 batches a frame (11 ms each)
        sweep=st.booleans(),
        carry=st.booleans(),  # a chunk's last batches ride in its Metrics (protocol 1.3), or go before it (1.2)
    )
    def setup(self, ws, total, bs, epochs, prejoin, race, policy, anchor, max_batch_diff, report_ms=0.0,
              sweep=False, carry=False):  # fmt: skip
        # sweep: every rearm refills the gate's heap in bulk and the gate sifts it in one
        # sweep, as at thousands of ranks (``_views.REFILL``); these worlds have 1-4.
        _views.REFILL = 0 if sweep else REFILL
        self.c = Cluster(
            world_size=ws, total=total, batch_size=bs, epochs=epochs,
            liveness_timeout_s=5.0, reduce_stall_s=1e9, defer_chunks=True, defer_acks=True,
            race_throttle=race, policy=policy, anchor=anchor, max_batch_diff=max_batch_diff,
            batch_report_ms=report_ms, carry_batches=carry,
        )
        self.model = Ledger(ws, streams=policy != "sync")
        self.seen = 0
        self.restarts = 0
        self.last_aggregated = -1
        if prejoin:
            self.c.join_all()

    # -- helpers ----------------------------------------------------------------------------

    def _sync_model(self) -> None:
        for ev, cmds in self.c.trace[self.seen :]:
            self.model.event(ev)
            for cmd in cmds:
                self.model.command(cmd)
        self.seen = len(self.c.trace)

    def _running(self) -> bool:
        return self.c.finished is None

    def _formed(self) -> bool:
        return self._running() and self.c.state.run.phase is not FORMING

    def _ranks(self, pred) -> list[int]:
        return [r.rank for r in self.c.ranks if pred(r)]

    # -- rules ------------------------------------------------------------------------------

    def _alive_count(self) -> int:
        return len(self._ranks(lambda r: r.active))

    @precondition(lambda self: self._running() and self.c.state.run.phase is FORMING)
    @rule()
    def join(self):
        r = next(r for r in self.c.ranks if not r.admitted)
        self.c.hello(r.rank)

    @precondition(lambda self: self._formed())
    @rule(data=st.data(), n=st.integers(1, 4))
    def deliver(self, data, n):
        ranks = self._ranks(lambda r: r.active and r.inbox)
        if ranks:
            r = data.draw(st.sampled_from(ranks))
            for _ in range(n):
                self.c.deliver_one(r)

    @precondition(lambda self: self._formed())
    @rule(data=st.data(), n=st.integers(1, 3), drain=st.booleans())
    def batch(self, data, n, drain):
        ranks = [r for r in range(len(self.c.ranks)) if self.c.can_train(r)]
        if ranks:
            r = data.draw(st.sampled_from(ranks))
            for _ in range(n):
                self.c.train_one(r, drain=drain)  # drain: control read before a chunk's Metrics

    @precondition(lambda self: self._formed())
    @rule(data=st.data())
    def sync_ack(self, data):
        ranks = self._ranks(lambda r: r.active and r.ack_due is not None)
        if ranks:
            self.c.send_ack(data.draw(st.sampled_from(ranks)))

    @precondition(lambda self: self._formed())
    @rule(data=st.data())
    def chunk_done(self, data):
        ranks = self._ranks(lambda r: r.active and r.chunk_due is not None)
        if ranks:
            self.c.send_chunk(data.draw(st.sampled_from(ranks)))

    @precondition(lambda self: self._formed())
    @rule()
    def everyone_moves(self):
        """One round-robin pass: every rank drains its inbox, reports, trains a batch."""
        self.c.pump_once()

    @precondition(lambda self: self._formed() and self.c.state.run.phase is TRAINING and self._alive_count() >= 2)
    @rule(data=st.data(), code=st.sampled_from([-9, 1, 0]))
    def kill(self, data, code):
        ranks = self._ranks(lambda r: r.active)
        self.c.kill(data.draw(st.sampled_from(ranks)), code=code)

    @precondition(lambda self: self._formed() and self.c.state.run.phase is TRAINING and self._alive_count() == 1)
    @rule(really=st.integers(0, 3))
    def kill_the_last(self, really):
        if really == 0:  # rarely: most runs should reach their end, some lose everyone
            self.c.kill(self._ranks(lambda r: r.active)[0])

    @precondition(lambda self: self._formed() and self.c.state.run.phase is TRAINING and self._alive_count() >= 2)
    @rule(data=st.data(), dt=st.floats(0.5, 6.0))
    def silence_and_advance(self, data, dt):
        self.c.silence(data.draw(st.sampled_from(self._ranks(lambda r: r.active))))
        self.c.advance(dt)

    @rule(dt=st.floats(0.01, 3.0))
    def advance_time(self, dt):  # always possible: after the end it is a no-op
        self.c.advance(dt)

    @precondition(lambda self: self._running() and self.c.journal)
    @rule(data=st.data())
    def duplicate_frame(self, data):
        frames = [e for e in self.c.journal if isinstance(e, (BatchDone, SyncAcked, ChunkDone, HeartbeatSeen, RankHello))]
        if frames:
            self.c.feed(data.draw(st.sampled_from(frames[-12:])))

    @precondition(lambda self: self._formed() and self.c.state.run.phase is TRAINING and self.restarts < 2)
    @rule()
    def restart_coordinator(self):
        """kill -9 and restart on the journal: every command not yet handled dies with the
        process, so does the reducer's open round; the rank machines hear the new
        incarnation on their next frame and send their resync report."""
        self.restarts += 1
        self.c.restart_coordinator(incarnation=self.restarts + 1)

    @precondition(lambda self: self._running())
    @rule()
    def tick(self):
        self.c.feed(Tick(now=self.c.now))

    # -- invariants ---------------------------------------------------------------------------

    @invariant()
    def ledger_agrees_with_core(self):
        if not hasattr(self, "c"):
            return
        self._sync_model()
        for epoch, ec in self.c.state.coverage.epochs.items():
            assert ec.duplicates == 0
            mine = sum(1 for (e, _p) in self.model.committed if e == epoch)
            assert ec.unique == mine
            if not ec.frozen:
                assert {p for (e, p) in self.model.committed if e == epoch} == {
                    p for p in range(ec.expected) if ec.committed[p]
                }

    @invariant()
    def ranks_refuse_nothing_the_core_sends(self):
        """The rank machines drop no control: no plan beyond the epoch, nothing unsupported."""
        if not hasattr(self, "c"):
            return
        assert not any(r.drops for r in self.c.ranks), [r.drops for r in self.c.ranks]

    @invariant()
    def incremental_views_match_a_recount(self):
        """The rank index, Cadence's wake/gate views, the pools' sums and each epoch's count
        of pending batches (``view_drift``)."""
        if not hasattr(self, "c"):
            return
        assert view_drift(self.c.state) == []

    @invariant()
    def epoch_never_goes_back(self):
        if not hasattr(self, "c"):
            return
        last = self.c.state.metrics.last_aggregated
        last = -1 if last is None else last
        assert last >= self.last_aggregated
        self.last_aggregated = last

    def teardown(self):
        try:
            self._finish()
        finally:
            _views.REFILL = REFILL

    def _finish(self):
        if not hasattr(self, "c"):
            return
        c = self.c
        if c.finished is None:
            if c.state.run.phase is FORMING:
                for r in c.ranks:
                    if not r.admitted:
                        c.hello(r.rank)
            c.run()
        self._sync_model()
        res = c.finished
        assert res is not None
        if res.ok:
            assert res.summary["epochs_completed"] == c.config.num_epochs
            for e, cov in enumerate(res.summary["coverage"]):
                assert (cov["expected"], cov["trained"], cov["duplicates"], cov["missing"]) == (
                    c.total, c.total, 0, 0,
                ), cov
                assert {p for (ep, p) in self.model.committed if ep == e} == set(range(c.total))
            assert res.summary["discarded_samples"] == self.model.discarded
        else:
            assert res.reason == "all ranks lost", res.reason
        assert replay(c.config, c.journal) == c.state
        # Two plans queued at a rank would mean a coordinator bug (reference hazard 11):
        # whatever happened, the core never sends one while another waits.
        assert not [w for r in c.ranks for w in r.warnings if "still queued" in w], [r.warnings for r in c.ranks]


CoreMachine.TestCase.settings = settings(
    max_examples=50,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestCoreStateful = CoreMachine.TestCase
