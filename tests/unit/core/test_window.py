"""Window ledger and timing feed (spec §5.1, §6.3; scenarios 14-19)."""

import math

import pytest

from flodl.core.cadence._elche import ElChe
from flodl.core.cadence._window import WindowLedger, WindowReport, delivered_capable, select_feed


def _report(wall, steps, dms, dbatches, coherent, sync_ms=1.0):
    return WindowReport(
        wall_ms=wall,
        steps=steps,
        delivered_ms=dms,
        delivered_batches=dbatches,
        fill_ms=[0.0] * len(wall),
        delivered_coherent=coherent,
        sync_ms=sync_ms,
    )


# Scenario 14
def test_record_batch_first_batch_fills_then_marginal_accumulates():
    led = WindowLedger(2)
    led.record_batch(0, 10.0, 5.0)
    assert led.steps[0] == 1
    assert led.wall_ms[0] == 10.0
    assert not led.has_delivered_sample(0)
    assert led.fill_excess_ms(0) == 0.0
    led.record_batch(0, 8.0, 2.0)
    led.record_batch(0, 8.0, 2.0)
    assert led.steps[0] == 3
    assert led.delivered_ms[0] == 20.0
    assert led.delivered_batches[0] == 2
    assert led.has_delivered_sample(0)
    assert led.fill_excess_ms(0) == pytest.approx(15.0 - 10.0)
    assert led.steps[1] == 0


# Scenario 15
def test_fill_excess_clamps_at_zero():
    led = WindowLedger(1)
    led.record_batch(0, 1.0, 0.0)
    led.record_batch(0, 8.0, 2.0)
    assert led.fill_excess_ms(0) == 0.0


def test_record_batch_ignores_out_of_range():
    led = WindowLedger(1)
    led.record_batch(0, 10.0, 0.0)
    led.record_batch(0, 10.0, 5.0)
    led.record_batch(7, 1.0, 1.0)  # out of range: no-op, no raise
    assert sum(led.steps) == 2


# Scenario 17
def test_select_feed_mixed_scale_guard_feeds_compute_scale():
    cpu_cadence = delivered_capable("cadence", "cpu")
    assert cpu_cadence
    led = WindowLedger.from_values(
        steps=[4, 4], wall_ms=[40.0, 100.0], delivered_ms=[80.0, 0.0], delivered_batches=[4, 0]
    )
    rep = led.window_report(delivered_capable=cpu_cadence)
    assert not rep.delivered_coherent
    assert select_feed(rep) == ([40.0, 100.0], [4, 4])

    led = WindowLedger.from_values(
        steps=[4, 4], wall_ms=[40.0, 100.0], delivered_ms=[80.0, 220.0], delivered_batches=[4, 4]
    )
    rep = led.window_report(delivered_capable=cpu_cadence)
    assert rep.delivered_coherent
    assert select_feed(rep) == ([80.0, 220.0], [4, 4])

    # Rank 1 did not move: it is not a mover, so the window stays coherent.
    led = WindowLedger.from_values(
        steps=[4, 0], wall_ms=[40.0, 0.0], delivered_ms=[80.0, 0.0], delivered_batches=[4, 0]
    )
    assert led.movers_delivered_complete()
    assert led.window_report(delivered_capable=cpu_cadence).delivered_coherent


def test_movers_delivered_complete_skips_dead_ranks():
    led = WindowLedger.from_values(
        steps=[4, 4], wall_ms=[40.0, 100.0], delivered_ms=[80.0, 0.0], delivered_batches=[4, 0]
    )
    assert not led.movers_delivered_complete([True, True])
    assert led.movers_delivered_complete([True, False])


# Scenario 18
def test_select_feed_sync_always_compute_fed():
    assert not delivered_capable("sync", "cpu")
    assert not delivered_capable("sync", "nccl")
    led = WindowLedger.from_values(
        steps=[1, 1], wall_ms=[10.0, 20.0], delivered_ms=[99.0, 99.0], delivered_batches=[1, 1]
    )
    rep = led.window_report(delivered_capable=delivered_capable("sync", "bus"))
    assert select_feed(rep) == ([10.0, 20.0], [1, 1])


def test_delivered_capable_table():
    assert delivered_capable("async", "cpu") and delivered_capable("cadence", "collective")
    assert not delivered_capable("async", "nccl")
    with pytest.raises(ValueError):
        delivered_capable("cadence", "carrier-pigeon")


# Scenario 19
def test_report_window_feed_selection_drives_smoothing():
    el = ElChe(2, 4)
    el.report_window(_report([40.0, 100.0], [4, 4], [80.0, 220.0], [4, 4], True))
    assert el.calibrated
    assert el.smoothed_ms_per_batch(0) == pytest.approx(20.0)
    assert el.smoothed_ms_per_batch(1) == pytest.approx(55.0)

    el = ElChe(2, 4)
    el.report_window(_report([40.0, 100.0], [4, 4], [80.0, 0.0], [4, 0], False))
    assert el.smoothed_ms_per_batch(0) == pytest.approx(10.0)
    assert el.smoothed_ms_per_batch(1) == pytest.approx(25.0)

    el = ElChe(2, 4)
    cal = el.report_window(_report([0.0, 0.0], [0, 0], [0.0, 0.0], [0, 0], True))
    assert not el.calibrated and not cal.calibrated


def test_per_batch_wall_and_resets_are_split():
    led = WindowLedger(2)
    led.record_batch(0, 10.0, 5.0, loss=0.4)
    led.record_batch(0, 10.0, 5.0, loss=math.nan)  # a diverged batch: counted as trained, not in the loss
    led.record_batch(1, 4.0, 1.0)  # no loss given: none fed
    assert led.loss_sum == [0.4, 0.0] and led.loss_count == [1, 0]
    led.reset_timing()
    assert led.wall_ms == [0.0, 0.0] and not led.has_delivered_sample(0)
    assert led.loss_sum == [0.0, 0.0] and led.loss_count == [0, 0]
    assert led.steps == [2, 1]
    led.reset_steps()
    assert led.steps == [0, 0]


def test_window_report_carries_fill_and_sync():
    led = WindowLedger(1)
    led.record_batch(0, 10.0, 5.0)
    led.record_batch(0, 8.0, 2.0)
    rep = led.window_report(delivered_capable=True, sync_ms=7.0)
    assert rep.fill_ms == (5.0,) and rep.sync_ms == 7.0 and rep.delivered_coherent
