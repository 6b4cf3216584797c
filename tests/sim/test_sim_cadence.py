"""Cadence in virtual time: heterogeneous ranks stop waiting, and coverage stays exact."""

import random

import pytest

from flodl.core import Notice, replay
from flodl.sim import SimConfig, batch_ends, simulate

# The 1,2,4 rig: three ranks at 10, 20 and 40 ms per batch, 5 % jitter, 0.5 ms links.
RIG = dict(ms_per_batch=(10, 20, 40), jitter=0.05, latency_s=0.0005, batch_size=16)


def _exact(result, expected):
    cov = result.summary["coverage"]
    assert cov, "no epoch completed"
    for c in cov:
        assert (c["expected"], c["trained"], c["duplicates"], c["missing"]) == (expected, expected, 0, 0), c


def test_cadence_on_1_2_4_is_efficient_and_beats_sync():
    # 2 x 6000 samples at 16 per batch: ~28 windows of [16, 8, 4] batches (160 ms each).
    cfg = dict(RIG, total_samples=6000, epochs=2)
    sync = simulate(SimConfig(**cfg, policy="sync"))
    cad = simulate(SimConfig(**cfg, policy="cadence"))
    assert sync.finished.ok and cad.finished.ok
    _exact(cad, 6000)
    assert cad.summary["averages"] >= 20
    assert cad.summary["elche"]["counts"] == [16, 8, 4]  # 4:2:1, the speeds' inverse
    assert cad.efficiency >= 0.94, cad.efficiency  # rounds overlap the next window
    assert cad.efficiency >= 1.8 * sync.efficiency, (cad.efficiency, sync.efficiency)


def test_cadence_windows_explain_themselves():
    res = simulate(SimConfig(**RIG, total_samples=3000, epochs=1, policy="cadence"))
    assert res.finished.ok
    windows = [c for c in _commands(res) if isinstance(c, Notice) and c.kind == "window"]
    assert len(windows) == res.summary["averages"]
    assert windows[0].data["sync_ms"] == 0.0 and windows[1].data["round_ms"] > 0.0
    # A round (~4 ms) overlaps the next window (~160 ms): it delays nobody, so the cost
    # ElChe amortises (sync_ms, the exposed part) stays 0 however long rounds are open.
    assert all(w.data["sync_ms"] == 0.0 for w in windows)
    assert res.summary["elche"]["exposed_sync_s"] == 0.0
    assert all(w.data["verdict"] in ("Stable", "SuppressGrowth", "NudgeDown") for w in windows)
    late = windows[-1].data
    assert late["overhead"] is not None and late["overhead"] < 0.10


def test_a_round_longer_than_a_window_is_exposed_and_grows_the_anchor():
    # A 300 ms reduce against 160 ms windows: the ranks run their next window and wait
    # at the reduce barrier for the open round. That wait is the round's exposed cost;
    # ElChe grows the anchor until windows hide the round again.
    res = simulate(SimConfig(**RIG, total_samples=6000, epochs=2, policy="cadence", reduce_s_per_rank=0.1))
    assert res.finished.ok
    _exact(res, 6000)
    el = res.summary["elche"]
    assert el["exposed_sync_s"] > 0.0 and el["anchor"] >= 8
    windows = [c for c in _commands(res) if isinstance(c, Notice) and c.kind == "window"]
    assert max(w.data["sync_ms"] for w in windows) > 100.0
    assert windows[-1].data["round_ms"] > 250.0


def _commands(res):
    """Every command of the run, rebuilt from its event journal (replay is exact)."""
    record = []
    replay(res.state.config, res.events, record=record)
    return record


@pytest.mark.timeout(60)  # a hang guard, not a speed assertion (speed lives in bench/)
def test_64_ranks_spread_1_to_10x_exact_over_several_epochs():
    rng = random.Random(7)
    ms = tuple(rng.uniform(5.0, 50.0) for _ in range(64))
    res = simulate(SimConfig(ms_per_batch=ms, total_samples=16_000, batch_size=16, epochs=3, policy="cadence"))
    assert res.finished.ok
    _exact(res, 16_000)
    counts = res.summary["elche"]["counts"]
    fastest, slowest = ms.index(min(ms)), ms.index(max(ms))
    assert counts[fastest] > counts[slowest]


@pytest.mark.parametrize("seed", [1, 2, 3, 4, 5, 6])
def test_a_crash_and_a_hang_lose_and_double_nothing(seed):
    rng = random.Random(seed)
    cfg = SimConfig(
        ms_per_batch=(10, 20, 40, 15), total_samples=1000, batch_size=16, epochs=3, seed=seed, policy="cadence",
        fail_at={rng.randrange(4): rng.randrange(1, 40)},
        hang_at={rng.randrange(4): rng.randrange(1, 40)},
    )  # fmt: skip
    res = simulate(cfg)
    assert res.finished is not None and res.finished.ok, res.finished
    _exact(res, 1000)
    assert res.summary["discarded_samples"] == sum(c["discarded"] for c in res.summary["coverage"])


def test_same_seed_same_run_and_the_event_list_replays():
    cfg = SimConfig(ms_per_batch=(10, 30), total_samples=300, batch_size=8, epochs=2, seed=11, fail_at={1: 7},
                    policy="cadence")  # fmt: skip
    a, b = simulate(cfg), simulate(cfg)
    assert a.events == b.events and a.summary == b.summary
    st = replay(a.state.config, a.events)
    assert st == a.state


def test_a_one_batch_probe_window_calibrates_at_less_cost():
    # Before any measurement every rank gets the same count; with a 1-batch probe the
    # fast ranks wait for one slow batch, not for `anchor` of them (at the reduce barrier:
    # with run_ahead on they train through that wait either way).
    cfg = dict(RIG, total_samples=2000, epochs=1, policy="cadence", seed=3)
    plain = simulate(SimConfig(**cfg, core_overrides={"probe_batches": None, "run_ahead": False}))  # the reference
    probed = simulate(SimConfig(**cfg, core_overrides={"probe_batches": 1, "run_ahead": False}))
    assert plain.finished.ok and probed.finished.ok
    _exact(probed, 2000)
    first = {}
    for c in _commands(probed):
        if type(c).__name__ == "Send" and c.kind == "start_epoch":
            first.setdefault(c.rank, c.control.start_epoch.plan.partition_size)
    assert first == {0: 16, 1: 16, 2: 16}  # one batch each
    assert probed.summary["elche"]["counts"] == plain.summary["elche"]["counts"] == [16, 8, 4]
    assert probed.efficiency > plain.efficiency, (probed.efficiency, plain.efficiency)


def _boundary_waits_ms(res):
    """Per rank and epoch boundary: the idle time between its last batch of an epoch and
    its first of the next (the gap less that batch's own time), in ms."""
    last, waits = {}, []
    for ev, end in batch_ends(res.events):
        prev = last.get(ev.rank)
        if prev is not None and prev[1] != ev.epoch:
            waits.append((end - prev[0]) * 1e3 - ev.batch_ms - ev.data_ms)
        last[ev.rank] = (end, ev.epoch)
    return waits



@pytest.mark.parametrize("seed", [0, 1])
def test_six_unequal_ranks_cross_epoch_boundaries_without_waiting(seed):
    # The 1,1,2,3,5,8 rig: windows of ~110 of an epoch's 128 batches. Behind an epoch
    # barrier every rank waited at each epoch end for the others' last chunks, the round
    # and the aggregation (40-70 ms here, ~10 % of the run). Now a rank whose epoch ran
    # dry runs on into the next one: at a boundary it waits a control round trip at most.
    cfg = dict(ms_per_batch=(10, 10, 20, 30, 50, 80), total_samples=4096, batch_size=32, epochs=3,
               policy="cadence", seed=seed)  # fmt: skip
    res = simulate(SimConfig(**cfg))  # the default: run_ahead on
    held = simulate(SimConfig(**cfg, core_overrides={"run_ahead": False}))
    assert res.finished.ok and held.finished.ok
    _exact(res, 4096)
    _exact(held, 4096)
    waits = _boundary_waits_ms(res)
    assert len(waits) == 6 * 2  # every rank crossed both boundaries
    assert max(waits) < 5.0, waits  # links are 0.5 ms each way: a few round trips
    assert res.efficiency >= 0.92, res.efficiency
    # Held at the reduce barrier (run_ahead off, the default before issue 11), it still
    # streams across (exact, no wait for the aggregation) but idles at window ends:
    # run-ahead fills them.
    assert held.efficiency >= 0.88, held.efficiency
    assert res.efficiency > held.efficiency, (res.efficiency, held.efficiency)


def test_the_last_window_is_trained_in_parallel_to_the_end():
    # 48 ranks at the 1,2,4 pace (100, 200, 400 ms a batch), batch size 1, two epochs: the
    # last epoch's final-window plan is pinned at a trigger and again when that round
    # finishes (a rank that got nothing at the trigger gets its window in the Update).
    # The second pin splits only the batches still in the pool; counted against those
    # shares, the steps each rank had run since the trigger made nearly every share 0
    # (``FinalWindowPlan.share_steps`` now counts from the pin), and the batches left
    # were trained by one rank at a time (``leaves_the_tail``), one per round trip --
    # seconds here, ~60-115 s at 1,024 ranks (bench/control_scale.py).
    n = 48
    res = simulate(SimConfig(ms_per_batch=tuple((100.0, 200.0, 400.0)[i % 3] for i in range(n)),
                             total_samples=17 * n, batch_size=1, epochs=2, policy="cadence", jitter=0.02,
                             reduce_s_per_rank=0.005, core_overrides={"anchor": 4, "final_eval": False}))  # fmt: skip
    assert res.finished.ok
    _exact(res, 17 * n)
    ends = sorted(t for _, t in batch_ends(res.events))
    tail = ends[-1] - ends[int(0.99 * len(ends))]
    assert tail < 1.0, f"the last 1% of batches took {tail:.2f}s (slowest batch 0.4s)"  # (old: 3.0s)
