"""Coordinator restart (``_resync``): a crash loses frames both ways; the rebuilt core and
the ranks' resync reports still train every epoch exactly once, and a journal holding a
restart replays to the identical state.

The crash model: the dead process's state is the replay of its journal (every event is
journaled before it is stepped). During the outage the ranks keep acting on the commands
they had already received; every frame they send is either lost (it was on its way to
the dead process) or delivered after the restart (queued in their sockets while the
coordinator was down). Every command the dead process had not delivered is lost.
"""

from __future__ import annotations

import random

import pytest

from flodl.core import (
    BatchDone,
    BatchesDone,
    ChunkDone,
    CoordinatorRestarted,
    RankResynced,
    Send,
    SyncAcked,
    Tick,
    from_record,
    replay,
    to_record,
)
from flodl.core._resync import _subtract, lost_positions
from flodl.core import ACTIVE, PENDING, TRAINING

from flodl.rank import Admitted, IncarnationSeen, SendTiming
from flodl.wire import pb
from flodl.core import timing_event

from .cluster import Cluster

_RANK_EVENTS = (BatchDone, BatchesDone, ChunkDone, SyncAcked)  # frames a dead coordinator loses


class CrashCluster(Cluster):
    """A cluster whose coordinator can be killed and restarted on its journal. The ranks
    are the real rank machines: they notice the new incarnation on the first frame they
    handle (or ``resync``: a beacon) and build their resync report themselves."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        ws = self.config.world_size
        self.down = False
        self.consensus_in_outage = False  # a consensus the dead reducer sent before dying
        self.hold_acks = False  # the consensus has not come back yet (snapshots wait)
        self.outage: list = []  # rank frames sent while the coordinator was down
        self.folded = [0] * ws  # the highest step each rank's acks named
        self.unsynced = [False] * ws  # has not heard the new incarnation yet
        self.reports: dict = {}  # rank -> its resync report, built and not sent yet

    def feed(self, ev):
        if isinstance(ev, SyncAcked):
            self.folded[ev.rank] = max(self.folded[ev.rank], ev.step_count)
        if self.down:
            if isinstance(ev, _RANK_EVENTS):
                self.outage.append(ev)
            return []  # nobody is listening (heartbeats and ticks included)
        return super().feed(ev)

    def send_ack(self, rank: int) -> bool:
        if self.hold_acks or (self.down and not self.consensus_in_outage):
            return False  # no reducer: no consensus comes back, the snapshot waits
        return super().send_ack(rank)

    def deliver_one(self, rank: int) -> bool:
        r = self.ranks[rank]
        if r.active and r.inbox and self.unsynced[rank]:  # the first frame of the new incarnation
            self.resync(rank)
        return super().deliver_one(rank)

    @property
    def processed(self) -> list[int]:
        """The highest command_id each rank handled (its machine's)."""
        return [r.m.last_command_id for r in self.ranks]

    def crash(self) -> list:
        """kill -9: the journal so far is all that survives."""
        self.down = True
        return list(self.journal)

    def restart(self, journal: list, *, delivered: int = 0) -> None:
        """Restart on ``journal``; the last ``delivered`` outage frames were still queued in
        the ranks' sockets and arrive after the reconnect, the rest died with the process."""
        self.state = replay(self.config, journal)
        self.journal = list(journal)
        self.down = False
        self.consensus_in_outage = False
        for r in self.ranks:
            r.inbox.clear()  # undelivered commands died with the process
            r.ack_due = None  # so did the reducer's rounds: no consensus comes back
        self.unsynced = [r.active for r in self.ranks]
        self.feed(CoordinatorRestarted(now=self.now, incarnation=7))
        late = self.outage[len(self.outage) - delivered :] if delivered else []
        self.outage = []
        for ev in late:
            if self.ranks[ev.rank].active:
                Cluster.feed(self, ev)

    def resync_event(self, rank: int) -> RankResynced:
        """The rank machine's resync report, decoded as the coordinator would (built once,
        sent by ``resync``). With no restart to hear, the machine reports as after an
        answer to a repeated hello (its first ack may have been lost)."""
        if rank not in self.reports:
            r = self.ranks[rank]
            if r.m.is_restart(self.coordinator_incarnation):
                cmds = r.m.handle(IncarnationSeen(incarnation=self.coordinator_incarnation))
            else:
                cmds = r.m.handle(Admitted(spec=r.m.spec, global_step=r.m.global_step, hello_resent=True))
            (report,) = [x for x in cmds if isinstance(x, SendTiming) and x.kind == "resync"]
            self._do(r, [x for x in cmds if x is not report])
            self.reports[rank] = timing_event(self.now, pb.Timing(rank=rank, resync=report.body))
        return self.reports[rank]

    def resync(self, rank: int) -> list:
        """The rank hears the new incarnation (a beacon, say) and reports, once."""
        ev = self.resync_event(rank)
        del self.reports[rank]
        self.unsynced[rank] = False
        return self.feed(ev)

    def resync_all(self) -> None:
        for r in range(len(self.ranks)):
            if self.unsynced[r]:
                self.resync(r)

    def trained_once(self) -> bool:
        seen: dict = {}
        for r in self.ranks:
            for e, off, n, _ in r.trained:
                for p in range(off, off + n):
                    seen[(e, p)] = seen.get((e, p), 0) + 1
        return all(v == 1 for v in seen.values()) and len(seen) == self.total * self.config.num_epochs


def _exact(summary, total: int, epochs: int) -> None:
    cov = summary["coverage"]
    assert [c["epoch"] for c in cov] == list(range(epochs))
    for c in cov:
        assert (c["expected"], c["trained"], c["duplicates"], c["missing"]) == (total, total, 0, 0), c


def _cluster(policy: str, **kw) -> CrashCluster:
    base = dict(world_size=3, total=120, batch_size=8, epochs=3, speeds=[10.0, 20.0, 30.0])
    base.update(kw)
    c = CrashCluster(policy=policy, **base)
    c.join_all()
    return c


# -- the range arithmetic -------------------------------------------------------------------


def test_subtract_keeps_order_and_cuts_across_ranges():
    assert _subtract([(0, 10), (20, 10)], [(5, 20)]) == [(0, 5), (25, 5)]
    assert _subtract([(0, 10)], []) == [(0, 10)]
    assert _subtract([(0, 10)], [(0, 10)]) == []
    assert _subtract([(10, 10)], [(12, 2), (0, 11), (15, 1)]) == [(11, 1), (14, 1), (16, 4)]


# -- the events -----------------------------------------------------------------------------


def test_events_round_trip_through_the_journal_format():
    import json

    ev = RankResynced(
        now=3.5, rank=1, last_command_id=9, local_step=12, folded_step=4, throttled=True,
        batches=((5, 0, 16, 8, 1.0, 0.5, 0.25, 0.1),), held=((0, 24, 8),),
        chunks=((0, 1, 2, 16, 0.3, 20.0, 21.0, 20.0, 1.0),),
    )  # fmt: skip
    for e in (ev, CoordinatorRestarted(now=1.0, incarnation=99)):
        assert from_record(json.loads(json.dumps(to_record(e)))) == e


def test_restart_abandons_the_open_round_and_refreshes_liveness():
    c = _cluster("sync", defer_acks=True)
    c.run_until(lambda: c.state.rounds.phase is PENDING)
    cycle = c.state.rounds.cycle
    journal = c.crash()
    c.now += 8.0  # most of the liveness timeout passes while it is down
    c.restart(journal)
    st = c.state
    # The dead round is gone; the gate opened a fresh one at once (every rank has an
    # unfolded window): its RequestParams reach the ranks once they reconnect.
    assert st.rounds.phase is PENDING and st.rounds.cycle == cycle + 1
    assert all(rec.last_seen == c.now for rec in st.ranks)
    assert set(st.resync.awaiting) == {0, 1, 2}
    assert st.resync.log[-1]["abandoned_cycle"] == cycle
    c.resync_all()
    c.advance(5.0)  # the grace holds: 8 + 5 s since the last frame, but 5 s since the restart
    assert all(rec.phase is ACTIVE for rec in st.ranks)
    res = c.run()
    assert res.ok
    _exact(res.summary, 120, 3)
    assert res.summary["coordinator_restarts"][0]["abandoned_cycle"] == cycle


@pytest.mark.parametrize("policy", ["sync", "cadence"])
def test_lost_batch_reports_are_recovered_and_committed_once(policy):
    c = _cluster(policy)
    c.run_until(lambda: c.ranks[2].step >= 3)
    journal = c.crash()
    for _ in range(4):  # the ranks train on; every report is lost
        c.pump_once()
    lost = sum(isinstance(ev, (BatchDone, BatchesDone)) for ev in c.outage)
    assert lost > 0
    c.restart(journal)
    c.resync_all()
    assert c.state.resync.log[-1]["recovered_batches"] == lost
    res = c.run()
    assert res.ok
    _exact(res.summary, 120, 3)
    assert c.trained_once()
    assert res.summary["discarded_samples"] == 0


def test_lost_plan_is_resent_to_the_same_rank():
    c = _cluster("cadence")
    # A StartEpoch was just sent to rank 0: find it still undelivered.
    c.run_until(lambda: any(ctl.WhichOneof("cmd") == "start_epoch" for ctl in c.ranks[0].inbox) and c.ranks[0].step > 0)
    plan = next(ctl.start_epoch.plan for ctl in c.ranks[0].inbox if ctl.WhichOneof("cmd") == "start_epoch")
    journal = c.crash()
    c.restart(journal)  # the StartEpoch died in the old process's queue
    others = [r for r in range(3) if r != 0]
    for r in others:
        c.resync(r)
    ev = c.resync_event(0)
    assert (plan.epoch, plan.partition_offset, plan.partition_size) not in ev.held
    lost = lost_positions(c.state, ev)
    assert (plan.epoch, plan.partition_offset, plan.partition_size) in lost
    cmds = c.feed(ev)
    ext = [s.control.extend_partition for s in cmds if isinstance(s, Send) and s.kind == "extend_partition"]
    assert (plan.epoch, plan.partition_offset, plan.partition_size) in [
        (e.epoch, e.partition_offset, e.partition_size) for e in ext
    ]
    assert all(s.rank == 0 for s in cmds if isinstance(s, Send) and s.kind == "extend_partition")
    res = c.run()
    assert res.ok
    _exact(res.summary, 120, 3)
    assert c.trained_once()


def test_plan_sent_after_the_restart_is_not_taken_for_lost():
    c = _cluster("cadence")
    # At an epoch boundary: epoch 1 opened (Cadence streams into it), and a rank's chunk
    # of it was sent and dies undelivered with the coordinator.
    c.run_until(lambda: c.state.dispatch.last_dispatched == 1 and any(
        r.inbox and any(ctl.HasField("start_epoch") for ctl in r.inbox) for r in c.ranks))  # fmt: skip
    assert c.finished is None
    journal = c.crash()
    c.restart(journal)
    # Anything this incarnation sends a rank before its report counts as on its way.
    for r in range(3):
        sent = c.state.resync.sent.get(r, [])
        ev = c.resync_event(r)
        lost = lost_positions(c.state, ev)
        for _cid, kind, e, o, n in sent:
            if kind == "start_epoch":
                assert (e, o, n) not in lost
    c.resync_all()
    res = c.run()
    assert res.ok
    _exact(res.summary, 120, 3)
    assert c.trained_once()


def test_lost_metrics_become_chunk_done():
    c = _cluster("sync", epochs=2, defer_chunks=True)
    # Rank 1 reported its last batch of epoch 0; its ChunkDone is the frame the crash eats.
    c.run_until(lambda: c.ranks[1].chunk_due == 0)
    for r in (0, 2):  # the others' metrics got through: rank 1's is the only one lost
        c.send_chunk(r)
    journal = c.crash()
    c.send_chunk(1)  # lost: it was on its way to the dead process
    assert any(isinstance(ev, ChunkDone) and ev.rank == 1 for ev in c.outage)
    c.restart(journal)
    assert not c.state.metrics.chunks.get(0, {}).get(1)
    c.resync_all()
    assert c.state.resync.log[-1]["recovered_chunks"] == 1
    assert c.state.metrics.chunks.get(0, {}).get(1) or c.state.metrics.last_aggregated == 0
    res = c.run()
    assert res.ok
    _exact(res.summary, 120, 2)


def test_lost_acks_still_commit_what_the_consensus_holds():
    c = _cluster("sync")
    # Every rank snapshotted for the round; the reducer sent the consensus and died
    # before any SyncAck reached it.
    c.run_until(lambda: c.state.rounds.version >= 1 and c.state.rounds.phase is not PENDING)
    c.hold_acks = True
    c.run_until(lambda: c.state.rounds.phase is PENDING and all(r.ack_due is not None for r in c.ranks))
    journal = c.crash()
    c.hold_acks = False
    c.consensus_in_outage = True
    for r in range(3):
        c.send_ack(r)
    assert sum(isinstance(ev, SyncAcked) for ev in c.outage) == 3
    c.restart(journal)
    c.resync_all()
    assert all(c.state.ranks[r].folded_step == c.folded[r] > 0 for r in range(3))
    res = c.run()
    assert res.ok
    _exact(res.summary, 120, 3)
    assert c.trained_once()


def test_lost_update_releases_the_throttled_ranks():
    c = _cluster("sync")
    c.run_until(lambda: c.state.rounds.version >= 1 and c.state.rounds.phase is not PENDING)
    c.hold_acks = True
    c.run_until(lambda: c.state.rounds.phase is PENDING and all(r.ack_due is not None for r in c.ranks))
    c.hold_acks = False
    for r in range(3):
        c.send_ack(r)
    # The round finished: every rank is throttled, its Update still queued.
    assert c.state.rounds.phase is not PENDING
    assert all(r.throttled and r.inbox[0].WhichOneof("cmd") == "update" for r in c.ranks)
    journal = c.crash()
    c.restart(journal)
    cmds = []
    for r in range(3):
        cmds += c.resync(r)
    assert {s.rank for s in cmds if isinstance(s, Send) and s.kind == "update"} == {0, 1, 2}
    res = c.run()
    assert res.ok
    _exact(res.summary, 120, 3)


def test_lost_final_eval_is_sent_again():
    c = _cluster("sync", epochs=1)
    c.run_until(lambda: any(
        ctl.WhichOneof("cmd") == "execute_eval" for r in c.ranks for ctl in r.inbox))  # fmt: skip
    journal = c.crash()
    c.restart(journal)
    cmds = []
    for r in range(3):
        cmds += c.resync(r)
    assert [s.kind for s in cmds if isinstance(s, Send) and s.kind == "execute_eval"] == ["execute_eval"]
    res = c.run()
    assert res.ok and res.summary["accuracy"] == 0.875


def test_resync_not_awaited_is_ignored():
    c = _cluster("sync")
    c.run_until(lambda: c.ranks[0].step >= 1)
    before = c.state.ignored.get("Resync not awaited", 0)
    assert c.resync(0) == [] or True
    assert c.state.ignored.get("Resync not awaited", 0) == before + 1


def test_a_rank_that_never_comes_back_is_lost_by_liveness():
    c = _cluster("cadence")
    c.run_until(lambda: c.ranks[1].step >= 2)
    journal = c.crash()
    c.ranks[2].alive = False  # died during the outage; its agent's report died too
    c.restart(journal)
    c.resync(0)
    c.resync(1)
    assert set(c.state.resync.awaiting) == {2}
    res = c.run()
    assert res.ok
    assert c.state.ranks[2].reason.startswith("heartbeat stale")
    assert not c.state.resync.awaiting
    _exact(res.summary, 120, 3)


# -- random crash points, both policies ------------------------------------------------------


@pytest.mark.parametrize("policy", ["sync", "cadence", "async"])
@pytest.mark.parametrize("seed", range(8))
def test_random_crash_points_keep_exact_coverage_and_replay(policy, seed):
    rng = random.Random(seed * 31 + (policy == "cadence"))
    c = _cluster(policy, total=rng.choice([97, 120, 150]), batch_size=rng.choice([4, 8]))
    total, epochs = c.total, c.config.num_epochs
    crashes = 0
    for _crash in range(rng.choice([1, 2])):
        for _ in range(rng.randrange(5, 60)):
            if c.finished is not None:
                break
            c.pump_once()
        if c.finished is not None:
            break
        journal = c.crash()
        crashes += 1
        for _ in range(rng.randrange(0, 6)):
            c.pump_once()
        c.restart(journal, delivered=rng.randrange(0, len(c.outage) + 1))
        order = list(range(3))
        rng.shuffle(order)
        for r in order:  # a beacon reaches some ranks first; the rest hear a command first
            if rng.random() < 0.5:
                c.pump_once()
            elif c.unsynced[r]:
                c.resync(r)
    res = c.run()
    assert res.ok, res.reason
    _exact(res.summary, total, epochs)
    assert c.trained_once()
    # The journal -- restarts, resyncs and all -- replays to the very same state.
    assert replay(c.config, c.journal) == c.state
    assert len(res.summary.get("coordinator_restarts", [])) == crashes


def test_replay_of_a_journal_with_a_restart_is_identical_and_deterministic():
    c = _cluster("cadence")
    c.run_until(lambda: c.ranks[0].step >= 5)
    journal = c.crash()
    for _ in range(3):
        c.pump_once()
    c.restart(journal, delivered=2)
    c.resync_all()
    c.run()
    a = replay(c.config, c.journal)
    b = replay(c.config, [from_record(to_record(ev)) for ev in c.journal])
    assert a == c.state == b
    assert any(isinstance(ev, CoordinatorRestarted) for ev in c.journal)
    assert not any(isinstance(ev, Tick) and ev.now < 0 for ev in c.journal)


# -- collective plane ----------------------------------------------------------------------


def _collective_crash_cluster(policy: str, **kw):
    from .test_collective import CollectiveCluster

    class CollectiveCrashCluster(CrashCluster, CollectiveCluster):
        """Crash/restart on the collective plane; the store host answers its StoreReady."""

    base = dict(world_size=3, total=120, batch_size=8, epochs=3, speeds=[10.0, 20.0, 30.0])
    base.update(kw)
    c = CollectiveCrashCluster(policy=policy, **base)
    c.join_all()
    return c


@pytest.mark.parametrize("policy", ["sync", "cadence"])
def test_collective_restart_reforms_a_new_generation_before_any_request(policy):
    c = _collective_crash_cluster(policy, defer_acks=True)
    c.run_until(lambda: c.state.rounds.phase is PENDING and c.state.rounds.cycle >= 2)
    cycle, gen = c.state.rounds.cycle, c.state.collective.generation
    assert gen == 1
    journal = c.crash()
    c.now += 1.0
    mark = len(c.commands)
    c.restart(journal)
    cs = c.state.collective
    # The open round is abandoned and the alive ranks re-form as generation 2, announced
    # to every member before the first RequestParams of this incarnation.
    assert c.state.resync.log[-1]["abandoned_cycle"] == cycle
    assert (cs.generation, sorted(cs.members), cs.reforms) == (2, [0, 1, 2], 1)
    after = [x for x in c.commands[mark:] if isinstance(x, Send)]
    for r in range(3):
        kinds = [x.kind for x in after if x.rank == r]
        assert "rendezvous" in kinds
        if "request_params" in kinds:
            assert kinds.index("rendezvous") < kinds.index("request_params")
    assert all(x.control.rendezvous.generation == 2 for x in after if x.kind == "rendezvous")
    c.resync_all()
    res = c.run()
    assert res.ok, res.reason
    _exact(res.summary, 120, 3)
    assert c.trained_once()
    assert res.summary["collective"]["generation"] == 2
    # The journal (the restart and the re-formation in it) replays to the same state.
    assert replay(c.config, c.journal) == c.state
    assert replay(c.config, [from_record(to_record(ev)) for ev in c.journal]) == c.state


def test_collective_restart_before_the_world_formed_or_with_a_reform_due_adds_none():
    from flodl.core import _collective
    from flodl.core._collective import CollectiveState

    c = _collective_crash_cluster("sync")
    st = c.state
    st.collective = CollectiveState()  # no group yet: the world's formation comes first
    _collective.on_restarted(st)
    assert st.collective.reform_reason == ""
    st.collective = CollectiveState(generation=3, reform_reason="rank 1: group failed", host_failed=True)
    _collective.on_restarted(st)  # a re-formation already due keeps its reason and blame
    assert (st.collective.reform_reason, st.collective.host_failed) == ("rank 1: group failed", True)


@pytest.mark.parametrize("policy", ["sync", "cadence"])
def test_a_journal_that_lost_its_tail_fails_the_run_by_name(policy):
    """Issue 9, item 2: a host crash loses the journal's unsynced tail. The restarted core
    rebuilds an older state while the ranks acted on commands it never issued; before,
    it reconciled against that state and trained samples twice while the summary said
    exact. The first report ahead of the journal now fails the run, naming it."""
    c = _cluster(policy)
    c.run_until(lambda: c.state.rounds.version >= 2)
    assert c.state.run.phase is TRAINING  # mid-run (the whole run is a few rounds)
    journal = c.crash()
    tail = len(journal) // 3  # events the host's disk never got (the world had formed before)
    lost_ids = max(x.control.command_id for ev, cmds in c.trace[-tail:] for x in cmds if isinstance(x, Send))
    short = journal[:-tail]
    older = replay(c.config, short)
    assert older.run.phase is TRAINING
    end = older.next_command_id - 1
    assert max(c.processed) > end, "the ranks handled commands the short journal never issued"
    c._last_command_id = end  # the restarted core reuses the lost ids: exactly the hazard
    c.restart(short)
    c.resync_all()
    res = c.finished or c.run()
    assert res is not None and res.ok is False
    behind = [r for r in range(3) if c.processed[r] > end]
    assert res.reason.startswith(f"rank {behind[0]} reports command {c.processed[behind[0]]} ")
    assert f"but the journal ends at command {end}: the journal lost its tail" in res.reason
    assert lost_ids > end


def test_a_journal_that_kept_its_tail_restarts_as_before():
    c = _cluster("cadence")
    c.run_until(lambda: c.state.rounds.version >= 2)
    assert c.state.run.phase is TRAINING  # mid-run (the whole run is a few rounds)
    c.restart(c.crash())
    c.resync_all()
    res = c.run()
    assert res.ok and c.state.resync.journal_end is not None
    _exact(res.summary, 120, 3)
