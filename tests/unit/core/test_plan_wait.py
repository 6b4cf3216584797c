"""The ranks' plan wait in the core (``BatchDone.wait_ms``, measured by the rank).

* It reaches the summary (each rank's ``train_s`` and ``wait_s``, the run's
  ``plan_wait_share``) and the journal; a hostile value is not summed.
* It is a window's fixed cost for ElChe (``WindowLedger.fixed_ms``): a coordinator slow
  to turn a round around grows the windows, except in the run's last window.
* A run-ahead chunk outlasts the rank's last turnaround (``_boundary.run_ahead``), and
  one past a late gate doubles what the rank ran ahead so far.
* A rank about to run its window dry is topped up before it does (``_boundary.top_up``):
  the run-ahead goes out as an extension of the chunk it trains.
* The run's final-window plan does not count a held run-ahead chunk as a rank's share
  (``FinalWindowPlan.base``)."""

from __future__ import annotations

import json
import math

import pytest

from flodl.core import BatchDone, from_record, to_record
from flodl.core._translate import timing_event
from flodl.core.cadence._boundary import leaves_the_tail, run_ahead, top_up
from flodl.core.cadence._dispatcher import _take_window, top_up_pace
from flodl.core.cadence._chunk_pool import FinalWindowPlan
from flodl.core.cadence._window import WindowLedger
from flodl.sim import SimConfig, simulate
from flodl.wire import pb

from .cluster import Cluster
from .test_cadence import _pool, _state


def _batch(rank: int, step: int, wait_ms: float, *, batch_ms: float = 4.0) -> BatchDone:
    return BatchDone(now=float(step), rank=rank, batch_ms=batch_ms, data_ms=1.0, step_count=step, loss=1.0,
                     samples=1, epoch=0, offset=step - 1, wait_ms=wait_ms)  # fmt: skip


def test_the_wire_field_reaches_the_event_and_survives_the_journal():
    ev = timing_event(1.0, pb.Timing(rank=2, batch=pb.Timing.Batch(step_count=3, samples=1, wait_ms=12.5)))
    assert isinstance(ev, BatchDone) and ev.wait_ms == 12.5
    assert from_record(json.loads(json.dumps(to_record(ev)))) == ev


def _summary_with_a_wait(wait_ms: float) -> Cluster:
    """A run whose rank 1 tells ``wait_ms`` with its first batch (what its machine holds)."""
    c = Cluster(policy="cadence", world_size=2, total=40, batch_size=4, epochs=1, final_eval=False)
    c.ranks[1].m.wait_ms = wait_ms
    c.join_all()
    res = c.run()
    assert res.ok
    c.summary = json.loads(json.dumps(res.summary, allow_nan=False))  # strict JSON: nothing NaN got in
    return c


def test_the_summary_says_where_each_ranks_time_went():
    c = _summary_with_a_wait(250.0)
    s = c.summary
    assert [r["wait_s"] for r in s["ranks"]] == [0.0, 0.25]
    for r, rank in zip(s["ranks"], c.ranks):  # each batch: its speed and 1 ms of data
        assert r["train_s"] == pytest.approx(len(rank.trained) * (rank.speed_ms + 1.0) / 1e3, abs=1e-3)
    train = sum(r["train_s"] for r in s["ranks"])
    assert s["plan_wait_share"] == pytest.approx(0.25 / (train + 0.25), abs=1e-3)


@pytest.mark.parametrize("hostile", [math.nan, math.inf, -5.0])
def test_a_hostile_wait_is_not_summed(hostile):
    s = _summary_with_a_wait(hostile).summary
    assert [r["wait_s"] for r in s["ranks"]] == [0.0, 0.0] and s["plan_wait_share"] == 0.0


def test_a_wait_is_part_of_the_windows_fixed_cost_and_a_hostile_one_is_not():
    led = WindowLedger(2)
    for w in (0.0, 30.0, math.nan, -4.0, math.inf):
        led.record_batch(0, 10.0, 0.0, w)
    led.record_batch(0, 10.0, 0.0, 20.0)
    assert led.fill_excess_ms(0) == 0.0  # the first batch cost what the others did
    assert led.fixed_ms(0) == 50.0
    assert led.window_report(delivered_capable=True).fill_ms == (50.0, 0.0)
    led.reset_timing()
    assert led.fixed_ms(0) == 0.0


RIG = dict(ms_per_batch=(10, 20, 40), jitter=0.05, batch_size=16, total_samples=6000, epochs=2, policy="cadence")


def test_a_slow_turnaround_grows_the_windows_and_the_summary_shows_the_wait():
    # 20 ms links: every window end costs the slowest rank a 40 ms round trip against
    # a 160 ms window (20 %). The coordinator's clock cannot see it (it starts when a
    # frame is decoded); the rank's wait_ms does, and ElChe grows the windows until
    # the turnaround costs about overhead_target. Fast links: nothing to amortise.
    slow = simulate(SimConfig(**RIG, latency_s=0.02))
    fast = simulate(SimConfig(**RIG, latency_s=0.0005))
    assert slow.finished.ok and fast.finished.ok
    assert fast.summary["elche"]["anchor"] == 4 and fast.summary["plan_wait_share"] < 0.03
    assert slow.summary["elche"]["anchor"] >= 16  # before the wait was fed: 4, as on fast links
    assert slow.summary["plan_wait_share"] > fast.summary["plan_wait_share"]
    for res in (slow, fast):
        for c in res.summary["coverage"]:
            assert (c["trained"], c["duplicates"], c["missing"]) == (6000, 0, 0)


def test_a_run_ahead_chunk_outlasts_the_ranks_last_turnaround():
    def handed(turnaround_ms):
        st = _state(2, 2, total=1000)
        st.cadence.elche.report_timing([10, 20], [2, 2], 0)  # 5 and 10 ms a batch: counts [4, 2]
        _pool(st, 0, 1000)
        st.dispatch.last_dispatched = 0
        st.ranks[0].last_step = 4  # rank 0 ran its window; nothing folded yet
        if turnaround_ms:
            st.cadence.last_wait_ms[0] = turnaround_ms
        assert run_ahead(st, 0, -1.0, [])  # the gate waits for rank 1, for how long is unknown
        return st.cadence.in_flight[0][2]

    assert handed(0.0) == 2  # no turnaround known: a fresh chunk's two (its first report brings more)
    assert handed(12.0) == 3  # 12 ms at 5 ms a batch, and one more
    assert handed(1000.0) == 4  # never past the room: one more window in all


def _paced_pair(**kw):
    """Rank 0 at 5 ms a batch, rank 1 at 10: windows of 4 and 2, the pool of epoch 0 open."""
    st = _state(2, 2, total=1000, **kw)
    st.cadence.elche.report_timing([10, 20], [2, 2], 0)
    _pool(st, 0, 1000)
    st.dispatch.last_dispatched = 0
    return st


def test_a_run_ahead_past_a_late_gate_doubles_what_the_rank_ran_ahead():
    def handed(waiting_ms):
        st = _paced_pair()
        st.cadence.elche.anchor = 16  # a room of 2 x 16 - 7 batches
        st.ranks[0].last_step = 4 + 3  # its window of 4, and 3 batches run ahead already
        assert run_ahead(st, 0, waiting_ms, [])
        return st.cadence.in_flight[0][2]

    assert handed(-1.0) == 3  # the gate is late: as many again, not one batch per turnaround
    assert handed(4.0) == 2  # a wait of known length: what fits in it, and a fresh chunk's two


def test_a_fresh_run_ahead_chunk_is_two_batches():
    # A chunk of one batch ends with its only report: nothing can top it up before the
    # rank runs dry, so each cost a turnaround (the probe window: a batch at a time until
    # the first round). A fresh one goes to an idle rank, which waits for it: two
    # batches, so that its first report brings the next in time, turnaround known or not.
    def handed(turnaround_ms):
        st = _paced_pair()
        st.ranks[0].last_step = 4  # its window of 4 run: at its barrier
        if turnaround_ms:
            st.cadence.last_wait_ms[0] = turnaround_ms
        assert run_ahead(st, 0, 1.0, [])  # a 1 ms wait at 5 ms a batch
        return st.cadence.in_flight[0][2]

    assert handed(0.0) == 2  # no wait seen yet: two all the same
    assert handed(3.0) == 2  # a turnaround shorter than a batch: still two
    assert handed(12.0) == 3  # (12 + 1) // 5 + 1: what fills it


def _extensions(out):
    return [(c.rank, c.control.extend_partition) for c in out if c.control.WhichOneof("cmd") == "extend_partition"]


def test_a_rank_about_to_run_its_window_dry_is_topped_up_before_it_does():
    st = _paced_pair(batch_report_ms=0.0)
    (off, size), = _take_window(st, 0, 0, 4)  # its window, in flight
    pool = st.cadence.pools[0]
    pool.mark_completed(0, 2)
    st.ranks[0].last_step = 2
    st.cadence.last_wait_ms[0] = 4.0  # its turnaround: a report and a plan back take 4 ms
    out = []
    # 10 ms still to train: its next report (a batch on: reports are per batch here) is in time
    assert not top_up(st, 0, 2, out) and not out
    pool.mark_completed(0, 1)
    st.ranks[0].last_step = 3
    assert top_up(st, 0, 1, out)  # 5 ms left, no more than a batch and a turnaround: now
    (rank, ext), = _extensions(out)
    assert rank == 0 and ext.epoch == 0 and ext.partition_offset == off + size  # its span, on
    assert st.cadence.in_flight[0] == (0, ext.partition_offset, ext.partition_size)
    assert pool.in_flight(0) == 1 + ext.partition_size  # the pool holds both for it
    assert not top_up(st, 0, 1 + ext.partition_size, [])  # once: what it holds now outlasts a report and a turnaround


def test_a_chunk_ending_inside_its_window_is_followed_by_the_windows_next_before_the_rank_runs_dry():
    st = _paced_pair(batch_report_ms=0.0)
    (off, size), = _take_window(st, 0, 0, 2)  # half its window of 4, in flight
    pool = st.cadence.pools[0]
    st.cadence.last_wait_ms[0] = 4.0
    out = []
    assert not top_up(st, 0, 2, out) and not out  # 10 ms still to train: a later report is in time
    pool.mark_completed(0, 1)
    st.ranks[0].last_step = 1
    assert top_up(st, 0, 1, out)  # its last batch: the report it ends with would be too late
    (rank, ext), = _extensions(out)
    assert rank == 0 and ext.partition_offset == off + size and ext.partition_size == 2  # the window's rest
    assert st.ranks[0].last_step + 1 + ext.partition_size == 4  # never past its window: that is run-ahead's
    st.cadence.throttled.add(0)
    assert not top_up(st, 0, 1, [])  # throttled: it waits for the round


def test_the_windows_next_chunk_is_no_run_ahead_and_an_older_epochs_holes_go_first():
    def half_window_run(**kw):
        st = _paced_pair(batch_report_ms=0.0, **kw)
        _take_window(st, 0, 0, 2)  # half its window of 4
        st.cadence.pools[0].mark_completed(0, 1)
        st.ranks[0].last_step = 1
        st.cadence.last_wait_ms[0] = 6.0
        return st

    assert top_up(half_window_run(run_ahead=False), 0, 1, [])  # inside its window: not run-ahead's switch
    st = half_window_run()
    _pool(st, 1, 1000)  # the rank trains epoch 1 ...
    st.cadence.in_flight[0] = (1, 0, 2)
    st.dispatch.rank_epoch[0] = 1
    assert st.cadence.pools[0].remaining() > 0  # ... while epoch 0 still has work (a dead rank's holes)
    out = []
    assert not top_up(st, 0, 1, out) and not out  # an idle rank draws from epoch 0 first: a plain take


def test_no_run_ahead_top_up_when_it_is_off_or_throttled_and_a_short_one_when_the_trigger_comes_first():
    def rank_0_holding(batches, unreported, **kw):
        st = _paced_pair(batch_report_ms=0.0, **kw)
        _take_window(st, 0, 0, batches)
        st.cadence.pools[0].mark_completed(0, batches - unreported)
        st.ranks[0].last_step = batches - unreported
        st.cadence.last_wait_ms[0] = 6.0
        return st

    assert top_up(rank_0_holding(4, 1), 0, 1, [])  # (the case that tops up)
    assert not top_up(rank_0_holding(4, 1, run_ahead=False), 0, 1, [])
    st = rank_0_holding(4, 1)
    st.cadence.throttled.add(0)
    assert not top_up(st, 0, 1, [])  # throttled: it waits for the round
    st = rank_0_holding(4, 1)
    st.now = st.rounds.opened_at + 0.017  # the window's wall (2 x 10 ms) ends in 3 ms
    # The trigger is due before its last batch ends -- by the window's intended wall. A
    # trigger later than that (a slower rank's window) found it dry: a turnaround idle at
    # every window's end (a simulated 1,1,2,3,5,8 rig at 5 ms links: 0.898 -> 0.908). So
    # it gets what covers its turnaround (6 ms at 5 ms a batch: 2 batches), no more.
    out = []
    assert top_up(st, 0, 1, out)
    assert [e.partition_size for _, e in _extensions(out)] == [2]


def test_a_run_ahead_chunk_held_at_the_pin_is_not_the_ranks_share():
    st = _state(2, 2, total=1000)
    st.cadence.final_plan = FinalWindowPlan(0, alloc=(3, 2), pinned_counts=(4, 2), pinned_alive=(True, True),
                                            base=(5, 0))  # fmt: skip
    st.cadence.in_flight[1] = (0, 0, 1)  # someone still trains: the tail is theirs to leave
    st.dispatch.rank_epoch[0] = 0
    st.ranks[0].last_step = 7  # 7 steps since the trigger, 5 of them from what it held at the pin
    assert not leaves_the_tail(st, 0)  # 2 of its 3: it asks for its last one
    st.ranks[0].last_step = 8
    assert leaves_the_tail(st, 0)
    plain = FinalWindowPlan(0, alloc=(3, 2), pinned_counts=(4, 2), pinned_alive=(True, True))
    assert plain.share_steps(0, 7) == 7  # a plan without a base counts every step, as before


def test_a_top_up_past_a_late_gate_never_doubles_untrained_work():
    # Found in review: the doubling counted the extensions the rank still held, so each
    # top-up of a late gate's wait doubled the last before any of it was trained, and
    # the rank held its whole room of one more window two batches past its window end.
    st = _paced_pair()  # batch_report_ms 25 (the default); rank 0 at 5 ms a batch, a window of 4
    st.cadence.elche.anchor = 16  # a room of 2 x 16 batches
    _take_window(st, 0, 0, 4)
    pool = st.cadence.pools[0]
    st.cadence.last_wait_ms[0] = 6.0
    st.now = st.rounds.opened_at + 1.0  # the gate is past its window's wall: a wait of unknown length
    fits = (0 + 6) // 5 + 1  # what outlasts its turnaround at its pace
    held, sent = 4, []
    for step in range(1, 25):
        pool.mark_completed(0, 1)
        st.ranks[0].last_step, held = step, held - 1
        out = []
        if top_up(st, 0, held, out):
            (_, ext), = _extensions(out)
            assert held * 5 <= 25 + 6  # only once what it holds lasts no longer than a report and a turnaround
            room = 2 * 16 - step - held
            assert ext.partition_size == min(max(fits, step - 4), room)  # as much again as it *trained* past its window
            sent.append((step, ext.partition_size))
            held += ext.partition_size
        assert pool.in_flight(0) == held
    assert sent[:4] == [(s, fits) for s in (1, 2, 3, 4)], sent  # up to its window end: what outlasts a turnaround
    assert 4 + sum(n for _, n in sent) <= 2 * 16  # never past the room


def test_under_cadence_a_chunks_last_batch_is_due_when_a_batch_outlasts_a_report():
    # A batch longer than a report is a report of its own: the next report comes a batch
    # on, so a chunk's last batch is the last chance to send more before the rank runs
    # dry. Held to the report's length instead, a rank whose batch outlasted a report and
    # a turnaround (most ranks of a paced 1,024-rank run: 100-400 ms batches, 40 ms
    # turnarounds) was never topped up, and idled a turnaround at every chunk's end. Only
    # where a turnaround is no shorter than a report: a loaded coordinator.
    from .test_async import _state as _async_state

    def rank_0_on_its_last_batch(st, epoch=0):
        st.cadence.elche.report_timing([10, 20], [2, 2], 0)  # 5 and 10 ms a batch: counts [4, 2]
        _pool(st, epoch, 1000)
        st.dispatch.last_dispatched = epoch
        _take_window(st, 0, epoch, 4)  # its window, in flight
        st.cadence.pools[epoch].mark_completed(0, 3)
        st.ranks[0].last_step = 3  # one batch (5 ms) left: longer than a report (2 ms) and a turnaround (2 ms)
        st.cadence.last_wait_ms[0] = 2.0
        return st

    out = []
    assert top_up(rank_0_on_its_last_batch(_state(2, 2, total=1000, batch_report_ms=2.0)), 0, 1, out)
    assert [(r, e.epoch) for r, e in _extensions(out)] == [(0, 0)]  # run ahead, before it runs dry
    # Two batches left: its next report (one batch on) is still in time.
    st = rank_0_on_its_last_batch(_state(2, 2, total=1000, batch_report_ms=2.0))
    st.ranks[0].last_step = 2
    assert not top_up(st, 0, 2, [])
    # Not in the run's last epoch: a slow rank topped up there ran ahead into what the last
    # window's plan counts as its own, and trained it alone at the end.
    assert not top_up(rank_0_on_its_last_batch(_state(2, 2, total=1000, batch_report_ms=2.0), 1), 0, 1, [])
    # Async keeps its own rule: a batch early is a share of its last pool taken early
    # (test_sim_async_run_end).
    assert not top_up_pace(rank_0_on_its_last_batch(_async_state(2, 2, total=1000, batch_report_ms=2.0)), 0, 1)
    # A turnaround shorter than a report (a coordinator that keeps up) costs less than
    # holding a batch more a batch early: held to the report and a turnaround, as before.
    st = rank_0_on_its_last_batch(_state(2, 2, total=1000, batch_report_ms=2.0))
    st.cadence.last_wait_ms[0] = 1.0
    assert not top_up_pace(st, 0, 1)
    # A batch shorter than a report: the same (27 ms: 1 batch of 5 ms is due, 6 are not).
    st = rank_0_on_its_last_batch(_state(2, 2, total=1000, batch_report_ms=25.0))
    assert top_up_pace(st, 0, 1) == 5.0 and not top_up_pace(st, 0, 6)


def test_a_stretched_report_interval_runs_ranks_ahead_only_where_they_may():
    """Many ranks stretch the report interval (``batch_reports_per_s``): a barrier-paced
    rank is topped up that much earlier, but under Async and in the run's last epoch the
    rule keeps ``batch_report_ms`` (a slow rank topped up there ran ahead into the end)."""
    from .test_async import _state as _async_state

    def rank_0_with_left(st, left, epoch=0):
        st.cadence.elche.report_timing([10, 20], [2, 2], 0)  # 5 ms a batch
        _pool(st, epoch, 1000)
        st.dispatch.last_dispatched = epoch
        _take_window(st, 0, epoch, 4)
        st.cadence.pools[epoch].mark_completed(0, 4 - left)
        st.ranks[0].last_step = 4 - left
        st.cadence.last_wait_ms[0] = 2.0
        return st

    stretched = dict(total=1000, batch_report_ms=2.0, batch_reports_per_s=100.0)  # 2 ranks: 20 ms
    assert _state(2, 2, **stretched).config.report_interval_ms == 20.0
    # Three batches (15 ms) left fit in a stretched report and a turnaround: due now ...
    assert top_up_pace(rank_0_with_left(_state(2, 2, **stretched), 3), 0, 3) == 5.0
    assert not top_up_pace(rank_0_with_left(_state(2, 2, total=1000, batch_report_ms=2.0), 3), 0, 3)  # (unstretched)
    # ... but not in the run's last epoch, nor under Async, even at the last batch.
    assert not top_up_pace(rank_0_with_left(_state(2, 2, **stretched), 1, epoch=1), 0, 1)
    assert not top_up_pace(rank_0_with_left(_async_state(2, 2, **stretched), 1), 0, 1)
