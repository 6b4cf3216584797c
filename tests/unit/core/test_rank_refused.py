"""``RankRefused``: the shell refuses a member mid-run (a coordinator restarted as a newer
release meets a rank of an older protocol minor: tests/unit/coordinator/test_protocol_minor.py).
The core loses it as it loses a dead rank -- its work goes to the others, nothing is
trained twice or skipped -- and the run, complete, ends not ok, naming it."""

from __future__ import annotations

import pytest

from flodl.core import ForgetRank, RankRefused, from_record, to_record

from .cluster import Cluster


@pytest.mark.parametrize("policy", ["sync", "cadence"])
def test_a_refused_member_is_lost_its_work_redone_and_the_run_not_ok(policy):
    c = Cluster(world_size=3, total=96, batch_size=4, epochs=2, policy=policy)
    c.join_all()
    c.run_until(lambda: c.ranks[1].step >= 3)
    ev = RankRefused(now=c.now, rank=1, reason="too old: install the same release")
    assert from_record(to_record(ev)) == ev  # journaled like any other event
    assert any(type(x) is ForgetRank for x in c.feed(ev))
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
