"""Cadence (ElChe) in the core: gate, progressive dispatch, finish feedback, deaths.

Scenario numbers are the coordinator halves of reference/coordinator-behaviour.md §12,
adapted to our names: ``BatchDone`` for Batch frames, ``ChunkDone`` for MetricsMsg,
``SyncAcked`` for SyncAck, a hand-built TRAINING state instead of the Rust "headless"
coordinator, and a ``SendFailed`` event where the original saw a failed send.
"""

import copy

import pytest

from flodl.core import (
    BatchDone,
    CoreConfig,
    Notice,
    OpenRound,
    Send,
    SendFailed,
    SyncAcked,
    initial_state,
    replay,
)
from flodl.core import view_drift
from flodl.core.cadence import _feedback, _slack, _views
from flodl.core.cadence._boundary import BOUNDARY_STREAMS, CADENCE, leaves_the_tail
from flodl.core.cadence._dispatcher import (
    _dispatch_next,
    cadence_gate,
    chunk_batches,
    start_window,
    window_steps,
)
from flodl.core.cadence._chunk_pool import ChunkPool
from flodl.core.cadence._views import rearm
from flodl.core._coverage import open_epoch
from flodl.core import ACTIVE, DEAD, IDLE, PENDING, TRAINING
from flodl.wire import pb

from .cluster import Cluster, controls, window_plan

EXACT = {"expected": 100, "trained": 100, "duplicates": 0, "missing": 0}


def _state(ws, anchor, *, total=100, bs=1, epochs=2, **kw):
    """A formed, training cadence coordinator with no epoch dispatched (NoGuard)."""
    kw.setdefault("guard", "none")
    cfg = CoreConfig(world_size=ws, policy="cadence", anchor=anchor, batch_size=bs, num_epochs=epochs,
                     total_samples=total, **kw)  # fmt: skip
    st = initial_state(cfg)
    for rec in st.ranks:
        rec.phase, rec.route = ACTIVE, (b"r%d" % rec.rank,)
    st.run.phase = TRAINING
    return st


def _steps(st, steps):
    for r, s in enumerate(steps):
        st.ranks[r].last_step = s


def _pool(st, epoch, total, *, equal=True):
    """A pool for ``epoch``: equal spans (the spec's ``ChunkPool::new``) or, with
    ``equal=False``, the spans the dispatcher itself would lay out from the counts."""
    pool = ChunkPool(epoch, total, st.config.world_size) if equal else CADENCE._new_pool(st, epoch, total)
    st.cadence.pools[epoch] = pool
    open_epoch(st.coverage, epoch, total)
    for r in range(st.config.world_size):
        st.dispatch.rank_epoch[r] = epoch


def _cluster(**kw):
    kw.setdefault("policy", "cadence")
    kw.setdefault("probe_batches", None)  # the reference's scenarios: the first window is the anchor
    kw.setdefault("run_ahead", False)  # ... and a rank waits at its reduce barrier
    return Cluster(**kw)


def _drain(c, *ranks):
    for r in ranks:
        while c.deliver_one(r):
            pass


def _plan(ctl):
    p = ctl.start_epoch.plan if ctl.HasField("start_epoch") else ctl.update.next_plan
    return (p.epoch, p.partition_offset, p.partition_size)


# -- A. the gate ----------------------------------------------------------------------------


def test_gate_blocked_while_a_round_is_pending():
    # Scenario 5.
    st = _state(2, 2)
    st.cadence.elche.report_timing([10, 20], [2, 2], 0)
    assert st.cadence.elche.batch_counts == [4, 2]
    _steps(st, [4, 2])
    st.rounds.phase = PENDING
    assert cadence_gate(st) == (False, "round 0 pending")
    st.rounds.phase = IDLE
    assert cadence_gate(st)[0] is True


def test_gate_rearms_without_looking_at_acks():
    # Scenario 6: counts are the gate; the last round's acks are not.
    st = _state(2, 2)
    st.cadence.elche.report_timing([10, 20], [2, 2], 0)
    _steps(st, [4, 2])
    st.rounds.acked = {}
    assert cadence_gate(st)[0] is True


def test_gate_counts_not_time():
    # Scenario 7: two 1 ms windows reach counts [2, 2] -> fire.
    st = _state(2, 2)
    st.cadence.elche.report_timing([10000, 10000], [1, 1], 0)
    assert st.cadence.elche.batch_counts == [2, 2]
    _steps(st, [2, 2])
    for r in (0, 1):
        for _ in range(2):
            st.cadence.ledger.record_batch(r, 0.5, 0.0)
    assert cadence_gate(st)[0] is True


def test_gate_below_counts_never_fires_however_long():
    # Scenario 8: counts [8, 4], steps [7, 3], a huge wall: still no.
    st = _state(2, 4)
    st.cadence.elche.report_timing([10, 20], [2, 2], 0)
    assert st.cadence.elche.batch_counts == [8, 4]
    _pool(st, 0, 100)
    st.cadence.in_flight = {0: (0, 0, 8), 1: (0, 50, 4)}
    _steps(st, [7, 3])
    st.cadence.ledger.record_batch(0, 1e9, 0.0)
    assert cadence_gate(st) == (False, "rank 0 ran 7/8 batches of its window and has work left")


def test_gate_quiesced_zero_step_tail_rank_does_not_block():
    # Scenario 9: counts [20, 4, 4]; rank 2 has nothing to do and nothing left.
    st = _state(3, 4)
    st.cadence.elche.report_timing([200, 1000, 1000], [4, 4, 4], 10)
    assert st.cadence.elche.batch_counts == [20, 4, 4]
    _pool(st, 0, 0)
    _steps(st, [20, 4, 0])
    assert cadence_gate(st)[0] is True
    st.cadence.pools[0] = ChunkPool(0, 1000, 3)
    rearm(st)  # what refills a pool says so (a dispatch, a death, a refused window): the gate looks again
    assert cadence_gate(st) == (False, "rank 2 ran 0/4 batches of its window and has work left")


def test_gate_names_a_rank_parked_at_the_tail_as_waiting_not_training():
    # The gate waits for a rank that ran its final-window share and was parked (the tail
    # left to a rank still training): the status then says it waits on that, rather than
    # reading as a rank that is slow (a 115 s end-of-run stall read "rank 3 ran 23/29").
    st = _state(2, 4)
    st.cadence.elche.report_timing([10, 20], [2, 2], 0)
    _pool(st, 0, 100)
    st.cadence.in_flight = {1: (0, 50, 4)}
    _steps(st, [7, 3])
    st.cadence.parked.add(0)
    ok, why = cadence_gate(st)
    assert not ok and why == ("rank 0 ran 7/8 batches of its window and has work left "
                              "(parked: the last window's tail is left to the 1 rank(s) training)")  # fmt: skip


def test_gate_missing_pool_is_not_quiesced_and_idle_window_never_fires():
    st = _state(2, 4)
    _steps(st, [4, 0])
    assert cadence_gate(st)[0] is False  # rank 1: no pool, not quiesced
    _pool(st, 0, 0)
    _steps(st, [0, 0])
    assert cadence_gate(st) == (False, "no rank has stepped since the last average")  # scenario 10


def test_throttle_once_when_a_rank_runs_ahead_then_released_by_the_update():
    # Scenario 12 (Async/CPU there; the same rule under Cadence): max_batch_diff 2,
    # steps [4, 1] -> one Throttle to rank 0; its 5th batch sends nothing more; the mark
    # clears when the round finishes, and the throttled rank counts as at the barrier.
    c = _cluster(world_size=2, total=100, batch_size=1, epochs=1, anchor=8, max_batch_diff=2, guard="none")
    c.join_all()
    _drain(c, 0, 1)
    c.train_one(1)
    for _ in range(5):
        c.train_one(0)
    throttles = c.sends("throttle")
    assert [s.rank for s in throttles] == [0]
    assert c.state.cadence.throttled == {0}
    assert c.state.rounds.gate_reason.startswith("rank 1 ran 1/8")
    for _ in range(7):
        c.train_one(1)
    assert len(c.sends("request_params")) == 2  # rank 0 throttled at 5/8 does not block
    _drain(c, 0, 1)
    assert c.state.rounds.phase is IDLE and c.state.cadence.throttled == set()
    assert "update" in c.out(0)
    res = c.run()
    assert [{k: e[k] for k in EXACT} for e in res.summary["coverage"]] == [EXACT]


def test_no_throttle_once_a_rank_is_gone():
    # Scenario 12, second half: with a rank dead the spread rule is off.
    c = _cluster(world_size=3, total=99, batch_size=1, epochs=1, anchor=8, max_batch_diff=2, guard="none")
    c.join_all()
    c.kill(2)
    _drain(c, 0, 1)
    c.train_one(1)
    for _ in range(5):
        c.train_one(0)
    assert c.sends("throttle") == []


# -- E. progressive dispatch ----------------------------------------------------------------


def _cold_start():
    c = _cluster(world_size=2, total=100, batch_size=1, epochs=2, anchor=4, guard="none", speeds=[10, 20],
                 defer_acks=True)  # fmt: skip
    c.join_all()
    return c


def test_progressive_cold_start_sends_one_window_each():
    # Scenario 42 (we send no StageAdvisory: the rank's stager is not wired yet).
    c = _cold_start()
    assert c.out(0) == ["start_epoch"]  # carrying the role
    assert c.out(1) == ["start_epoch"]
    assert c.roles_told(0) == c.roles_told(1) == [0]
    assert _plan(c.ranks[0].received[-1]) == (0, 0, 4)
    assert _plan(c.ranks[1].received[-1]) == (0, 50, 4)
    assert c.state.dispatch.rank_epoch == {0: 0, 1: 0}
    assert c.state.cadence.in_flight == {0: (0, 0, 4), 1: (0, 50, 4)}


def test_first_reduce_hands_out_the_next_windows_at_the_trigger_then_recalibrates():
    # Scenario 43, overlapped: the next windows go out with the RequestParams (sized by the
    # counts in force, [4, 4]); the delivered feed [11, 21] ms (batch + data) makes the
    # counts [8, 4] at the finish, and rank 0 streams the rest of its longer window.
    c = _cold_start()
    _drain(c, 0, 1)
    for _ in range(4):
        c.train_one(0)
        c.train_one(1)
    # Each window rides in its rank's RequestParams (its one command of the step: protocol 1.2).
    assert [(s.rank, s.kind) for s in c.sends()][-2:] == [(0, "request_params"), (1, "request_params")]
    assert [window_plan(s.control) for s in c.sends() if window_plan(s.control)] == [
        ("start_epoch", (0, 0, 4)), ("start_epoch", (0, 50, 4)), ("next_plan", (0, 4, 4)), ("next_plan", (0, 54, 4)),
    ]  # fmt: skip
    assert c.sends("throttle") == []  # progressive: no hard barrier
    assert c.state.rounds.phase is PENDING
    assert c.state.cadence.in_flight == {0: (0, 4, 4), 1: (0, 54, 4)}
    _drain(c, 0, 1)
    c.send_ack(0)
    cmds = c.feed(SyncAcked(now=c.now, rank=1, cycle=1, step_count=4, divergence=0.01))
    c.ranks[1].ack_due = None
    assert c.state.cadence.elche.batch_counts == [8, 4]
    upd = controls(cmds, "update")
    assert [(r, u.update.version, u.update.HasField("next_plan")) for r, u in upd] == [(0, 1, False), (1, 1, False)]
    assert [(r, u.update.global_step) for r, u in upd] == [(0, 8), (1, 8)]
    kinds = [x.kind for x in cmds if isinstance(x, Send)]
    assert kinds == ["update", "update"]
    window = [x for x in cmds if isinstance(x, Notice) and x.kind == "window"]
    assert len(window) == 1 and window[0].data["counts"] == [8, 4] and window[0].data["verdict"] == "Stable"
    _drain(c, 0, 1)
    sent = len(c.sends())
    for _ in range(4):
        c.train_one(0)
    # 8 - 4 already run, sent with its last batch (a batch is a report here: the next
    # would come when it had run dry), as an extension of the chunk it trains.
    (ext,) = c.sends()[sent:]
    assert ext.kind == "extend_partition" and ext.rank == 0
    assert (ext.control.extend_partition.partition_offset, ext.control.extend_partition.partition_size) == (8, 4)
    assert window_steps(c.state, 0) == 4 and c.state.cadence.in_flight[0] == (0, 8, 4)


def _until_trigger(c, order):
    """Deliver, report and train round-robin (acks deferred) until a round opens."""
    cycle = c.state.rounds.cycle
    while c.state.rounds.cycle == cycle:
        for r in order:
            while c.deliver_one(r):
                pass
            c.send_ack(r)
            c.send_chunk(r)
            c.train_one(r)
            if c.state.rounds.cycle != cycle:
                return


def test_steps_after_the_snapshot_are_the_next_window_and_the_next_round_folds_them():
    c = _cluster(world_size=2, total=100, batch_size=1, epochs=1, anchor=4, guard="none", speeds=[10, 10],
                 defer_acks=True)  # fmt: skip
    c.join_all()
    _until_trigger(c, [0, 1])
    st = c.state
    assert st.rounds.cycle == 1 and st.ranks[0].last_step == 4
    _drain(c, 0, 1)  # StartEpoch, then RequestParams: the snapshot is taken at step 4
    assert c.ranks[0].ack_due == (1, 4) and c.ranks[0].work
    for _ in range(4):  # rank 0 runs its whole next window while the round is open
        c.train_one(0)
    assert window_steps(st, 0) == 4 and 0 not in st.cadence.in_flight
    assert st.rounds.gate_reason == "round 1 pending"
    n_plans = len(c.sends("start_epoch"))
    c.send_ack(0)
    c.send_ack(1)
    assert st.rounds.phase is IDLE and st.ranks[0].folded_step == 4
    # The reduce barrier holds rank 0 through the finish: no next_plan, no StartEpoch.
    assert not any(u.control.update.HasField("next_plan") for u in c.sends("update"))
    assert len(c.sends("start_epoch")) == n_plans and 0 not in st.cadence.in_flight
    ec = st.coverage.epochs[0]
    trained_after = [(off, n) for _e, off, n, step in c.ranks[0].trained if step > 4]
    assert len(trained_after) == 4
    assert all(ec.committed[off] == 0 for off, _ in trained_after)  # not folded by round 1
    for _ in range(4):
        c.train_one(1)
    assert st.rounds.cycle == 2  # rank 1 ran its window: round 2 folds rank 0's steps 5-8
    _drain(c, 0, 1)
    c.send_ack(0)
    c.send_ack(1)
    assert st.ranks[0].folded_step == 8
    assert all(ec.committed[off] == 1 for off, _ in trained_after)
    res = c.run()
    assert res.ok and [{k: e[k] for k in EXACT} for e in res.summary["coverage"]] == [EXACT]


def test_a_batch_between_the_trigger_and_the_snapshot_is_paced_next_and_folded_now():
    # A plan sent before the RequestParams wakes an idle rank before it reads them: it may
    # train a batch first. That batch is folded by this round (step <= the ack) but counts
    # in the next window, so the window handed out at the trigger still ends it, exactly.
    # (A lone window rides in the RequestParams since protocol 1.2; a plan that is not
    # alone still goes before it, as the epoch role's does: the frames are split here.)
    c = _cluster(world_size=2, total=100, batch_size=1, epochs=1, anchor=4, guard="none", speeds=[10, 10],
                 defer_acks=True)  # fmt: skip
    c.join_all()
    _until_trigger(c, [0, 1])
    st = c.state
    rp = c.ranks[0].inbox[0]
    how, (epoch, off, size) = window_plan(rp)
    assert how == "next_plan"
    plan = pb.Control(command_id=rp.command_id)
    plan.start_epoch.plan.epoch, plan.start_epoch.plan.partition_offset, plan.start_epoch.plan.partition_size = (
        epoch, off, size)
    rp.request_params.ClearField("next_plan")
    c.ranks[0].inbox.appendleft(plan)
    c.deliver_one(0)  # the plan only
    c.train_one(0)
    _drain(c, 0, 1)  # now the RequestParams: snapshot at step 5
    assert c.ranks[0].ack_due == (1, 5) and window_steps(st, 0) == 1
    c.send_ack(0)
    c.send_ack(1)
    assert st.ranks[0].folded_step == 5 and st.coverage.epochs[0].committed[4] == 1
    plans = len(c.sends("start_epoch"))
    for _ in range(3):
        c.train_one(0)
    assert window_steps(st, 0) == 4 and 0 not in st.cadence.in_flight
    assert len(c.sends("start_epoch")) == plans  # at the reduce barrier: no 1-batch top-up


@pytest.mark.parametrize("acked", [False, True])
def test_death_with_a_chunk_from_the_trigger_in_flight_exact_coverage(acked):
    # run_ahead off: every rank waits at its barrier, so each gets its window at the trigger.
    c = CheckedCluster(world_size=3, total=100, batch_size=2, epochs=2, policy="cadence", anchor=2,
                       speeds=[10, 20, 40], defer_acks=True, probe_batches=None, run_ahead=False)  # fmt: skip
    c.join_all()
    st = c.state
    for _ in range(3):  # calibrated by then
        _until_trigger(c, [0, 1, 2])
        if st.rounds.cycle < 3:
            for r in range(3):
                while c.deliver_one(r):
                    pass
                c.send_ack(r)
    assert st.rounds.phase is PENDING and st.rounds.cycle == 3 and st.cadence.elche.batch_counts == [7, 4, 2]
    # Each got its window at the trigger: in its RequestParams (protocol 1.2), or just before them.
    assert all(window_plan(c.ranks[r].inbox[0]) for r in range(3))
    while c.deliver_one(2):
        pass
    snap = c.ranks[2].ack_due[1]
    chunk = st.cadence.in_flight[2]  # handed out with this round's RequestParams
    if acked:
        c.send_ack(2)
    c.train_one(2)
    assert c.ranks[2].trained[-1][3] == snap + 1 and c.ranks[2].trained[-1][1] == chunk[1]
    pending = sum(n for _e, _o, n, step in c.ranks[2].trained if step > st.ranks[2].folded_step)
    assert pending > 0
    c.kill(2)
    res = c.run()
    assert res.ok
    cov = res.summary["coverage"]
    assert [(e["expected"], e["trained"], e["duplicates"], e["missing"]) for e in cov] == [(100, 100, 0, 0)] * 2
    assert res.summary["discarded_samples"] == pending
    trained = {}
    for r in c.ranks[:2]:
        for e, off, n, _ in r.trained:
            for p in range(off, off + n):
                trained[(e, p)] = trained.get((e, p), 0) + 1
    assert all(v == 1 for v in trained.values())  # survivors never repeat a position
    record = []
    assert replay(c.config, c.journal, record=record) == c.state and record == c.commands


def test_send_failure_at_kickoff_returns_the_chunk_to_the_pool():
    # Scenario 44 (a failed send is a SendFailed event here, and the rank is lost).
    c = _cold_start()
    c.feed(SendFailed(now=c.now, rank=1, what="start_epoch"))
    pool = c.state.cadence.pools[0]
    assert c.state.ranks[1].phase is DEAD
    assert pool.reclaimed() == ((50, 4),) and pool.remaining() == 96
    assert not pool.is_epoch_done()
    c.ranks[1].alive = False
    res = c.run()
    assert res.ok and [{k: e[k] for k in EXACT} for e in res.summary["coverage"]] == [EXACT] * 2


def test_fold_mid_epoch():
    # Scenario 45: counts [20, 10], pool 1000 -> {0, 0, 20} and {0, 500, 10}.
    st = _state(2, 10, total=1000)
    st.cadence.elche.report_timing([500, 1000], [10, 10], 10)
    assert st.cadence.elche.batch_counts == [20, 10]
    _pool(st, 0, 1000)
    assert start_window(st, 0, [0, 1]) == {0: (0, 20), 1: (500, 10)}
    assert st.dispatch.assigned[0] == {0: [(0, 20)], 1: [(500, 10)]}
    st.cadence.pools[0] = ChunkPool(0, 0, 2)
    assert start_window(st, 0, [0, 1]) == {}
    assert start_window(st, 7, [0, 1]) == {}  # an epoch without a pool


def test_tail_is_shared_by_the_final_window_plan():
    # Scenario 46 (Async caps the tail by share; under Cadence the pinned final-window
    # plan splits the run's last 59 batches by counts [50, 10]: no lone 1, sum exact).
    st = _state(2, 10, total=59, epochs=1)
    for _ in range(5):
        st.cadence.elche.report_timing([200, 1000], [10, 10], 10)
    assert st.cadence.elche.batch_counts == [50, 10]
    _pool(st, 0, 59, equal=False)  # spans [50, 9]
    taken = start_window(st, 0, [0, 1])
    assert st.cadence.final_plan.alloc == (49, 10)
    assert [chunk_batches(st, r, 0) for r in (0, 1)] == [49, 10]  # sized before any take
    # A take never runs past the rank's own span while it has a residue: rank 1 gets its
    # 9 now and streams the last batch when it has run them (still inside its window).
    assert taken == {0: (0, 49), 1: (50, 9)}
    assert st.cadence.pools[0].remaining() == 1


def test_cadence_final_window_has_no_lone_one():
    # Scenario 47, in the run's last epoch: counts [45, 10, 9]; pool 63 -> [44, 10, 9].
    st = _state(3, 10, total=63, epochs=1)
    for _ in range(5):
        st.cadence.elche.report_timing([200, 900, 1000], [10, 10, 10], 10)
    assert st.cadence.elche.batch_counts == [45, 10, 9]
    _pool(st, 0, 63)
    sizes = [chunk_batches(st, r, 0) for r in range(3)]  # unpinned: the edge schedule
    assert sizes == [45, 10, 9]
    taken = start_window(st, 0, [0, 1, 2])
    assert st.cadence.final_plan.alloc == (44, 10, 9)  # sum 63, no lone 1, rank 0 largest
    assert [taken[r][1] for r in range(3)] == [21, 10, 9]  # equal spans of 21: rank 0 short
    assert [chunk_batches(st, r, 0) for r in range(3)] == [44, 10, 9]  # the pinned sizes


def test_in_the_last_window_a_rank_that_ran_its_share_leaves_the_rest_to_one_still_training():
    st = _state(3, 10, total=63, epochs=1)
    for _ in range(5):
        st.cadence.elche.report_timing([200, 900, 1000], [10, 10, 10], 10)
    _pool(st, 0, 63)
    st.dispatch.last_dispatched = 0
    taken = start_window(st, 0, [0, 1, 2])  # plan [44, 10, 9]; rank 0 got its span's 21
    assert st.cadence.final_plan.alloc == (44, 10, 9) and taken[0][1] == 21
    # Rank 2 ran its 9: a fragment is left, but rank 0 is still training and asks again.
    _steps(st, [0, 0, 9])
    del st.cadence.in_flight[2]
    assert leaves_the_tail(st, 2)
    out = []
    BOUNDARY_STREAMS.wake(st, out)
    assert out == [] and 2 not in st.cadence.in_flight
    # Rank 0 asks for the rest of its share (44 - 21), not for a whole window.
    _steps(st, [21, 0, 9])
    del st.cadence.in_flight[0]
    assert chunk_batches(st, 0, 0) == 23
    # A throttled rank is not training: it cannot be the one the tail is left to.
    st.cadence.in_flight[0] = (0, 0, 1)
    st.cadence.throttled.add(0)
    _steps(st, [21, 10, 9])
    del st.cadence.in_flight[1]
    assert not leaves_the_tail(st, 1) and not leaves_the_tail(st, 2)
    BOUNDARY_STREAMS.wake(st, out)
    assert out == [] and cadence_gate(st)[0]  # both at their reduce barrier, rank 0 throttled: the round fires


def test_an_epoch_that_is_not_the_last_has_no_final_window_plan():
    # Its last window runs on into the next epoch (``_boundary``): no rank is cut short to
    # end with the epoch; each takes its window's worth and streams the rest later.
    st = _state(3, 10, total=63, epochs=2)
    for _ in range(5):
        st.cadence.elche.report_timing([200, 900, 1000], [10, 10, 10], 10)
    _pool(st, 0, 63)
    taken = start_window(st, 0, [0, 1, 2])
    assert st.cadence.final_plan is None
    assert [taken[r][1] for r in range(3)] == [21, 10, 9]  # rank 0: its span; it streams on later
    assert st.cadence.pools[0].remaining() == 63 - 40


def test_streamed_chunk_never_crosses_the_reduce():
    st = _state(2, 4, total=100)
    st.cadence.elche.report_timing([10, 20], [2, 2], 0)  # counts [8, 4]
    _pool(st, 0, 100)
    _steps(st, [3, 0])
    assert window_steps(st, 0) == 3
    assert chunk_batches(st, 0, 0) == 8  # the window, before the streaming cap
    out = []
    assert _dispatch_next(st, 0, out)
    assert _plan(out[0].control) == (0, 0, 5)  # 8 - 3 already run this window


# -- whole runs in the Cluster ----------------------------------------------------------------


class CheckedCluster(Cluster):
    """A Cluster that checks cadence's dispatch invariants after every event."""

    def feed(self, ev):
        cmds = super().feed(ev)
        cad = self.state.cadence
        for pool in cad.pools.values():
            for r in range(self.config.world_size):
                # A window in flight, or two: a trigger's window queued behind the
                # run-ahead chunk the rank still trains (``_dispatcher._ahead``); a
                # window may be several ranges (``_dispatcher._take_window``).
                window = max(cad.elche.batch_counts[r], cad.elche.anchor) * self.config.batch_size
                assert pool.in_flight(r) <= 2 * window, "more than two windows in flight"
        for r, (epoch, _off, _n) in cad.in_flight.items():
            assert cad.pools[epoch].in_flight(r) > 0
        return cmds

    def run(self, *a, **kw):
        res = super().run(*a, **kw)
        # A healthy run warns nowhere: e.g. a second plan queued at a rank (hazard 11).
        assert not [w for r in self.ranks for w in r.warnings], [r.warnings for r in self.ranks]
        return res


def test_three_unequal_ranks_exact_coverage_and_elche_summary():
    c = CheckedCluster(world_size=3, total=100, batch_size=4, epochs=3, policy="cadence", anchor=2,
                       speeds=[10, 20, 40])  # fmt: skip
    c.join_all()
    res = c.run()
    assert res.ok and res.reason == "completed"
    s = res.summary
    assert [{k: e[k] for k in EXACT} for e in s["coverage"]] == [EXACT] * 3
    assert s["policy"] == "cadence" and s["global_step"] == sum(r["steps"] for r in s["ranks"])
    el = s["elche"]
    assert set(el) >= {"anchor", "counts", "phase", "calibration_count"}
    assert el["counts"][0] > el["counts"][1] > el["counts"][2]  # faster ranks run more
    assert el["calibration_count"] == s["averages"]
    assert sum(e["averages"] for e in s["epochs"]) == s["averages"]
    assert all(e["averages"] >= 1 for e in s["epochs"])
    windows = [x for x in c.of_type(Notice) if x.kind == "window"]
    assert len(windows) == s["averages"] and all(w.data["reason"] for w in windows)
    # Overlap: at each trigger every idle rank gets its next window *before* its
    # RequestParams (the rounds that close an epoch have none to give).
    overlapped = 0
    for _ev, cmds in c.trace:
        opens = [x for x in cmds if isinstance(x, OpenRound)]
        if not opens:
            continue
        sends = [(x.rank, x.kind) for x in cmds if isinstance(x, Send)]
        for r in opens[0].ranks:
            kinds = [k for rr, k in sends if rr == r]
            assert "request_params" in kinds
            if "start_epoch" in kinds:
                overlapped += 1
                assert kinds.index("start_epoch") < kinds.index("request_params")
    assert overlapped >= 3 * (s["averages"] - 2 * 3)


class BoundaryCluster(CheckedCluster):
    """Checks, at every plan handed out, that it comes from the oldest epoch with work."""

    def feed(self, ev):
        before = {e: p.remaining() for e, p in self.state.cadence.pools.items()}
        cmds = super().feed(ev)
        for _r, ctl in controls(cmds):
            if ctl.HasField("start_epoch") or (ctl.HasField("update") and ctl.update.HasField("next_plan")):
                epoch = _plan(ctl)[0]
                older = {e: n for e, n in before.items() if e < epoch}
                # A step hands out an older epoch's last chunks before any of this one.
                assert all(self.state.cadence.pools[e].remaining() == 0 for e in older if e in self.state.cadence.pools)
                self.plans.append((epoch, self.state.metrics.last_aggregated))
        return cmds


def test_windows_run_on_into_the_next_epoch_before_this_one_aggregated():
    c = BoundaryCluster(world_size=3, total=60, batch_size=4, epochs=3, policy="cadence", anchor=2,
                        probe_batches=None, speeds=[10, 20, 40])  # fmt: skip
    c.plans = []
    c.join_all()
    res = c.run()
    assert res.ok
    assert [{k: e[k] for k in ("duplicates", "missing")} for e in res.summary["coverage"]] == [
        {"duplicates": 0, "missing": 0}
    ] * 3
    early = [(e, agg) for e, agg in c.plans if e > 0 and (agg is None or agg < e - 1)]
    assert {e for e, _ in early} == {1, 2}  # both boundaries were streamed, not waited at
    assert all(agg is None or agg >= e - 2 for e, agg in c.plans)  # at most two epochs live
    opened = [x.data["epoch"] for x in c.of_type(Notice) if x.kind == "epoch_opened"]
    assert opened == [1, 2]


def test_death_mid_epoch_exact_coverage_with_discards_counted():
    c = CheckedCluster(world_size=3, total=100, batch_size=8, epochs=3, policy="cadence", anchor=2)
    c.join_all()
    c.run_until(lambda: c.ranks[2].step >= 3 and c.state.unfolded(2) > 0)
    pending_by_epoch: dict[int, int] = {}  # what it trained and no round folded: discarded
    for e, _o, n, s in c.ranks[2].trained:
        if s > c.state.ranks[2].folded_step:
            pending_by_epoch[e] = pending_by_epoch.get(e, 0) + n
    pending = sum(pending_by_epoch.values())
    assert pending > 0
    c.kill(2)
    res = c.run()
    assert res.ok
    cov = res.summary["coverage"]
    assert [{k: e[k] for k in EXACT} for e in cov] == [EXACT] * 3
    assert {e["epoch"]: e["discarded"] for e in cov if e["discarded"]} == pending_by_epoch
    assert res.summary["discarded_samples"] == pending
    assert res.summary["ranks"][2]["phase"] == "DEAD"
    trained = {}
    for r in c.ranks[:2]:
        for e, off, n, _ in r.trained:
            for p in range(off, off + n):
                trained[(e, p)] = trained.get((e, p), 0) + 1
    assert all(v == 1 for v in trained.values())  # survivors never repeat a position
    folded = c.state.ranks[2].folded_step
    for e, off, n, step in c.ranks[2].trained:  # what the dead rank committed stays its own
        if step <= folded:
            assert all((e, p) not in trained for p in range(off, off + n))


def test_death_while_a_round_is_pending_and_a_silent_rank():
    c = _cluster(world_size=4, total=97, batch_size=5, epochs=2, anchor=2, defer_acks=True)
    c.join_all()
    c.run_until(lambda: c.state.rounds.phase is PENDING)
    c.kill(3)
    c.run_until(lambda: c.ranks[1].step >= 6)
    c.silence(1)
    res = c.run()
    assert res.ok
    assert all(e["missing"] == 0 and e["duplicates"] == 0 for e in res.summary["coverage"])


@pytest.mark.parametrize("ws,total,bs", [(1, 7, 3), (2, 33, 5), (4, 10, 4), (5, 3, 2)])
def test_shapes_exact_coverage(ws, total, bs):
    c = _cluster(world_size=ws, total=total, batch_size=bs, epochs=2)
    c.join_all()
    res = c.run()
    assert res.ok
    for e in res.summary["coverage"]:
        assert (e["expected"], e["trained"], e["duplicates"], e["missing"]) == (total, total, 0, 0)


def test_replay_rebuilds_the_same_state_and_commands():
    c = _cluster(world_size=3, total=100, batch_size=8, epochs=2, anchor=2, guard="level")
    c.join_all()
    c.run_until(lambda: c.ranks[1].step >= 5)
    c.kill(1)
    c.run()
    record = []
    st = replay(c.config, c.journal, record=record)
    assert st == c.state
    assert record == c.commands
    other = copy.deepcopy(c.state)
    other.cadence.elche.anchor += 1
    assert other != c.state  # the engines really take part in the comparison


def test_trigger_opens_the_round_without_throttle():
    c = _cold_start()
    _drain(c, 0, 1)
    for _ in range(4):
        c.train_one(0)
    for _ in range(3):
        c.train_one(1)
    cmds = c.feed(BatchDone(now=0.0, rank=1, batch_ms=20, data_ms=1, step_count=4, loss=1.0, samples=1,
                            epoch=0, offset=53))  # fmt: skip
    assert cmds[0] == OpenRound(1, (0, 1))
    assert [(x.rank, x.kind) for x in cmds[1:]] == [(0, "request_params"), (1, "request_params")]
    assert [window_plan(x.control)[0] for x in cmds[1:]] == ["next_plan", "next_plan"]  # each its window
    assert c.state.cadence.window_mark == {0: 4, 1: 4} and window_steps(c.state, 0) == 0


# -- feedback at finish ------------------------------------------------------------------------


def _window(st, per_rank_ms, *, lr=None, divergence=None, opened=0.0, now=0.0):
    cad, rs = st.cadence, st.rounds
    for r, ms in enumerate(per_rank_ms):
        for _ in range(4):
            cad.ledger.record_batch(r, ms, 0.0)
        if lr is not None:
            cad.last_lr[r] = lr
    rs.window = {r: 4 for r in range(len(per_rank_ms))}
    rs.divergence = {r: divergence for r in range(len(per_rank_ms))} if divergence is not None else {}
    rs.opened_at, st.now = opened, now
    out = []
    _feedback.finish_window(st, 0, out)
    assert len(out) == 1 and out[0].kind == "window"
    return out[0].data


def test_feedback_sync_ms_is_the_previous_rounds_exposed_cost_and_the_first_is_zero():
    st = _state(2, 4)
    first = _window(st, [10.0, 20.0], opened=1.0, now=1.25)
    assert first["sync_ms"] == 0.0 and first["counts"] == [8, 4] and first["anchor_rank"] == 1
    assert first["round_ms"] == pytest.approx(250.0)
    # That round overlapped the next window entirely (no rank reached its window end
    # before it finished): it cost nothing, however long it was open.
    second = _window(st, [10.0, 20.0], opened=2.0, now=2.01)
    assert second["sync_ms"] == 0.0 and second["round_ms"] == pytest.approx(10.0)
    st.cadence.barrier_at = 3.05  # every rank ran its window 50 ms before this one finished
    _window(st, [10.0, 20.0], opened=3.0, now=3.1)
    assert st.cadence.barrier_at is None and st.cadence.exposed_s == pytest.approx(0.05)
    fourth = _window(st, [10.0, 20.0], opened=4.0, now=4.01)
    assert fourth["sync_ms"] == pytest.approx(50.0)
    assert fourth["overhead"] == pytest.approx(50.0 / (4 * 20.0 + 50.0))
    assert st.cadence.ledger.steps == [0, 0]  # the ledger restarts every window
    assert _feedback.summary(st.cadence)["exposed_sync_s"] == pytest.approx(0.05)


def test_barrier_at_marks_when_an_open_round_starts_delaying_the_next():
    c = _cluster(world_size=2, total=100, batch_size=1, epochs=1, anchor=4, guard="none", speeds=[10, 10],
                 defer_acks=True)  # fmt: skip
    c.join_all()
    _until_trigger(c, [0, 1])
    _drain(c, 0, 1)
    for _ in range(4):
        c.train_one(0)
    assert c.state.cadence.barrier_at is None  # rank 1 is still running its window
    c.advance(0.5)
    for _ in range(4):
        c.train_one(1)
    assert c.state.cadence.barrier_at == pytest.approx(c.now)
    c.advance(0.25)
    c.send_ack(0)
    cmds = c.feed(SyncAcked(now=c.now, rank=1, cycle=1, step_count=4, divergence=0.01))
    c.ranks[1].ack_due = None
    assert c.state.cadence.exposed_s == pytest.approx(0.25)
    assert OpenRound(2, (0, 1)) in cmds and c.state.rounds.cycle == 2  # the delayed round fires at once
    assert c.state.cadence.barrier_at is None


def test_feedback_guard_verdict_lands_and_explains_itself():
    st = _state(2, 4, guard="level")
    verdicts = [_window(st, [10.0, 20.0], divergence=d) for d in (0.02, 0.03, 0.04)]
    assert [v["verdict"] for v in verdicts] == ["Stable", "Stable", "SuppressGrowth"]
    assert "divergence rose" in verdicts[-1]["reason"]
    assert st.cadence.elche.growth_enabled is False
    assert _feedback.summary(st.cadence)["last_verdict"] == "SuppressGrowth"


def test_feedback_meta_controller_nudges_on_an_lr_cliff():
    st = _state(2, 8)
    assert _window(st, [10.0, 20.0], lr=0.1)["meta"] is None
    data = _window(st, [10.0, 20.0], lr=0.01)
    assert data["meta"]["factor"] == pytest.approx(0.5)
    assert (data["anchor_before"], data["anchor"]) == (8, 4)


def test_feedback_without_meta_or_lr_leaves_the_anchor():
    st = _state(2, 8, meta_controller=False)
    _window(st, [10.0, 20.0], lr=0.1)
    assert _window(st, [10.0, 20.0], lr=0.01)["meta"] is None
    assert st.cadence.elche.anchor == 8


# -- config and summary -----------------------------------------------------------------------


def test_config_cadence_knobs_defaults_and_validation():
    cfg = CoreConfig(world_size=2)
    assert (cfg.anchor, cfg.min_anchor, cfg.max_anchor, cfg.overhead_target) == (4, None, 1000, 0.05)
    assert (cfg.max_batch_diff, cfg.guard, cfg.meta_controller) == (None, "level", True)
    assert cfg.probe_batches == 1  # the service's default (issue 10); None: the anchor, as in the reference
    assert CoreConfig(world_size=2, max_batch_diff=0).batch_diff_cap is None
    for bad in ({"anchor": 0}, {"max_anchor": 0}, {"overhead_target": 0.0}, {"guard": "trend"},
                {"max_batch_diff": -1}, {"min_anchor": 0}):  # fmt: skip
        with pytest.raises(ValueError):
            CoreConfig(world_size=2, **bad)
    st = initial_state(CoreConfig(world_size=3, policy="cadence", anchor=6, min_anchor=8, guard="growth",
                                  meta_controller=False, probe_batches=None))  # fmt: skip
    el = st.cadence.elche
    assert (el.anchor, el.min_anchor, el.batch_counts) == (8, 8, [8, 8, 8])
    assert st.cadence.guard.name == "growth" and st.cadence.meta is None


def test_sync_summary_has_no_cadence_block():
    c = Cluster(world_size=2, total=16, batch_size=4, epochs=1, policy="sync")
    c.join_all()
    s = c.run().summary
    assert "elche" not in s and all("averages" not in e for e in s["epochs"])
    assert c.state.cadence is None


@pytest.mark.parametrize("killed,silent", [((0, 1), 2), ((0, 2), 1), ((1, 2), 3)])
def test_a_window_folded_whole_before_its_snapshot_does_not_hold_the_reduce_barrier(killed, silent):
    # Found by the stateful property test: the survivor stepped between the trigger and
    # its snapshot, so the round folded its whole window; holding it at the reduce
    # barrier then waited for a round the gate would never open (nothing to fold).
    c = _cluster(world_size=4, total=5, batch_size=1, epochs=1, liveness_timeout_s=5.0, reduce_stall_s=1e9,
                 defer_chunks=True, defer_acks=True, race_throttle=True, anchor=2)  # fmt: skip
    c.join_all()
    c.pump_once()
    for r in killed:
        c.kill(r, code=-9)
    c.silence(silent)
    c.advance(1.0)
    fin = c.run()
    assert [row["missing"] for row in fin.summary["coverage"]] == [0]


def _run_ahead_pair():
    """Two ranks, windows of 4, run_ahead on: rank 0 is the one that runs ahead."""
    c = CheckedCluster(world_size=2, total=100, batch_size=1, epochs=1, policy="cadence", anchor=4,
                       probe_batches=None, guard="none", run_ahead=True)  # fmt: skip
    c.join_all()
    return c


def _rank_1_fires_the_round(c):
    """Rank 1 runs its window: its last batch is the round's trigger."""
    _drain(c, 1)
    while c.state.rounds.cycle == 0 and c.train_one(1):
        _drain(c, 1)
    assert c.state.rounds.cycle == 1


def test_a_rank_runs_ahead_of_the_barrier_while_another_trains_by_at_most_one_window():
    # run_ahead on: rank 0 ran its window while rank 1 still holds its chunk.
    # It trains on instead of idling -- those steps are this window's, folded by the
    # round like any other -- but at most one more window: a rank that hangs mid-window
    # lets the others run only that far ahead before it is declared dead.
    c = _run_ahead_pair()
    st = c.state
    _drain(c, 0)
    while c.train_one(0):
        _drain(c, 0)
    assert window_steps(st, 0) == 8 and 0 not in st.cadence.in_flight  # 4 + one more window
    assert st.rounds.gate_reason.startswith("rank 1 ran 0/4")
    _rank_1_fires_the_round(c)
    assert st.rounds.ranks == (0, 1)
    res = c.run()
    assert res.ok and [{k: e[k] for k in EXACT} for e in res.summary["coverage"]] == [EXACT]


def test_a_rank_still_running_ahead_at_the_trigger_gets_the_rest_of_its_window_queued():
    # Rank 0 ran its window and holds a run-ahead chunk it has not trained when rank 1's
    # last batch fires the round. It is in flight, so it used to get its next window
    # only once that chunk was done: a turnaround with nothing to train, every window.
    # Now the trigger extends the chunk with the rest of its window (whose first step is
    # that chunk's batch), before its RequestParams: ExtendPartition, not a second
    # StartEpoch -- two plans queued at a rank mean a coordinator bug (hazard 11), warned.
    c = _run_ahead_pair()
    st = c.state
    _drain(c, 0)
    for _ in range(4):
        c.train_one(0)
    _drain(c, 0)  # its window is run: the run-ahead chunk arrives
    assert 0 in st.cadence.in_flight and window_steps(st, 0) == 4
    # What it holds: the run-ahead chunk, and the top-up sent with its window's last batch
    # (a batch per report here, so the next report would have found it dry).
    held = st.cadence.pools[0].in_flight(0)
    assert held == 2
    _rank_1_fires_the_round(c)
    (rp,) = c.ranks[0].inbox  # the extension rides in its RequestParams (protocol 1.2)
    how, (_e, _off, size) = window_plan(rp)
    assert how == "extend" and size == 4 - held  # its window of 4, less the batches it holds
    res = c.run()
    assert not any(r.warnings for r in c.ranks)
    assert res.ok and [{k: e[k] for k in EXACT} for e in res.summary["coverage"]] == [EXACT]


@pytest.mark.parametrize("sweep", [False, True])
def test_a_count_the_callback_slack_raised_puts_its_rank_back_in_the_gates_view(sweep, monkeypatch):
    """Counts move outside a round when an aggregation stages callback slack: a rank the
    gate had let go (its window run) whose count rose blocks it again, and is in the
    gate's view to say so -- after the gate's pops as after its one-sweep sift."""
    monkeypatch.setattr(_views, "REFILL", 0 if sweep else _views.REFILL)
    st = _state(2, 4, probe_batches=None)
    _pool(st, 0, 100)
    _pool(st, 1, 100)  # the ranks stream into epoch 1, which has work left
    _steps(st, [4, 4])
    rearm(st)
    assert st.cadence.elche.batch_counts == [4, 4] and cadence_gate(st)[0]  # both ran their window

    def stage(st, epoch, out):
        st.cadence.elche.batch_counts[1] = 9
        return True

    monkeypatch.setattr(_slack, "stage", stage)
    CADENCE.on_epoch_aggregated(st, 0, [])
    assert view_drift(st) == []
    assert cadence_gate(st) == (False, "rank 1 ran 4/9 batches of its window and has work left")
