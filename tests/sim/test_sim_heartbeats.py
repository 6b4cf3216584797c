"""Heartbeats go only where nothing else says the rank is alive (``HeartbeatDue``).

A rank's every frame is liveness to the coordinator, so a rank that reports its batches
sends no heartbeat frames of its own: once one is due, its next report (sent early if it
holds batches) is it. A rank that waits -- at a barrier, for a plan -- still heartbeats,
and one that goes silent is still declared lost after the liveness timeout."""

from __future__ import annotations

import collections

from flodl.core import HeartbeatSeen
from flodl.sim import SimConfig, simulate


def _beats(res) -> collections.Counter:
    return collections.Counter(e.rank for e in res.events if type(e) is HeartbeatSeen)


def test_ranks_that_report_their_batches_send_no_heartbeats():
    res = simulate(SimConfig(ms_per_batch=(10.0, 20.0, 40.0), total_samples=4096, batch_size=16, epochs=2,
                             policy="cadence", seed=3, heartbeat_s=0.05))  # fmt: skip
    assert res.finished is not None and res.finished.ok
    intervals = res.virtual_s / 0.05  # one heartbeat per rank per interval, before
    assert sum(_beats(res).values()) <= 0.05 * 3 * intervals, _beats(res)


def test_a_waiting_rank_still_heartbeats_and_a_silent_one_is_still_lost():
    # Sync: rank 0 waits at every barrier for the 200 ms rank; rank 1 hangs at its 5th step.
    res = simulate(SimConfig(ms_per_batch=(10.0, 10.0, 200.0), total_samples=960, batch_size=16, epochs=2,
                             policy="sync", seed=1, heartbeat_s=0.05, liveness_timeout_s=0.5,
                             hang_at={1: 5}))  # fmt: skip
    assert res.finished is not None and res.finished.ok
    beats = _beats(res)
    assert beats[0] >= 0.25 * res.virtual_s / 0.05, beats  # it waits most of the run: it beats
    phases = {r["rank"]: (r["phase"], r.get("reason")) for r in res.summary["ranks"]}
    assert phases[1] == ("DEAD", "heartbeat stale (>0.5s)"), phases
    assert phases[0][0] == phases[2][0] == "LEFT"
