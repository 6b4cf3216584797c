"""What the dashboard's timeline costs the coordinator's hot path.

The simulator runs the real core against simulated ranks and hands back the exact event
list it consumed. This bench steps that list again through a fresh core twice per run,
in the same process: bare (the peer: what the service did before the timeline), and with
``Timeline.observe`` after every step, as the service does. Medians of several runs of
each, interleaved; the ratio is the timeline's overhead on the core's own work (the
service adds sockets, decode and the journal on top, so its relative cost there is
smaller still). Also: the snapshot's size and build time at the end (what one poll of
/timeline costs), and the same for a timeline filled to its whole span budget (a long
run of a big world: the worst poll).

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from flodl.core import initial_state, step
from flodl.sim import SimConfig, simulate
from flodl_coordinator import dashboard
from flodl_coordinator import timeline as tl_mod
from flodl_coordinator.timeline import Timeline


def _replay(config, events, timeline):
    state = initial_state(config)
    t0 = time.perf_counter()
    for ev in events:
        state, cmds = step(state, ev)
        if timeline is not None:
            timeline.observe(ev, cmds)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--samples", type=int, default=8192)
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    cfg = SimConfig(ms_per_batch=tuple(10.0 * (1 + r % 4) for r in range(args.ranks)), total_samples=args.samples,
                    epochs=args.epochs, policy="cadence", seed=1)  # fmt: skip
    res = simulate(cfg)
    config = res.state.config
    bare, timed = [], []
    for _ in range(args.runs):  # interleaved: both see the same machine load
        bare.append(_replay(config, res.events, None))
        tl = Timeline(config.world_size, config.num_epochs)
        timed.append(_replay(config, res.events, tl))
    t0 = time.perf_counter()
    snap = tl.snapshot()
    body = json.dumps(snap)
    snap_s = time.perf_counter() - t0
    full = Timeline(100)
    for lane in full._lanes:  # every lane at its cap: 200k closed spans in all
        for i in range(lane.spans.maxlen):
            lane.spans.append(("train", float(i), i + 0.5, {"steps": 3}))
    t0 = time.perf_counter()
    full_body = dashboard.to_json(full.snapshot())
    full_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    poll_body = dashboard.to_json(full.snapshot(tl_mod.POLL_SPANS))
    poll_s = time.perf_counter() - t0
    b, t = statistics.median(bare), statistics.median(timed)
    print(json.dumps({
        "events": len(res.events),
        "ranks": args.ranks,
        "runs": args.runs,
        "bare_core_median_s": round(b, 4),
        "with_timeline_median_s": round(t, 4),
        "ratio": round(t / b, 3),
        "timeline_us_per_event": round((t - b) / len(res.events) * 1e6, 2),
        "snapshot_ms": round(snap_s * 1000, 2),
        "snapshot_bytes": len(body),
        "spans": sum(len(lane["spans"]) for lane in snap["lanes"]),
        "curve_points": len(snap["curve"]),
        "truncated": snap["truncated"],
        "full_budget_spans": sum(lane.spans.maxlen for lane in full._lanes),
        "full_budget_all_spans_ms": round(full_s * 1000, 1),
        "full_budget_all_spans_bytes": len(full_body),
        "full_budget_poll_ms": round(poll_s * 1000, 1),  # what /timeline sends by default
        "full_budget_poll_bytes": len(poll_body),
    }, indent=2))  # fmt: skip


if __name__ == "__main__":
    main()
