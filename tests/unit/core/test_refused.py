"""A refused contribution (issue 9, item 6): the round completes without it, the rank's
window is discarded -- its positions are trained again, exactly once in the end -- and
the rank stays in the run."""

import pytest

from flodl.core import ContributionRefused, Notice, SyncAcked, from_record, replay, to_record
from flodl.core import ACTIVE, IDLE, PENDING
from .cluster import Cluster


class RefusingCluster(Cluster):
    """The reducer (simulated) refuses ``victim``'s contribution to ``cycles``: the shell
    feeds ``ContributionRefused`` before the consensus goes out, the rank resets to it
    and acks its snapshot step, as the real rank does."""

    def __init__(self, *a, victim=1, cycles=(1,), **kw):
        super().__init__(*a, **kw)
        self.victim, self.cycles = victim, set(cycles)
        self.refused_at: dict[int, int] = {}  # cycle -> the victim's snapshot step

    def deliver_one(self, rank):
        r = self.ranks[rank]
        nxt = r.inbox[0] if r.active and r.inbox else None
        if rank == self.victim and nxt is not None and nxt.WhichOneof("cmd") == "request_params":
            cycle = nxt.request_params.cycle
            if cycle in self.cycles:
                self.refused_at[cycle] = r.step
                self.feed(ContributionRefused(now=self.now, rank=rank, cycle=cycle, reason="bad_tensor: NaN"))
        return super().deliver_one(rank)


@pytest.mark.parametrize("policy", ["sync", "cadence", "async"])
def test_a_refused_window_is_retrained_and_the_run_goes_on(policy):
    kw = {} if policy == "sync" else {"anchor": 3, "guard": "none"}
    c = RefusingCluster(world_size=2, total=60, batch_size=4, epochs=2, policy=policy, cycles=(1, 3), **kw)
    c.join_all()
    res = c.run()
    assert res.ok, res.reason
    assert c.refused_at, "the victim never contributed"
    cov = res.summary["coverage"]
    # Every position committed exactly once, although windows of the victim were discarded.
    assert all(e["missing"] == 0 and e["duplicates"] == 0 for e in cov), cov
    assert sum(e["discarded"] for e in cov) > 0
    notes = [x for x in c.commands if isinstance(x, Notice) and x.kind == "window_discarded"]
    assert {n.data["cycle"] for n in notes} == set(c.refused_at)
    assert all(n.data["rank"] == 1 and n.data["reason"] == "bad_tensor: NaN" for n in notes)
    # The victim stayed in: it kept getting work after its first refusal and left cleanly.
    assert c.state.ranks[1].reason == "exited cleanly"
    first = min(c.refused_at)
    later = [t for t in c.ranks[1].trained if t[3] > c.refused_at[first]]
    assert later, "the refused rank got no work after its window was discarded"
    # Replay of the journal (refusals included) reproduces the state.
    assert replay(c.config, [from_record(to_record(e)) for e in c.journal]) == c.state


def test_the_refused_ack_commits_nothing_and_credits_no_steps():
    c = Cluster(world_size=2, total=40, batch_size=4, epochs=1, policy="sync", defer_acks=True)
    c.join_all()
    c.run_until(lambda: c.state.rounds.phase is PENDING)
    for r in (0, 1):
        while c.deliver_one(r):
            pass
    (_, step0), (_, step1) = c.ranks[0].ack_due, c.ranks[1].ack_due
    assert step0 > 0 and step1 > 0
    c.feed(ContributionRefused(now=c.now, rank=1, cycle=1, reason="weight 1e9 outside [1, 1]"))
    pending_before = sum(n for _, _, n, _ in c.state.coverage.pending[1])
    assert pending_before > 0
    c.send_ack(0)
    cmds = c.feed(SyncAcked(now=c.now, rank=1, cycle=1, step_count=step1))
    c.ranks[1].ack_due = None
    st = c.state
    assert st.rounds.phase is IDLE and st.rounds.version == 1
    assert st.rounds.global_step == step0  # the refused window is not in the global step
    assert st.ranks[1].phase is ACTIVE and st.ranks[1].folded_step == step1
    assert st.coverage.pending.get(1) == []
    ec = st.coverage.epochs[0]
    assert ec.discarded == pending_before
    assert ec.unique == sum(n for _, _, n, _ in c.ranks[0].trained)  # only rank 0's work is committed
    # Sync: the discarded positions go out again as ExtendPartitions (rank 1 included).
    ext = [x for x in cmds if getattr(x, "kind", "") == "extend_partition"]
    assert sum(x.control.extend_partition.partition_size for x in ext) == pending_before
    assert any(isinstance(x, Notice) and x.kind == "window_discarded" for x in cmds)


def test_a_refusal_for_another_cycle_is_ignored():
    c = Cluster(world_size=2, total=40, batch_size=4, epochs=1, defer_acks=True)
    c.join_all()
    c.run_until(lambda: c.state.rounds.phase is PENDING)
    c.feed(ContributionRefused(now=c.now, rank=1, cycle=7, reason="late"))
    assert c.state.rounds.refused == {}
    assert c.state.ignored.get("ContributionRefused for a round that is not open") == 1
