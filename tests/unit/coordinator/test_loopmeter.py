"""flodl_coordinator.loopmeter: the coordinator's per-frame handling time and busy share,
as the run summary and a scrape (prometheus_client's own parser) read them."""

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from flodl.core import CoreConfig, initial_state, status_view
from flodl_coordinator.loopmeter import FRAME_BUCKETS_S, LoopMeter
from flodl_coordinator.metrics import RunBook, new_registry
from flodl_coordinator.reducer import BusReducer


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_quantiles_are_bucket_bounds_never_below_the_truth():
    m = LoopMeter(Clock())
    assert m.quantile_le_s(0.99) == 0.0  # no frame yet
    for _ in range(98):
        m.frame(0.0003)
    m.frame(0.004)
    m.frame(0.04)
    assert m.quantile_le_s(0.50) == 0.0005  # 0.3 ms: the 0.5 ms bucket
    assert m.quantile_le_s(0.99) == 0.005  # the 99th frame took 4 ms
    assert m.quantile_le_s(1.0) == 0.04  # never above the largest frame
    m.frame(3.0)  # past the last bound: the open bucket's bound is the largest frame
    assert m.quantile_le_s(1.0) == 3.0


def test_the_busy_ratio_is_over_the_last_interval_and_the_summary_over_the_run():
    clock = Clock()
    m = LoopMeter(clock)
    clock.t += 1.0
    m.frame(0.2)
    m.busy(0.5)  # the drain that handled it, its sends included
    assert m.recent_busy_ratio() == pytest.approx(0.5)
    clock.t += 1.0
    assert m.recent_busy_ratio() == 0.0  # nothing since: idle
    clock.t += 2.0
    m.frame(0.001)
    m.busy(0.002)
    s = m.summary()
    assert s == {"frames": 2, "busy_share": pytest.approx(0.502 / 4, abs=1e-4), "frame_mean_ms": pytest.approx(100.5),
                 "frame_p50_le_ms": 1.0, "frame_p99_le_ms": 200.0, "frame_max_ms": 200.0,
                 "frame_max_event": "", "round_triggers": 0, "round_trigger_p50_le_ms": 0.0,
                 "round_trigger_p99_le_ms": 0.0, "round_trigger_max_ms": 0.0}  # fmt: skip


def test_the_frames_that_opened_a_round_are_counted_apart_as_well():
    m = LoopMeter(Clock())
    for _ in range(300):
        m.frame(0.0002)  # batches: most frames
    m.frame(0.003, opened_round=True)  # a trigger: the decision and its fan-out
    m.frame(0.012, opened_round=True)
    s = m.summary()
    assert (s["frames"], s["round_triggers"]) == (302, 2)
    assert s["frame_p99_le_ms"] == 0.25  # 2 frames in 302: the p99 of all of them hides the triggers
    assert (s["round_trigger_p50_le_ms"], s["round_trigger_p99_le_ms"], s["round_trigger_max_ms"]) == (5.0, 12.0, 12.0)
    stats = m.stats()
    assert (stats["count"], stats["round_count"]) == (302, 2)
    assert stats["round_buckets"][FRAME_BUCKETS_S.index(0.005)] == 1 and stats["round_buckets"][-1] == 2


def test_the_scrape_shows_the_frame_histogram_and_the_busy_ratio():
    clock = Clock()
    m = LoopMeter(clock)
    for t in (0.00005, 0.0007, 0.0007, 0.02):
        m.frame(t)
    m.busy(0.02145)
    clock.t += 0.1
    st = initial_state(CoreConfig(world_size=2))
    book = RunBook("r1", rank_labels=8)
    book.publish(st, status_view(st), reducer=BusReducer(), dropped={}, journal={}, events=0, loop=m.stats())
    fams = {f.name: f for f in text_string_to_metric_families(generate_latest(new_registry(book)).decode())}
    h = {s.labels["le"]: s.value for s in fams["flodl_coordinator_frame_seconds"].samples if s.name.endswith("_bucket")}
    assert len(h) == len(FRAME_BUCKETS_S) + 1
    assert (h["0.0001"], h["0.001"], h["0.025"], h["+Inf"]) == (1.0, 3.0, 4.0, 4.0)
    rounds = [s for s in fams["flodl_coordinator_round_trigger_seconds"].samples if s.name.endswith("_count")]
    assert [s.value for s in rounds] == [0.0]  # no frame opened a round
    busy = [s.value for s in fams["flodl_coordinator_busy_ratio"].samples]
    assert busy == [pytest.approx(0.02145 / 0.1)]
    book.publish(st, status_view(st), reducer=BusReducer(), dropped={}, journal={}, events=0)
    fams = {f.name: f for f in text_string_to_metric_families(generate_latest(new_registry(book)).decode())}
    assert "flodl_coordinator_frame_seconds" not in fams  # not measured (a book fed by no service): absent
