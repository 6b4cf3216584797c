"""The dashboard's timeline, fed events and commands by hand (as the service feeds it)."""

from __future__ import annotations

import json

import pytest

from flodl.core import BatchDone, CoordinatorRestarted, Notice, OpenRound, RankHello, Reply, Send, SyncAcked, Tick
from flodl.wire import pb
from flodl_coordinator import timeline as tl_mod
from flodl_coordinator.timeline import Timeline


def hello(tl, t, rank, host="h"):
    ev = RankHello(now=t, route=(b"r%d" % rank,), rank=rank, world_size=2, model_sig=b"a" * 32, dataset_len=64,
                   host=host)  # fmt: skip
    tl.observe(ev, [Reply(ev.route, pb.HelloAck(accepted=True))])


def batch(tl, t, rank, loss=1.0, samples=4, ms=10.0, cmds=()):
    tl.observe(BatchDone(now=t, rank=rank, batch_ms=ms, data_ms=0.0, step_count=1, loss=loss, samples=samples,
                         epoch=0, offset=0), list(cmds))  # fmt: skip


def send(rank, **cmd):
    return Send(rank, pb.Control(**cmd))


def lane(snap, rank):
    return json.loads(json.dumps(snap["lanes"][rank]))  # as a reader of /timeline sees it


def test_timeline_window_round_and_throttle_spans_follow_the_commands():
    tl = Timeline(2, num_epochs=1)
    hello(tl, 100.0, 0, host="gpu-a")
    hello(tl, 100.5, 1)
    for i in range(3):
        batch(tl, 101.0 + i * 0.1, 0)
    # Rank 1 is throttled (it ran its window) until the round's Update reaches it.
    tl.observe(Tick(now=101.25), [send(1, throttle=pb.Control.Throttle())])
    tl.observe(Tick(now=101.3), [OpenRound(7, (0,))])
    snap = tl.snapshot()
    r0 = lane(snap, 0)
    assert r0["host"] == "gpu-a"
    assert [m["kind"] for m in r0["marks"]] == ["join"] and r0["marks"][0]["t"] == 0.0
    assert r0["spans"] == [["train", 0.99, 1.3, {"steps": 3}], ["round", 1.3, None, {"cycle": 7}]]
    assert lane(snap, 1)["spans"] == [["throttle", 1.25, None, None]]

    tl.observe(SyncAcked(now=101.5, rank=0, cycle=7, step_count=3), [send(1, update=pb.Control.Update(cycle=7))])
    snap = tl.snapshot()
    assert lane(snap, 0)["spans"][-1] == ["round", 1.3, 1.5, {"cycle": 7}]
    assert lane(snap, 1)["spans"] == [["throttle", 1.25, 1.5, None]]
    assert snap["now"] == 1.5


def test_timeline_a_death_closes_the_lane_and_a_rejoin_is_marked_as_such():
    tl = Timeline(2)
    hello(tl, 0.0, 0)
    batch(tl, 1.0, 0)
    lost = Notice("rank_lost", {"rank": 0, "reason": "exited with code -9", "discarded_samples": 12})
    tl.observe(Tick(now=2.0), [lost])
    snap = tl.snapshot()
    r0 = lane(snap, 0)
    assert r0["spans"] == [["train", 0.99, 2.0, None]]  # nothing left running on a dead rank
    assert r0["marks"][-1] == {"t": 2.0, "kind": "death", "detail": "exited with code -9 (12 samples discarded)"}
    ev = snap["events"][-1]
    assert ev["kind"] == "rank_lost" and ev["level"] == "warning" and "code -9" in ev["text"]
    hello(tl, 3.0, 0)
    assert [m["kind"] for m in lane(tl.snapshot(), 0)["marks"]] == ["join", "death", "rejoin"]


def test_timeline_epochs_curve_and_events():
    tl = Timeline(2, num_epochs=2)
    hello(tl, 0.0, 0)
    for i in range(10):  # 10 steps of 4 samples, loss 2.0, over one second
        batch(tl, 0.1 * (i + 1), 0, loss=2.0, ms=100.0)
    tl.observe(Tick(now=1.0), [OpenRound(1, (0,)), Notice("window", {"cycle": 1})])
    epoch = Notice("epoch", {"epoch": 0, "avg_loss": 2.0, "samples_per_s": [30.0, 10.5], "wall_s": 1.0,
                             "coverage": {"epoch": 0, "expected": 40, "trained": 40, "duplicates": 0, "missing": 0}})
    batch(tl, 1.5, 0, loss=1.0, samples=10, ms=100.0)
    tl.observe(Tick(now=2.0), [epoch])
    snap = tl.snapshot()
    assert snap["curve"] == [
        {"t": 1.0, "samples_per_s": 40.0, "loss": 2.0, "samples": 40},
        {"t": 2.0, "samples_per_s": 10.0, "loss": 1.0, "samples": 10},
    ]
    assert snap["epochs"] == [{"epoch": 0, "t": 2.0, "avg_loss": 2.0, "samples_per_s": 40.5, "per_rank": [30.0, 10.5],
                               "wall_s": 1.0, "coverage": {"expected": 40, "trained": 40, "duplicates": 0, "missing": 0}}]
    kinds = [e["kind"] for e in snap["events"]]
    assert kinds == ["epoch"]  # per-window notices are the lanes' and the curve's, not the list's
    assert snap["events"][0]["level"] == "info" and "40/40 samples" in snap["events"][0]["text"]
    json.dumps(snap, allow_nan=False)  # plain, strict JSON


def test_timeline_restart_is_a_run_mark():
    tl = Timeline(1)
    tl.observe(CoordinatorRestarted(now=5.0, incarnation=3), [])
    tl.observe(CoordinatorRestarted(now=6.0, incarnation=5, cause="relay"), [])
    assert [m["kind"] for m in tl.snapshot()["marks"]] == ["coordinator_restart", "relay_restart"]


def test_timeline_is_bounded_and_says_what_it_dropped(monkeypatch):
    monkeypatch.setattr(tl_mod, "MAX_SPANS_PER_RANK", 8)
    monkeypatch.setattr(tl_mod, "MAX_CURVE_POINTS", 16)
    monkeypatch.setattr(tl_mod, "CURVE_MIN_DT_S", 0.0)
    tl = Timeline(1)
    fed = 0
    for c in range(100):  # 100 windows and rounds: 200 spans, 100 curve points
        batch(tl, c + 0.5, 0, samples=c + 1, ms=100.0)
        fed += c + 1
        tl.observe(Tick(now=c + 0.6), [OpenRound(c, (0,))])
        tl.observe(SyncAcked(now=c + 0.7, rank=0, cycle=c, step_count=c + 1), [])
    snap = tl.snapshot()
    assert len(lane(snap, 0)["spans"]) == 8 and snap["truncated"]["spans"] == 192
    assert lane(snap, 0)["spans"][-1] == ["round", 99.1, 99.2, {"cycle": 99}]  # the newest (t from the first event)
    assert len(snap["curve"]) <= 16 and snap["truncated"]["curve_merges"] > 0
    assert sum(p["samples"] for p in snap["curve"]) == fed  # merged, never lost
    assert snap["curve"][-1]["t"] == 99.1


def test_timeline_snapshot_shares_nothing_with_the_timeline():
    tl = Timeline(1)
    hello(tl, 0.0, 0)
    batch(tl, 1.0, 0)
    tl.observe(Tick(now=1.5), [OpenRound(1, (0,))])  # closes the train span
    snap = tl.snapshot()
    snap["lanes"][0]["spans"].clear()
    snap["lanes"][0]["marks"][0]["kind"] = "changed"
    assert lane(tl.snapshot(), 0)["spans"][0] == ["train", 0.99, 1.5, {"steps": 1}]
    assert lane(tl.snapshot(), 0)["marks"][0]["kind"] == "join"
    closed = tl.snapshot()["lanes"][0]["spans"][0]
    with pytest.raises(TypeError):
        closed[1] = 0.0  # a closed span is a tuple: a snapshot can share it


@pytest.mark.parametrize("rank", [-1, 5])
def test_timeline_ignores_a_rank_outside_the_world(rank):
    tl = Timeline(2)
    batch(tl, 1.0, rank)
    tl.observe(Tick(now=1.0), [OpenRound(1, (rank,)), Notice("rank_lost", {"rank": rank})])
    assert all(not lane["spans"] and not lane["marks"] for lane in tl.snapshot()["lanes"])


def test_timeline_big_worlds_share_one_span_budget():
    assert tl_mod.spans_per_rank(8) == tl_mod.MAX_SPANS_PER_RANK
    assert tl_mod.spans_per_rank(1_000) == tl_mod.MAX_SPANS_TOTAL // 1_000
    assert tl_mod.spans_per_rank(100_000) == tl_mod.MIN_SPANS_PER_RANK
    tl = Timeline(1_000)
    assert {lane.spans.maxlen for lane in tl._lanes} == {tl_mod.MAX_SPANS_TOTAL // 1_000}


def test_timeline_a_staged_checkpoint_is_one_short_line_not_its_meta():
    from flodl.core import StageCheckpoint

    tl = Timeline(1)
    tl.observe(Tick(now=0.0), [StageCheckpoint.of(3, {"coverage": {"epochs": [{"bits": "ff" * 10_000}]}})])
    (ev,) = tl.snapshot()["events"]
    assert ev["text"] == "checkpoint 3 staged: the saving rank was asked for it"


def test_timeline_a_poll_carries_each_ranks_latest_spans_within_its_bound():
    tl = Timeline(2)
    for c in range(10):  # per rank: 10 windows and 10 rounds, all closed
        for r in (0, 1):
            batch(tl, c + 0.1, r)
        tl.observe(Tick(now=c + 0.5), [OpenRound(c, (0, 1))])
        for r in (0, 1):
            tl.observe(SyncAcked(now=c + 0.6, rank=r, cycle=c, step_count=c + 1), [])
    batch(tl, 10.1, 0)  # rank 0 trains on: a span still running, always sent
    snap = tl.snapshot(max_spans=6)  # 3 closed a rank, its latest
    assert snap["truncated"]["spans_not_sent"] == 2 * (20 - 3)
    r0 = lane(snap, 0)["spans"]
    assert [(s[0], s[3]) for s in r0[:3]] == [("round", {"cycle": 8}), ("train", {"steps": 1}), ("round", {"cycle": 9})]
    assert r0[3][0] == "train" and r0[3][2] is None
    assert len(lane(tl.snapshot(), 0)["spans"]) == 21  # 0: everything kept
