"""The core's incremental views (``_rank_index``, Cadence's wake/gate views, the pools'
kept sums) against a recount: ``view_drift`` stays empty through whole runs with deaths,
and names a view that a write went around."""

from __future__ import annotations

import pytest

from flodl.core import DEAD, JOINING, view_drift
from flodl.core._rank_index import RankIndex
from flodl.core.cadence import _dispatcher, _views

from .cluster import Cluster


def _run_checked(c: Cluster, max_iters: int = 5000) -> None:
    """Pump the cluster to its end, asserting no drift after every step."""
    for _ in range(max_iters):
        assert view_drift(c.state) == []
        if c.finished is not None or not c.pump_once():
            break
    assert view_drift(c.state) == []


@pytest.mark.parametrize("policy", ["sync", "cadence", "async"])
def test_views_agree_with_a_recount_through_a_run_with_deaths(policy):
    c = Cluster(policy=policy, world_size=5, total=400, batch_size=4, epochs=2, speeds=[10, 20, 40, 10, 20])
    c.join_all()
    while c.ranks[2].step < 3:  # mid-epoch, then two deaths
        assert c.pump_once() and view_drift(c.state) == []
    assert c.finished is None
    c.kill(3)
    c.kill(0)
    _run_checked(c)
    assert c.finished is not None and c.finished.ok, c.finished
    st = c.state
    assert st.alive_ranks() == [rec.rank for rec in st.ranks if rec.phase.__name__ == "ACTIVE"]
    assert st.index.count(DEAD) == 2


def test_drift_names_a_phase_written_around_the_index():
    c = Cluster(policy="sync", world_size=3)
    c.join_all()
    object.__setattr__(c.state.ranks[1], "phase", DEAD)  # a write that bypasses the record's hook
    drift = view_drift(c.state)
    assert any("phase ACTIVE" in d for d in drift) and any("phase DEAD" in d for d in drift), drift


def test_drift_names_a_pool_whose_kept_sum_moved():
    c = Cluster(policy="cadence", world_size=3)
    c.join_all()
    pool = next(iter(c.state.cadence.pools.values()))
    pool._unassigned += 1
    assert any("kept sums" in d for d in view_drift(c.state))


def test_drift_names_a_servable_rank_missing_from_wakeable():
    c = Cluster(policy="cadence", world_size=3, total=400, batch_size=4, epochs=1)
    c.join_all()
    st = c.state
    r = 0
    st.cadence.in_flight.pop(r)  # as if its chunk completed ...
    assert any(f"rank {r} could be served" in d for d in view_drift(st))  # ... but nobody told the views


def test_a_batchs_step_tells_the_index_only_when_it_makes_a_mover():
    c = Cluster(policy="cadence", world_size=3)
    c.join_all()
    st = c.state
    rec = st.ranks[1]
    rec.folded_step = rec.last_step  # nothing unfolded: not a mover
    assert 1 not in st.index.movers
    rec.advance_step(rec.last_step + 1)  # told: it becomes one
    assert 1 in st.index.movers and view_drift(st) == []
    rec.advance_step(rec.last_step + 5)  # already one: past the hook, and the views still agree
    assert 1 in st.index.movers and view_drift(st) == []
    rec.folded_step = rec.last_step  # a round folds it: no longer a mover
    assert 1 not in st.index.movers and view_drift(st) == []


def test_index_seen_floor_only_bounds_from_below_and_ticks_skip_the_walk():
    c = Cluster(policy="sync", world_size=4, liveness_timeout_s=10.0)
    c.join_all()
    index = c.state.index
    c.advance(1.0)  # a Tick: the walk sets the floor
    floor = index.seen_floor
    assert floor is not None and all(rec.last_seen >= floor for rec in c.state.ranks)
    c.advance(1.0)
    assert index.seen_floor == floor  # within the timeout: no walk, the bound stays
    c.silence(2)
    c.advance(12.0)  # rank 2 is stale: the walk finds it
    assert c.state.ranks[2].phase is DEAD and view_drift(c.state) == []


def test_index_from_records_and_queries():
    c = Cluster(policy="sync", world_size=3)
    c.hello(0)
    c.hello(2)
    index = RankIndex(c.state.ranks)
    assert index.count(JOINING) == 2 and index.addressable() == [0, 2] and index.alive() == []


def test_async_death_hands_the_hole_to_a_rank_cadences_wake_found_without_work():
    # Found by view_drift in the Async stateful test: a death reopens epoch 0; Cadence's
    # wake (the death's first) finds nothing in rank 2's own epoch (1), the stream's wake
    # right after must still see rank 2 as wakeable and hand it the hole.
    c = Cluster(world_size=3, total=5, batch_size=4, epochs=2, policy="async", anchor=1, defer_chunks=True,
                defer_acks=True, liveness_timeout_s=5.0, reduce_stall_s=1e9)  # fmt: skip
    c.join_all()
    c.pump_once()
    assert c.state.dispatch.rank_epoch[2] == 1 and 2 not in c.state.cadence.in_flight
    c.kill(1)
    assert c.state.cadence.in_flight[2][0] == 0  # the reclaimed hole of epoch 0
    assert view_drift(c.state) == []


@pytest.mark.parametrize("policy", ["cadence", "async"])
def test_views_agree_through_a_run_wide_enough_for_the_gates_sweep(policy, monkeypatch):
    """More ranks than ``_views.REFILL``: a finished round refills the gate's heap in one
    heapify and the gate sifts it in one sweep; a death mid-run reclaims holes."""
    swept = []
    real = _dispatcher._sift_open

    def sift(st):
        swept.append(len(st.cadence.open_windows))
        real(st)

    monkeypatch.setattr(_dispatcher, "_sift_open", sift)
    n = _views.REFILL + 16
    c = Cluster(policy=policy, world_size=n, total=n * 16, batch_size=4, epochs=2,
                speeds=[(10, 20, 40)[r % 3] for r in range(n)])  # fmt: skip
    c.join_all()
    while c.ranks[1].step < 2:
        assert c.pump_once() and view_drift(c.state) == []
    c.kill(5)
    _run_checked(c, max_iters=200_000)
    assert c.finished is not None and c.finished.ok, c.finished
    assert all(e["missing"] == 0 and e["duplicates"] == 0 for e in c.finished.summary["coverage"])
    assert swept and max(swept) > _views.REFILL  # the sweep ran, over a refilled heap
