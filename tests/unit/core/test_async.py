"""Async in the core: overshoot budget, no throttle, streaming across epochs, deaths.

The Cluster trains one batch per rank per pump; ``_pump`` below trains ``k`` batches of
rank ``r`` per pump (``k = pace[r]``) so that ranks really run at unequal speeds.
"""

import random

import pytest

from flodl.core import CoreConfig, Notice, OpenRound, initial_state, replay
from flodl.core.cadence import _async, _dispatcher as _cadence
from flodl.core._policy import gate_for
from flodl.core.cadence._dispatcher import _budget, cadence_gate, window_steps
from flodl.core.cadence._chunk_pool import ChunkPool
from flodl.core._coverage import freeze, open_epoch
from flodl.core._policy import dispatcher_for
from flodl.core._membership import run_spec
from flodl.core import ACTIVE, TRAINING
from flodl.wire import pb

from flodl.core._commands import Send

from .cluster import Cluster, window_plan

EXACT = {"expected": 100, "trained": 100, "duplicates": 0, "missing": 0}


def _state(ws, anchor, *, total=100, bs=1, epochs=2, policy="async", **kw):
    """A formed, training coordinator with no epoch dispatched (NoGuard)."""
    kw.setdefault("guard", "none")
    kw.setdefault("probe_batches", None)  # the reference's scenarios: the first window is the anchor
    cfg = CoreConfig(world_size=ws, policy=policy, anchor=anchor, batch_size=bs, num_epochs=epochs,
                     total_samples=total, **kw)  # fmt: skip
    st = initial_state(cfg)
    for rec in st.ranks:
        rec.phase, rec.route = ACTIVE, (b"r%d" % rec.rank,)
    st.run.phase = TRAINING
    return st


def _pool(st, epoch, total):
    st.cadence.pools[epoch] = ChunkPool(epoch, total, st.config.world_size)
    open_epoch(st.coverage, epoch, total)
    st.dispatch.assigned.setdefault(epoch, {})
    st.dispatch.last_dispatched = epoch
    for r in range(st.config.world_size):
        st.dispatch.rank_epoch[r] = epoch


def _plan(ctl):
    p = ctl.start_epoch.plan
    return (p.epoch, p.partition_offset, p.partition_size)


def _plans(out):
    """``(rank, (epoch, offset, size))`` of the ``StartEpoch``s in ``out``."""
    return [(c.rank, _plan(c.control)) for c in out if getattr(c, "kind", None) == "start_epoch"]


def _pump(c, pace):
    """Every rank drains its inbox, acks, reports; rank r trains ``pace[r]`` batches."""
    for r, k in enumerate(pace):
        while c.deliver_one(r):
            pass
        c.send_ack(r)
        c.send_chunk(r)
        for _ in range(k):
            if not c.train_one(r):
                break
    c.advance(c.dt)


def _run(c, pace, until=None, max_iters=20000):
    for _ in range(max_iters):
        if c.finished is not None or (until is not None and until()):
            return c.finished
        _pump(c, pace)
    raise AssertionError(f"no progress: gate says {c.state.rounds.gate_reason!r}")


def _exact(res, epochs, total=100):
    assert res is not None and res.ok, res
    cov = res.summary["coverage"]
    assert len(cov) == epochs
    for e in cov:
        assert (e["expected"], e["trained"], e["duplicates"], e["missing"]) == (total, total, 0, 0), e


# -- registration and the RunSpec ----------------------------------------------------------


def test_async_is_registered_and_the_hello_ack_says_async_with_its_alpha():
    st = initial_state(CoreConfig(world_size=2, policy="async", easgd_alpha=0.25))
    assert dispatcher_for(st) is _async.ASYNC and dispatcher_for(st).progressive
    assert gate_for(st) is cadence_gate
    spec = run_spec(st, 100)
    assert spec.policy == pb.POLICY_ASYNC and spec.easgd_alpha == pytest.approx(0.25)
    assert run_spec(initial_state(CoreConfig(world_size=2, policy="async")), 100).easgd_alpha == 0.5
    with pytest.raises(ValueError, match="policy async needs plane = bus"):
        CoreConfig(world_size=2, policy="async", plane="collective")


# -- the overshoot budget ---------------------------------------------------------------------


def test_budget_is_the_count_plus_the_overshoot_and_only_it_holds_a_rank():
    st = _state(2, 4)
    st.cadence.elche.report_timing([10, 20], [2, 2], 0)
    assert st.cadence.elche.batch_counts == [8, 4]
    assert st.cadence.overshoot.max_overshoot == 3
    assert [_budget(st, r) for r in (0, 1)] == [11, 7]
    _pool(st, 0, 100)
    st.ranks[0].last_step = 8  # its window is done, the slow rank's is not: keeps going
    out = []
    assert _async._dispatch_next(st, 0, out)
    assert _plan(out[0].control)[2] == 3  # exactly up to the budget, never across it
    del st.cadence.in_flight[0]
    st.ranks[0].last_step = 11
    assert _cadence._held(st, 0) == "reduce barrier"
    assert not _async._dispatch_next(st, 0, [])
    # Cadence holds the same rank at its count already.
    cad = _state(2, 4, policy="cadence")
    cad.cadence.elche.report_timing([10, 20], [2, 2], 0)
    _pool(cad, 0, 100)
    cad.ranks[0].last_step = 8
    assert _cadence._held(cad, 0) == "reduce barrier"


def test_chunks_are_probe_then_proportional_and_capped_to_the_budget():
    st = _state(2, 4, total=400)
    _pool(st, 0, 400)
    # Uncalibrated: the probe chunk (~10 % of an equal share, >= 4) capped to count + 3.
    out = []
    assert _async._dispatch_next(st, 0, out)
    assert _plan(out[0].control)[2] == 4 + 3
    st.cadence.elche.report_timing([10, 20], [2, 2], 0)  # counts [8, 4]
    assert st.cadence.final_plan is None
    del st.cadence.in_flight[0]
    st.ranks[0].last_step = st.cadence.window_mark.get(0, 0)
    out = []
    assert _async._dispatch_next(st, 1, out)
    assert _plan(out[0].control)[2] == 4 + 3  # proportional share >> budget: the budget


def test_overshoot_widens_on_stable_under_async_only():
    ends = {}
    for policy in ("cadence", "async"):
        c = Cluster(world_size=2, total=100, batch_size=2, epochs=2, policy=policy, anchor=2, guard="none")
        c.join_all()
        _exact(_run(c, (2, 1)), 2)
        ends[policy] = c.state.cadence.overshoot.max_overshoot
        assert c.finished.summary["elche"]["max_overshoot"] == ends[policy]
    assert ends["cadence"] == 3 and ends["async"] > 3


class BudgetCheckedCluster(Cluster):
    """Records every take: (rank, batches, steps this window, budget, unfolded)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.takes = []

    def feed(self, ev):
        orig_c = _cadence._take  # Async takes through Cadence's offer_chunk too

        def take(st, rank, epoch, batches):
            self.takes.append((rank, batches, window_steps(st, rank), _budget(st, rank), st.unfolded(rank)))
            return orig_c(st, rank, epoch, batches)

        _cadence._take = take
        try:
            return super().feed(ev)
        finally:
            _cadence._take = orig_c


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_no_chunk_crosses_the_budget_and_no_rank_is_ever_throttled(seed):
    rng = random.Random(seed)
    pace = tuple(rng.choice([1, 2, 4]) for _ in range(3))
    c = BudgetCheckedCluster(world_size=3, total=100, batch_size=2, epochs=3, policy="async", anchor=2)
    c.join_all()
    _exact(_run(c, pace), 3)
    assert c.takes
    for rank, n, steps, budget, unfolded in c.takes:
        # A chunk ends at the budget at the latest; a rank at its budget gets nothing
        # (unless its whole window was folded already: then no round is waited for).
        assert n <= max(1, budget - steps), (rank, n, steps, budget)
        assert steps < budget or unfolded == 0, (rank, steps, budget)
    assert not c.sends("throttle")
    assert not any(s.control.update.HasField("next_plan") for s in c.sends("update"))


def test_at_the_trigger_idle_ranks_get_work_before_their_request_params():
    c = Cluster(world_size=2, total=100, batch_size=1, epochs=1, policy="async", anchor=2)
    c.join_all()
    seen = []
    for _ in range(200):
        before = len(c.commands)
        _pump(c, (3, 1))
        step_cmds = c.commands[before:]
        if any(isinstance(x, OpenRound) for x in step_cmds):
            seen.append(step_cmds)
    assert seen
    handed = 0  # (the first triggers find no rank idle: every trigger of the run is looked at)
    for cmds in seen:
        kinds = [(x.rank, x.kind) for x in cmds if hasattr(x, "kind") and hasattr(x, "rank")]
        assert not [k for k in kinds if k[1] == "throttle"]
        for r in (0, 1):
            mine = [x for x in cmds if isinstance(x, Send) and x.rank == r]
            plans = [i for i, x in enumerate(mine) if window_plan(x.control)]
            asks = [i for i, x in enumerate(mine) if x.kind == "request_params"]
            if plans and asks:  # before its RequestParams, or in them (protocol 1.2)
                assert max(plans) <= asks[0]
                handed += 1
    assert handed


# -- streaming across epochs --------------------------------------------------------------------


def test_a_drained_epoch_streams_into_the_next_before_it_is_aggregated():
    c = Cluster(world_size=2, total=40, batch_size=1, epochs=2, policy="async", anchor=2)
    c.join_all()
    opened = lambda: any(isinstance(x, Notice) and x.kind == "epoch_opened" for x in c.commands)  # noqa: E731
    _run(c, (4, 1), until=opened)
    note = next(x for x in c.commands if isinstance(x, Notice) and x.kind == "epoch_opened")
    assert note.data["epoch"] == 1 and note.data["live_epochs"] == [0, 1]
    assert c.state.metrics.last_aggregated is None  # epoch 0 still open: no epoch barrier
    assert c.state.dispatch.rank_epoch[note.data["rank"]] == 1
    _exact(_run(c, (4, 1)), 2, total=40)
    # Epoch 1 was opened by streaming: `advance` never dispatched it a second time.
    assert sum(1 for x in c.commands if isinstance(x, Notice) and x.kind == "epoch_opened") == 1


def test_a_later_epoch_dispatched_by_advance_still_respects_the_reduce_barrier():
    st = _state(2, 4, total=40, epochs=3)
    out = []
    _async.ASYNC.dispatch_epoch(st, 0, out)  # the first epoch: Cadence's kick-off
    assert sorted(r for r, _p in _plans(out)) == [0, 1]
    st.cadence.in_flight.clear()
    st.cadence.pools[0] = ChunkPool(0, 0, 2)  # epoch 0 drained ...
    freeze(st.coverage, 0)  # ... and aggregated
    st.ranks[0].last_step = _budget(st, 0)  # at its barrier, unfolded
    st.ranks[1].last_step = 1
    out = []
    _async.ASYNC.dispatch_epoch(st, 1, out)
    assert _plans(out) == [(1, _plans(out)[0][1])] and _plans(out)[0][1][0] == 1
    assert 0 not in st.cadence.in_flight and st.dispatch.last_dispatched == 1


def test_stream_ahead_stops_at_num_epochs_and_the_tail_is_folded():
    c = Cluster(world_size=3, total=30, batch_size=1, epochs=2, policy="async", anchor=1)
    c.join_all()
    res = _run(c, (5, 2, 1))
    _exact(res, 2, total=30)
    assert all(s.control.start_epoch.plan.epoch < 2 for s in c.sends("start_epoch"))
    assert res.summary["global_step"] == sum(r.step for r in c.ranks)  # every step folded


# -- deaths -------------------------------------------------------------------------------------


def test_a_death_reclaims_into_the_oldest_epoch_first():
    st = _state(2, 4, total=40, epochs=3)
    _pool(st, 0, 40)
    pool0 = st.cadence.pools[0]
    # Everything of epoch 0 is handed out; rank 1 holds (and trained, unfolded) [20, 40).
    assert pool0.take_chunk(0, 20) == (0, 20) and pool0.take_chunk(1, 20) == (20, 20)
    pool0.mark_completed(0, 20)
    st.dispatch.assigned[0] = {0: [(0, 20)], 1: [(20, 20)]}
    st.coverage.epochs[0].committed[0:20] = b"\x01" * 20
    st.coverage.epochs[0].unique = 20
    st.cadence.in_flight = {1: (0, 20, 20)}
    # Rank 0 streamed into epoch 1 and is mid-chunk there.
    out = []
    assert _async._dispatch_next(st, 0, out)
    assert [p[0] for _r, p in _plans(out)] == [1] and _cadence.live_epochs(st) == [0, 1]
    assert [x.data["epoch"] for x in out if isinstance(x, Notice)] == [1]
    e1_chunk = st.cadence.in_flight[0]
    # Rank 1 dies: its epoch-0 positions go back to epoch 0's pool.
    st.ranks[1].phase = "gone"  # not ACTIVE
    out = []
    _async.ASYNC.reassign(st, 1, out)
    assert st.cadence.pools[0].remaining() == 20
    # Mid-chunk, rank 0 gets no extension of epoch 1 (its pool has plenty): the older
    # epoch's hole goes first, by the plain take once this chunk is done.
    assert st.cadence.pools[1].remaining() > 0 and _cadence.source_epoch(st) == 0
    out = []
    assert not _cadence.extend_in_window(st, 0, 4, out) and not out
    # Rank 0 finishes its epoch-1 chunk: the next chunk is the older epoch's hole.
    st.cadence.pools[1].mark_completed(0, e1_chunk[2])
    del st.cadence.in_flight[0]
    st.cadence.window_mark[0] = st.ranks[0].last_step
    out = []
    assert _async._dispatch_next(st, 0, out)
    [(_r, (epoch, off, size))] = _plans(out)
    assert epoch == 0 and 20 <= off and off + size <= 40
    assert st.dispatch.rank_epoch[0] == 0  # its current epoch went back for the hole


@pytest.mark.parametrize("victim,at", [(0, 4), (2, 3), (0, 30), (1, 9), (1, 14)])
def test_death_mid_epoch_exact_coverage_with_discards_counted(victim, at):
    # (0, 30), (1, 9), (1, 14): the rank dies while two epochs are live, with unfolded
    # batches in both (or in the newer one): each epoch gets its own holes back.
    c = Cluster(world_size=3, total=100, batch_size=4, epochs=3, policy="async", anchor=2)
    c.join_all()
    _run(c, (4, 2, 1), until=lambda: c.ranks[victim].step >= at)
    assert c.finished is None and c.state.unfolded(victim) > 0
    c.kill(victim)
    res = _run(c, (4, 2, 1))
    _exact(res, 3)
    assert res.summary["ranks"][victim]["phase"] == "DEAD"
    assert res.summary["discarded_samples"] == sum(e["discarded"] for e in res.summary["coverage"])
    trained = {}
    for r in c.ranks:
        if r.rank != victim:
            for e, off, n, _ in r.trained:
                for p in range(off, off + n):
                    trained[(e, p)] = trained.get((e, p), 0) + 1
    assert all(v == 1 for v in trained.values())  # survivors never repeat a position


def test_replay_rebuilds_the_same_state_and_commands():
    c = Cluster(world_size=3, total=100, batch_size=4, epochs=2, policy="async", anchor=2, guard="level")
    c.join_all()
    _run(c, (4, 2, 1), until=lambda: c.ranks[1].step >= 9)
    c.kill(1)
    _run(c, (4, 2, 1))
    record = []
    st = replay(c.config, c.journal, record=record)
    assert st == c.state
    assert record == c.commands


def test_a_probe_windows_look_ahead_outlasts_the_slowest_batch():
    # Uncalibrated, a window is a batch or two and the first rounds wait for the slowest
    # rank to end its batch twice: past its window a rank may run two of the slowest batch
    # yet seen, at its own pace, not just the look-ahead of 3 (a 1,1,2,3,5,8 rig's fast
    # ranks idled 120 ms of their first round). Once calibrated, the look-ahead alone.
    st = _state(2, 1)
    st.cadence.elche.batch_counts = [1, 1]
    st.ranks[0].count_batch(1, 10.0, 0.0)  # rank 0: 10 ms a batch
    look = st.cadence.overshoot.look_ahead(True)
    assert _budget(st, 0) == 1 + look  # no batch seen yet but its own: nothing slower known
    st.cadence.slowest_batch_ms = 80.0
    assert _budget(st, 0) == 1 + 16
    st.ranks[0].last_step = 1 + look  # past the look-ahead of 3, within the probe's
    assert _cadence._held(st, 0) is None and _cadence._held_each(st, [0]) == {0: None}
    st.ranks[0].last_step = 1 + 16
    st.ranks[0].folded_step = 0
    assert _cadence._held(st, 0) == "reduce barrier" == _cadence._held_each(st, [0])[0]
    st.cadence.elche.calibrated = True
    assert _budget(st, 0) == 1 + look


def test_a_rank_about_to_run_its_chunk_dry_gets_the_next_before_it_does_never_past_its_budget():
    st = _state(2, 4, total=1000, batch_report_ms=0.0)
    st.cadence.elche.report_timing([10, 20], [2, 2], 0)  # 5 ms a batch on rank 0; budget 11
    _pool(st, 0, 1000)
    st.ranks[0].last_step = 2
    out = []
    assert _async._dispatch_next(st, 0, out)
    (_, (_, off, size)), = _plans(out)  # up to its budget: 9 batches
    assert 2 + size == _budget(st, 0)
    del st.cadence.in_flight[0]  # (ran it dry: a smaller chunk, so that one more fits)
    st.ranks[0].last_step = 4
    out = []
    st.cadence.in_flight[0] = (0, off, 3)
    pool = st.cadence.pools[0]
    st.cadence.last_wait_ms[0] = 6.0
    streams = _async.STREAMS
    streams.top_up(st, 0, 3, out)
    assert not out  # 15 ms still to train: a later report is in time
    streams.top_up(st, 0, 1, out)  # 5 ms left, less than its turnaround: now
    ext = [c.control.extend_partition for c in out if c.control.WhichOneof("cmd") == "extend_partition"]
    assert ext and sum(e.partition_size for e in ext) == _budget(st, 0) - 4 - 1  # the rest of its budget
    assert pool.remaining() == 1000 - size - sum(e.partition_size for e in ext)
    out = []
    st.ranks[0].last_step = 10
    streams.top_up(st, 0, 1, out)
    assert not out  # its chunk ends at its budget: held there until the trigger's Update
    st.ranks[0].last_step = 4
    st.cadence.throttled.add(0)
    streams.top_up(st, 0, 1, out)
    assert not out  # throttled: nothing until the round
