"""Core-only scale: the cost of ``flodl.core.step`` per event as the world grows.

For each policy and each world size N, ``flodl.sim`` runs one seeded job (N ranks at
the speeds 1, 2, 4 x ``--base-ms`` in turn, ``--batches`` batches per rank per epoch,
two epochs) and keeps its journal. The journal is then replayed through the real core,
event by event from ``initial_state`` (no simulator, no ranks: core time only), and
timed -- medians of ``--repeats`` replays:

* ``us_per_event``, ``events_per_s``: the whole journal;
* ``heartbeat_us``: a ``HeartbeatSeen`` (the cheapest frame: nothing but liveness);
* ``formation_ms``: the step that forms the world (it also dispatches epoch 0);
* ``epoch_dispatch_ms``: the step that aggregates epoch 0 and dispatches epoch 1;
* ``peak_mib``: tracemalloc's peak over one more replay (the core's state and commands).

A size whose simulation plus first replay takes longer than ``--budget-s`` ends that
policy's curve: the larger sizes are listed as ``skipped`` (so a quadratic core shows as
a short curve, not as a hung bench). Prints one JSON object. Run it against another
checkout by putting that checkout first on PYTHONPATH (the bench only uses
``flodl.sim.simulate`` and ``flodl.core``'s ``initial_state``/``step``).

    python bench/core_scale.py                 # N = 16 ... 16384 (x4), all policies
    python bench/core_scale.py --quick         # a smoke run: N = 16, 64, one replay
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
import tracemalloc
from typing import Any

from flodl.core import HeartbeatSeen, Notice, initial_state, step
from flodl.sim import SimConfig, simulate

SPEEDS = (1.0, 2.0, 4.0)


def workload(n: int, policy: str, *, batches: int, base_ms: float, batch_size: int) -> SimConfig:
    """One job of ``n`` unequal ranks, ``batches`` batches each per epoch, two epochs."""
    return SimConfig(
        ms_per_batch=tuple(base_ms * SPEEDS[r % len(SPEEDS)] for r in range(n)),
        total_samples=batch_size * batches * n,
        batch_size=batch_size,
        epochs=2,
        policy=policy,
        seed=n,
        # A tick per 50 ms of virtual time and a heartbeat a second, as the service.
        liveness_timeout_s=60.0,
    )


def _kinds(cmds: list) -> set[str]:
    return {c.kind for c in cmds if isinstance(c, Notice)}


def replay_timed(config: Any, events: list) -> dict[str, Any]:
    """Step every event of the journal once, timing each step."""
    st = initial_state(config)
    total = heartbeat = 0.0
    beats = 0
    formation = dispatch = None
    clock = time.perf_counter
    gc.collect()
    for ev in events:
        t0 = clock()
        st, cmds = step(st, ev)
        dt = clock() - t0
        total += dt
        if type(ev) is HeartbeatSeen:
            heartbeat += dt
            beats += 1
        if formation is None or dispatch is None:
            kinds = _kinds(cmds)
            if formation is None and "world_formed" in kinds:
                formation = dt
            elif dispatch is None and "epoch" in kinds:
                dispatch = dt
    return {
        "core_s": total,
        "heartbeat_us": heartbeat / beats * 1e6 if beats else None,
        "formation_ms": formation * 1e3 if formation is not None else None,
        "epoch_dispatch_ms": dispatch * 1e3 if dispatch is not None else None,
        "ok": bool(st.run.ok),
    }


def peak_mib(config: Any, events: list) -> float:
    gc.collect()
    tracemalloc.start()
    st = initial_state(config)
    for ev in events:
        st, _ = step(st, ev)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return peak / 2**20


def _median(rows: list[dict], key: str) -> Any:
    vals = [r[key] for r in rows if r[key] is not None]
    return round(statistics.median(vals), 3) if vals else None


def measure(n: int, policy: str, args: argparse.Namespace) -> dict[str, Any]:
    t0 = time.perf_counter()
    cfg = workload(n, policy, batches=args.batches, base_ms=args.base_ms, batch_size=args.batch_size)
    res = simulate(cfg)
    sim_s = time.perf_counter() - t0
    events, config = res.events, res.state.config
    rows = [replay_timed(config, events) for _ in range(args.repeats)]
    core_s = statistics.median(r["core_s"] for r in rows)
    return {
        "n": n,
        "events": len(events),
        "finished_ok": bool(res.finished and res.finished.ok) and all(r["ok"] for r in rows),
        "core_s": round(core_s, 4),
        "us_per_event": round(core_s / len(events) * 1e6, 2),
        "events_per_s": round(len(events) / core_s),
        "heartbeat_us": _median(rows, "heartbeat_us"),
        "formation_ms": _median(rows, "formation_ms"),
        "epoch_dispatch_ms": _median(rows, "epoch_dispatch_ms"),
        "peak_mib": round(peak_mib(config, events), 2) if args.memory else None,
        "sim_s": round(sim_s, 2),
        "wall_s": round(time.perf_counter() - t0, 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="16,64,256,1024,4096,16384", help="world sizes, comma-separated")
    ap.add_argument("--policies", default="sync,cadence,async")
    ap.add_argument("--repeats", type=int, default=3, help="replays per size (medians)")
    ap.add_argument("--batches", type=int, default=8, help="batches per rank per epoch")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--base-ms", type=float, default=50.0, help="the fastest rank's ms per batch")
    ap.add_argument("--budget-s", type=float, default=120.0,
                    help="a size taking longer than this ends the policy's curve")  # fmt: skip
    ap.add_argument("--no-memory", dest="memory", action="store_false", help="skip the tracemalloc replay")
    ap.add_argument("--quick", action="store_true", help="smoke run: N = 16, 64, one replay")
    args = ap.parse_args()
    if args.quick:
        args.sizes, args.repeats, args.batches = "16,64", 1, 4
    sizes = [int(s) for s in args.sizes.split(",")]
    out: dict[str, Any] = {"bench": "core_scale", "sizes": sizes, "repeats": args.repeats,
                           "batches_per_rank": args.batches, "policies": {}}  # fmt: skip
    for policy in args.policies.split(","):
        curve: list[dict] = []
        skipped: list[int] = []
        for n in sizes:
            if skipped:
                skipped.append(n)
                continue
            row = measure(n, policy, args)
            curve.append(row)
            if row["wall_s"] > args.budget_s:
                skipped.append(-1)  # marker: every larger size is skipped
        out["policies"][policy] = {"curve": curve, "skipped": [n for n in skipped if n > 0]}
    out["ok"] = all(r["finished_ok"] for p in out["policies"].values() for r in p["curve"])
    print(json.dumps(out, indent=2))
    if not out["ok"]:
        raise SystemExit("a simulated job did not finish cleanly (see finished_ok)")


if __name__ == "__main__":
    main()
