"""``status_view``: the operator's view of the core, driven by the in-memory cluster."""

from __future__ import annotations

import copy
import json
from types import SimpleNamespace

from flodl.core import status_view
from flodl.core._status_view import _reasons


def _json(view):
    return json.loads(json.dumps(view, allow_nan=False))  # JSON-safe: str keys, finite floats


def test_forming_names_who_is_in_and_who_is_not(Cluster):
    c = Cluster(world_size=3, total=48, epochs=2)
    c.hello(0)
    v = _json(status_view(c.state))
    assert v["run"]["phase"] == "FORMING"
    assert [r["phase"] for r in v["ranks"]] == ["JOINING", "VACANT", "VACANT"]
    assert v["ranks"][0]["host"] == "host0" and v["ranks"][0]["pid"] == 1000
    assert v["epoch"] == {"num_epochs": 2, "dispatched": None, "aggregated": None}
    assert v["progress"]["samples_total"] == 2 * 48


def test_open_round_lists_the_ranks_it_waits_for(Cluster):
    c = Cluster(world_size=3, total=96, epochs=1, defer_acks=True)
    c.join_all()
    c.run_until(lambda: status_view(c.state)["round"]["open"])
    v = status_view(c.state)
    rnd = v["round"]
    assert rnd["ranks"] == [0, 1, 2] and rnd["waiting_for"] == [0, 1, 2]
    assert rnd["cycle"] == c.state.rounds.cycle and rnd["opened_at"] is not None
    assert v["reasons"]["round"] == c.state.rounds.gate_reason != ""
    while c.deliver_one(1):  # rank 1 reads its RequestParams, then acks
        pass
    assert c.send_ack(1)
    assert status_view(c.state)["round"]["waiting_for"] == [0, 2]
    assert v["round"]["waiting_for"] == [0, 1, 2]  # a view is a copy: the core moved on without it


def test_finished_run_is_fully_committed(Cluster):
    c = Cluster(world_size=2, total=40, epochs=2)
    c.join_all()
    c.run()
    v = _json(status_view(c.state))
    assert v["run"]["phase"] == "FINISHED" and v["run"]["ok"] is True
    assert v["epoch"]["aggregated"] == 1
    assert v["progress"]["samples_committed"] == v["progress"]["samples_total"] == 80
    assert v["progress"]["fraction"] == 1.0
    assert sum(r["samples"] for r in v["ranks"]) == 80
    assert v["round"]["open"] is False and v["round"]["waiting_for"] == []


def test_a_dead_rank_shows_its_reason_and_the_discarded_samples(Cluster):
    c = Cluster(world_size=2, total=80, epochs=1, defer_acks=True)
    c.join_all()
    c.run_until(lambda: c.state.ranks[1].batches >= 2)
    before = copy.deepcopy(c.state)
    c.kill(1)
    v = status_view(c.state)
    assert v["ranks"][1]["phase"] == "DEAD" and v["ranks"][1]["reason"]
    assert v["progress"]["samples_discarded"] > 0
    assert status_view(before)["ranks"][1]["phase"] == "ACTIVE"


def test_reasons_read_the_gate_and_a_reasons_mapping_when_the_state_has_one():
    assert _reasons(SimpleNamespace(rounds=SimpleNamespace(gate_reason=""))) == {}
    st = SimpleNamespace(rounds=SimpleNamespace(gate_reason="waiting: rank 2 behind"),
                         reasons={"epoch": "epoch 0 not aggregated: rank 1 owes ChunkDone", "idle": ""})
    assert _reasons(st) == {"round": "waiting: rank 2 behind", "epoch": "epoch 0 not aggregated: rank 1 owes ChunkDone"}


def test_the_view_names_the_report_interval_many_ranks_stretch(Cluster):
    """``report_interval_ms``: what the ranks were told (``RunSpec.batch_report_ms``), so an
    operator reading a 1,024-rank run's coarse progress sees why: 25 ms for a few ranks,
    stretched to 1000 * N / ``batch_reports_per_s`` for many."""
    from dataclasses import replace

    base = Cluster(world_size=4, total=48, epochs=1).state.config
    assert base.batch_report_ms == 0.0 and status_view(Cluster(total=48, config=base).state)["report_interval_ms"] == 0.0
    told = replace(base, batch_report_ms=25.0)  # 4 ranks well inside the 2,000 frames/s: as set
    assert status_view(Cluster(total=48, config=told).state)["report_interval_ms"] == 25.0
    few_frames = replace(told, batch_reports_per_s=100.0)  # 4 ranks at 100 frames/s: 40 ms
    assert status_view(Cluster(total=48, config=few_frames).state)["report_interval_ms"] == 40.0
