"""Sync, a rank joined mid-epoch (``_repartition``): at the next finished round the members
above the level are trimmed, what they give back goes to the joiner, and every epoch is
still trained exactly once through deaths and coordinator restarts around the trim."""

from __future__ import annotations

import json

import pytest

from flodl.core import ACTIVE, PartitionTrimmed, RankViolation, Send, from_record, replay, to_record
from flodl.core._repartition import shares

from .cluster import Cluster
from .test_resync import CrashCluster

TOTAL = 200


def _exact(fin) -> None:
    assert fin.ok, fin.reason
    for cov in fin.summary["coverage"]:
        assert (cov["trained"], cov["duplicates"], cov["missing"]) == (cov["expected"], 0, 0), cov


def _world(cls=Cluster, **kw):
    """Ranks 0 and 1 form the world; rank 2 joins once two rounds finished (epoch 0 live)."""
    c = cls(policy="sync", world_size=3, min_ranks=2, join_timeout_s=0.0, total=TOTAL, batch_size=8, epochs=2,
            speeds=[10.0, 10.0, 10.0], **kw)  # fmt: skip
    c.hello(0)
    c.hello(1)
    c.advance(0.01)
    c.run_until(lambda: c.state.rounds.version >= 2)
    c.hello(2)
    return c


def _trim_queued(c, rank: int) -> bool:
    return any(ctl.WhichOneof("cmd") == "trim_partition" for ctl in c.ranks[rank].inbox)


def _until_trim_queued(c, rank: int) -> None:
    """Pump as ``pump_once`` does, but stop the moment a trim waits in ``rank``'s inbox."""
    for _ in range(5000):
        for r in range(len(c.ranks)):
            for act in (c.deliver_one, c.send_ack, c.send_seed, c.send_chunk, c.train_one):
                while not _trim_queued(c, rank) and act(r) and act is c.deliver_one:
                    pass
                if _trim_queued(c, rank):
                    return
        c.advance(c.dt)
    raise AssertionError("no trim was sent")


def _trims(c) -> dict:
    return c.state.dispatch.trim_counts


def test_shares_split_the_rest_equally_joiners_first_and_leave_sub_batch_surpluses():
    # Two members holding 68 each, a joiner with nothing: 46 / 45 / 45 (equal_sizes in rank order).
    assert shares({0: 68, 1: 68, 2: 0}, [2], batch=8) == {0: (46, ((2, 22),)), 1: (45, ((2, 23),))}
    # A fast member that holds less gets some of the slow one's tail too (joiner first).
    assert shares({0: 10, 1: 80, 2: 0}, [2], batch=8) == {1: (30, ((2, 30), (0, 20)))}
    # Surpluses under one batch stay put; the joiner then gets less than an equal share.
    assert shares({0: 4, 1: 4, 2: 0}, [2], batch=8) == {}
    # A joiner holding more than its share already (a death's split): nothing moves.
    assert shares({0: 10, 1: 10, 2: 30}, [2], batch=8) == {}


def test_a_sync_joiner_trains_its_share_of_the_live_epoch():
    c = _world()
    c.run_until(lambda: c.state.ranks[2].phase is ACTIVE)
    assert c.state.dispatch.share_owed == [2]
    c.run_until(lambda: bool(_trims(c).get("answered", 0) == 2))
    # The trims went out with the round that lifted the barrier, each before its Update:
    # the members handled them throttled, exactly where the coordinator knew them to be.
    for r in (0, 1):
        kinds = [k for k in c.out(r) if k in ("trim_partition", "update")]
        i = kinds.index("trim_partition")
        assert kinds[i + 1] == "update"
    answers = [e for e in c.journal if isinstance(e, PartitionTrimmed)]
    given = sum(n for e in answers for _o, n in e.released)
    assert given > 0 and _trims(c)["samples"] == given
    fin = c.run()
    _exact(fin)
    in_epoch0 = sum(n for e, _o, n, _s in c.ranks[2].trained if e == 0)
    assert in_epoch0 == given  # the joiner trained exactly what the members gave back
    # Equal shares of the rest: the members kept what the joiner got, give or take one sample.
    assert all(abs(e.kept - given) <= 1 for e in answers), ([e.kept for e in answers], given)
    assert fin.summary["elastic"]["repartition"]["sent"] == 2
    assert replay(c.config, c.journal) == c.state  # the journal records the trims; replay reproduces them


def test_an_answer_naming_positions_the_rank_does_not_hold_is_refused_and_changes_nothing():
    c = _world()
    _until_trim_queued(c, 0)
    cid = next(ctl.command_id for ctl in c.ranks[0].inbox if ctl.WhichOneof("cmd") == "trim_partition")
    theirs = c.state.dispatch.assigned[0][1][-1]  # rank 1's last range
    before = {r: list(v) for r, v in c.state.dispatch.assigned[0].items()}
    with pytest.raises(RankViolation, match="does not hold untrained"):
        c.feed(PartitionTrimmed(now=c.now, rank=0, command_id=cid, epoch=0, kept=0, released=(theirs,)))
    assert c.state.dispatch.assigned[0] == before and 0 in c.state.dispatch.trims
    _exact(c.run())


def test_a_member_that_dies_before_answering_leaves_its_whole_rest_to_the_survivors():
    c = _world(agent_reports_exit=True)
    _until_trim_queued(c, 0)
    c.kill(0)  # the trim dies in its inbox
    assert 0 not in c.state.dispatch.trims and _trims(c)["dropped"] == 1
    fin = c.run()
    _exact(fin)
    assert any(e == 0 for e, *_ in c.ranks[2].trained)  # the joiner got part of epoch 0 (the death's split)


def test_a_joiner_that_dies_before_the_answers_leaves_them_to_the_members():
    c = _world(agent_reports_exit=True)
    _until_trim_queued(c, 0)
    assert _trim_queued(c, 1)
    c.kill(2)
    for r in (0, 1):
        while c.deliver_one(r):
            pass
    cmds = [s for s in c.sends("extend_partition") if s.rank != 2]
    assert cmds, "what the members gave back went to the alive ranks"
    assert _trims(c)["answered"] == 2
    _exact(c.run())


def test_a_restart_that_lost_the_answer_settles_the_trim_from_the_resync_report():
    c = _world(CrashCluster)
    _until_trim_queued(c, 0)
    journal = c.crash()
    while c.deliver_one(0):  # the member trims; its answer dies with the process
        pass
    assert c.ranks[0].m.last_command_id >= c.state.dispatch.trims[0][0]
    c.restart(journal)
    c.resync_all()
    assert _trims(c)["settled_by_resync"] == 1 and 0 not in c.state.dispatch.trims
    fin = c.run()
    _exact(fin)
    assert c.trained_once()
    assert any(e == 0 for e, *_ in c.ranks[2].trained)


def test_a_trim_the_restart_never_delivered_is_void_and_planned_again():
    c = _world(CrashCluster)
    _until_trim_queued(c, 0)
    assert sorted(c.state.dispatch.trims) == [0, 1]
    c.restart(c.crash())  # both trims die in the old process's queue
    c.resync_all()
    assert _trims(c) == {"sent": 2, "void": 2} and c.state.dispatch.share_owed == [2]  # owed again
    fin = c.run()
    _exact(fin)
    assert c.trained_once()
    assert _trims(c)["sent"] == 4 and _trims(c)["answered"] == 2  # the next barrier planned anew
    assert any(e == 0 for e, *_ in c.ranks[2].trained)
    assert not any(isinstance(s, Send) and s.kind == "trim_partition" and s.rank == 2 for s in c.commands)


def test_an_answer_survives_the_journal_format():
    ev = PartitionTrimmed(now=1.5, rank=1, command_id=41, epoch=0, kept=24, released=((44, 4), (60, 8)))
    rec = json.loads(json.dumps(to_record(ev)))  # lists on disk
    assert from_record(rec) == ev
