"""``RankRefused``: the shell refuses a member mid-run (a coordinator restarted as a newer
release meets a rank of an older protocol minor: tests/unit/coordinator/test_protocol_minor.py).
The core loses it as it loses a dead rank -- its work goes to the others, nothing is
trained twice or skipped -- and the run, complete, ends not ok, naming it."""

from __future__ import annotations

import pytest

from flodl.core import JOINING, VACANT, ForgetRank, LastWord, RankRefused, from_record, to_record

from .cluster import Cluster


@pytest.mark.parametrize("policy", ["sync", "cadence"])
def test_a_refused_member_is_lost_its_work_redone_and_the_run_not_ok(policy):
    c = Cluster(world_size=3, total=96, batch_size=4, epochs=2, policy=policy)
    c.join_all()
    c.run_until(lambda: c.ranks[1].step >= 3)
    ev = RankRefused(now=c.now, rank=1, reason="too old: install the same release")
    assert from_record(to_record(ev)) == ev  # journaled like any other event
    route = c.state.ranks[1].route
    cmds = c.feed(ev)
    (last,) = [x for x in cmds if isinstance(x, LastWord)]  # told why, on the route it had
    assert last.rank == 1 and last.route == route and last.control.shutdown.reason == ev.reason
    assert any(type(x) is ForgetRank for x in cmds) and c.state.route_of(1) is None
    c.ranks[1].alive = False  # (the shell told it to stop)
    # Refused again (a frame already on its way): ignored, the first reason stands.
    assert c.feed(RankRefused(now=c.now, rank=1, reason="again")) == []
    assert c.state.run.refused == {1: "too old: install the same release"}
    fin = c.run()
    assert fin is not None and fin.ok is False
    assert fin.reason == "rank(s) [1] refused mid-run: too old: install the same release"
    row = fin.summary["ranks"][1]
    assert row["phase"] == "DEAD" and row["reason"] == "refused: too old: install the same release"
    for e in fin.summary["coverage"]:
        assert (e["missing"], e["duplicates"]) == (0, 0), e


def test_a_joiner_refused_before_the_world_forms_frees_its_slot_and_fails_nothing():
    # Not yet a member (trained nothing): its slot reopens as for a refused hello, and a
    # rank of the current release that takes it forms the world and completes the run ok.
    c = Cluster(world_size=3, total=48, batch_size=4, epochs=1, policy="sync")
    c.hello(0)
    c.hello(1)
    assert c.state.ranks[1].phase is JOINING
    c.feed(RankRefused(now=c.now, rank=1, reason="too old"))
    assert c.state.ranks[1].phase is VACANT and c.state.run.refused == {}
    c.ranks[1].forgotten = False  # (rank 1 again, restarted with the current release)
    c.join_all()
    fin = c.run()
    assert fin is not None and fin.ok, fin.reason
