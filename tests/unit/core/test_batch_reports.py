"""Coalesced batch reports in the core: ``Timing.batches`` -> one ``BatchesDone``.

A frame of several batches is checked whole against the state before any of them
changes it, then ingested batch by batch as ``BatchDone`` would be, and the rules
settle once for the frame. Runs with coalesced reports cover every sample exactly
once, as runs with a frame per batch do, with fewer events."""

from __future__ import annotations

import copy
import json

import pytest

from flodl.core import BatchDone, BatchesDone, CoreConfig, RankViolation, replay, step, timing_event
from flodl.core._events import from_record, to_record
from flodl.wire import pb

from flodl.core.cadence import _async, _boundary

from . import cluster as cluster_module
from .cluster import Cluster

EXACT = {"expected": 96, "trained": 96, "duplicates": 0, "missing": 0}


def _run(policy: str, report_ms: float, **kw) -> Cluster:
    c = Cluster(policy=policy, world_size=3, total=96, batch_size=4, epochs=2, speeds=[2.0, 4.0, 9.0],
                batch_report_ms=report_ms, **kw)  # fmt: skip
    c.join_all()
    res = c.run()
    assert res is not None and res.ok, res
    assert [{k: e[k] for k in EXACT} for e in res.summary["coverage"]] == [EXACT] * 2
    return c


@pytest.mark.parametrize("policy", ["sync", "cadence", "async"])
def test_coalesced_runs_cover_every_sample_once_with_fewer_events(policy):
    each = _run(policy, 0.0)
    coalesced = _run(policy, 25.0)
    assert not any(isinstance(ev, BatchesDone) for ev in each.journal)
    frames = [ev for ev in coalesced.journal if isinstance(ev, BatchesDone)]
    assert frames and max(len(ev.batches) for ev in frames) > 1
    n_each = sum(isinstance(ev, BatchDone) for ev in each.journal)
    n_coalesced = sum(isinstance(ev, BatchDone) for ev in coalesced.journal) + len(frames)
    assert n_coalesced < n_each  # the point: fewer frames and fewer steps of the core
    rows = lambda c: [(r["batches"], r["batch_frames"]) for r in c.finished.summary["ranks"]]  # noqa: E731
    assert all(b == f for b, f in rows(each))  # the summary says how many frames carried them
    assert sum(f for _b, f in rows(coalesced)) == n_coalesced < sum(b for b, _f in rows(coalesced))
    assert replay(coalesced.config, coalesced.journal) == coalesced.state  # the journal holds them


@pytest.mark.parametrize("policy", ["cadence", "async"])
def test_a_frame_asks_for_a_top_up_once_at_its_last_batch(policy, monkeypatch):
    """The top-up (more work before the rank runs dry) is decided by a frame's last batch,
    which knows the fewest batches left; its earlier ones do not ask (a saturated frame
    of ten asked ten times). Every top-up asked is asked with the rank's latest step."""
    asked: list[tuple[int, int]] = []  # (step the rank is at, last step of its frame)
    frame_end: dict[int, int] = {}
    real_step = step

    def stepping(st, ev):
        if isinstance(ev, BatchesDone):
            frame_end[ev.rank] = ev.batches[-1].step_count
        elif isinstance(ev, BatchDone):
            frame_end[ev.rank] = ev.step_count
        return real_step(st, ev)

    streams_cls = _async._Streams if policy == "async" else _boundary._BoundaryStreams
    real_top_up = streams_cls.top_up

    def top_up(self, st, rank, unreported, out):
        asked.append((st.ranks[rank].last_step, frame_end[rank]))
        return real_top_up(self, st, rank, unreported, out)

    monkeypatch.setattr(streams_cls, "top_up", top_up)
    monkeypatch.setattr(cluster_module, "step", stepping)
    c = _run(policy, 25.0)
    frames = [ev for ev in c.journal if isinstance(ev, BatchesDone)]
    assert asked and max(len(ev.batches) for ev in frames) > 1
    assert all(at == end for at, end in asked), [a for a in asked if a[0] != a[1]][:5]


def test_a_coalesced_run_survives_a_death_mid_frame_with_exact_coverage():
    c = Cluster(policy="cadence", world_size=3, total=96, batch_size=4, epochs=2, speeds=[2.0, 4.0, 9.0],
                batch_report_ms=25.0)  # fmt: skip
    c.join_all()
    c.run_until(lambda: c.ranks[0].step >= 5 and bool(c.ranks[0].m.unsent))  # trained, not reported yet
    c.kill(0)
    res = c.run()
    assert res is not None and res.ok
    assert [{k: e[k] for k in EXACT} for e in res.summary["coverage"]] == [EXACT] * 2


def _mid_run() -> Cluster:
    c = Cluster(policy="cadence", world_size=2, total=96, batch_size=4, epochs=1, batch_report_ms=0.0)
    c.join_all()
    c.run_until(lambda: c.ranks[0].step >= 1 and len(c.ranks[0].m.upcoming(3)) == 3)  # 3 batches in hand
    return c


def _frame(c: Cluster, rank: int, batches: list[tuple[int, int, int]]) -> BatchesDone:
    """A batches frame of ``(step_count, epoch, offset)`` batches of 4 samples, decoded
    as the service would."""
    t = pb.Timing(rank=rank, batches=pb.Timing.BatchRun(batch=[
        pb.Timing.Batch(batch_ms=1.0, step_count=s, samples=4, epoch=e, offset=o) for s, e, o in batches]))  # fmt: skip
    ev = timing_event(c.now, t)
    assert isinstance(ev, BatchesDone)
    return ev


def _next_positions(c: Cluster, rank: int, n: int) -> list[tuple[int, int, int]]:
    """The rank's next ``n`` untrained batches as ``(step, epoch, offset)``."""
    nxt = c.ranks[rank].m.upcoming(n)
    return [(c.ranks[rank].step + 1 + i, e, o) for i, (e, o, _n) in enumerate(nxt)]


def test_a_frame_is_ingested_as_its_batches_would_be():
    c = _mid_run()
    batches = _next_positions(c, 0, 3)
    before = c.state.ranks[0].batches
    c.feed(_frame(c, 0, batches))
    assert c.state.ranks[0].batches == before + 3
    assert c.state.ranks[0].last_step == batches[-1][0]


@pytest.mark.parametrize(
    "why",
    ["empty", "out_of_order", "one_outside_the_assignment", "repeated_step"],
)
def test_a_bad_frame_is_refused_whole_and_changes_nothing(why):
    c = _mid_run()
    good = _next_positions(c, 0, 3)
    bad = {
        "empty": [],
        "out_of_order": [good[1], good[0], good[2]],
        "one_outside_the_assignment": [good[0], good[1], (good[2][0], good[2][1], 10_000)],
        "repeated_step": [good[0], (good[0][0], good[1][1], good[1][2])],
    }[why]
    before = copy.deepcopy(c.state)
    with pytest.raises(RankViolation):
        step(c.state, _frame(c, 0, bad))
    assert c.state == before


def test_a_frame_larger_than_any_rank_sends_is_refused():
    c = _mid_run()
    s0 = c.ranks[0].step + 1
    with pytest.raises(RankViolation, match="1 to 1024"):
        step(c.state, _frame(c, 0, [(s0 + i, 0, 0) for i in range(1025)]))


def test_the_journal_record_round_trips():
    one = dict(now=1.5, rank=2, batch_ms=1.0, data_ms=0.5, loss=0.25, samples=4, epoch=0, lr=0.01)
    ev = BatchesDone(now=1.5, rank=2, batches=(BatchDone(**one, step_count=7, offset=8),
                                               BatchDone(**one, step_count=8, offset=12, sync_divergence=0.3)))  # fmt: skip
    rec = json.loads(json.dumps(to_record(ev)))
    back = from_record(rec)
    assert back == ev and all(type(b) is BatchDone for b in back.batches)
    assert [b.step_count for b in back.batches] == [7, 8] and back.batches[1].sync_divergence == 0.3


def test_many_ranks_stretch_the_report_interval_to_the_coordinators_frame_budget():
    """``batch_reports_per_s``: N ranks report at most once per 1000*N / budget ms, at
    least ``batch_report_ms``, at most half a heartbeat interval; 0 stays a frame per batch."""
    ms = lambda **kw: CoreConfig(**kw).report_interval_ms  # noqa: E731
    assert ms(world_size=16) == 25.0  # (up to 50 ranks the default budget changes nothing)
    assert ms(world_size=256) == 128.0
    assert ms(world_size=1024) == 500.0  # half of the 1 s heartbeat: reports stand in for it
    assert ms(world_size=1024, heartbeat_interval_s=2.0) == 512.0
    assert ms(world_size=1024, batch_report_ms=0.0) == 0.0
    assert ms(world_size=1024, batch_reports_per_s=0.0) == 25.0
    assert ms(world_size=16, batch_report_ms=600.0) == 600.0
    for bad in (-1.0, float("nan")):
        with pytest.raises(ValueError, match="batch_reports_per_s"):
            CoreConfig(world_size=2, batch_reports_per_s=bad)


def test_the_ranks_are_told_the_stretched_interval_and_report_less_often():
    def frames(c: Cluster) -> int:
        return sum(isinstance(ev, (BatchDone, BatchesDone)) for ev in c.journal)

    plain = _run("cadence", 25.0)
    # 3 ranks: once per 100 ms (no batch cap: what the stretch alone does)
    stretched = _run("cadence", 25.0, batch_reports_per_s=30.0, report_batches=0)
    assert stretched.config.report_interval_ms == 100.0
    assert {r.m.spec.batch_report_ms for r in stretched.ranks} == {100.0}
    assert {r.m.spec.batch_report_ms for r in plain.ranks} == {25.0}
    assert frames(stretched) < frames(plain)
    # The batch cap: told only where the interval is stretched, with the interval as set as
    # its floor; these ranks' 2-9 ms batches reach the floor before 4 batches, so capped
    # they report as often as unstretched ones, never more.
    capped = _run("cadence", 25.0, batch_reports_per_s=30.0, report_batches=4)
    assert {(r.m.spec.report_batches, r.m.spec.report_floor_ms) for r in capped.ranks} == {(4, 25.0)}
    assert {r.m.spec.report_batches for r in plain.ranks} == {0}  # (unstretched: no cap, as before)
    assert frames(stretched) < frames(capped) <= frames(plain)
    formed = [cmd for cmd in stretched.commands if getattr(cmd, "kind", "") == "world_formed"]
    assert formed and formed[0].data["report_interval_ms"] == 100.0  # the operator's world_formed line says it
