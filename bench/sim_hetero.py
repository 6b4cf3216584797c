"""The heterogeneous rigs in virtual time: where each rank's time goes, per policy.

``bench/hetero.py`` measures real processes, which a loaded machine slows unevenly; this
runs the same rigs through ``flodl.sim`` (the real core and rank machines, simulated
batches of ``base_ms x factor`` plus ``compute_ms``, 5 % jitter, 0.5 ms links), so the
ratios are the scheduler's alone. Per rig and policy, medians over ``--seeds``:

* ``efficiency``: committed samples per second over the sum of the ranks' solo rates;
* ``idle_share``: per rank, the share of the run it spent not training -- ``head`` before
  its first batch, ``between`` batches, ``tail`` after its last;
* ``boundary_wait_ms``: the longest idle gap between a rank's last batch of an epoch and
  its first of the next (an epoch barrier shows here).

Policies: ``cadence`` (the default: windows run on across epoch ends, and a rank that ran
its window trains on past its reduce barrier, ``run_ahead``), ``cadence_barrier``
(``run_ahead`` off: it waits there -- the default before issue 11), ``async``, ``sync``.
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics

from flodl.sim import SimConfig, batch_ends, simulate

POLICIES = {
    "cadence": ("cadence", {}),
    "cadence_barrier": ("cadence", {"run_ahead": False}),
    "async": ("async", {}),
    "sync": ("sync", {}),
}


def _time_split(res) -> tuple[list[list[float]], float]:
    """Per rank [head, between, tail] idle seconds, and the longest boundary wait (ms)."""
    first: dict[int, float] = {}
    last: dict[int, tuple[float, int]] = {}
    busy: dict[int, float] = {}
    boundary = 0.0
    for ev, end in batch_ends(res.events):
        r, dt = ev.rank, (ev.batch_ms + ev.data_ms) / 1000.0
        first.setdefault(r, end - dt)
        prev = last.get(r)
        if prev is not None and prev[1] != ev.epoch:
            boundary = max(boundary, (end - prev[0] - dt) * 1e3)
        last[r] = (end, ev.epoch)
        busy[r] = busy.get(r, 0.0) + dt
    split = [[first[r], last[r][0] - first[r] - busy[r], res.virtual_s - last[r][0]] for r in sorted(first)]
    return split, boundary


def run_rig(slow: list[float], policy: str, overrides: dict, args) -> dict:
    ms = tuple(args.compute_ms + args.base_ms * s for s in slow)
    effs, boundaries, splits = [], [], []
    for seed in range(args.seeds):
        res = simulate(SimConfig(ms_per_batch=ms, total_samples=args.samples, batch_size=args.batch_size,
                                 epochs=args.epochs, policy=policy, seed=seed, core_overrides=overrides))  # fmt: skip
        if not (res.finished and res.finished.ok):
            return {"error": f"seed {seed}: the run did not finish ok"}
        cov = res.summary["coverage"]
        if any(c["duplicates"] or c["missing"] for c in cov):
            return {"error": f"seed {seed}: coverage not exact: {cov}"}
        split, boundary = _time_split(res)
        effs.append(res.efficiency)
        boundaries.append(boundary)
        splits.append([[x / res.virtual_s for x in row] for row in split])
    med = [[statistics.median(s[r][k] for s in splits) for k in range(3)] for r in range(len(slow))]
    return {
        "efficiency": round(statistics.median(effs), 3),
        "efficiency_runs": [round(e, 3) for e in effs],
        "boundary_wait_ms": round(statistics.median(boundaries), 1),
        "idle_share": [{"head": round(h, 3), "between": round(b, 3), "tail": round(t, 3)} for h, b, t in med],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rigs", default="1,2,4;1,1,2,3,5,8", help="slowdown lists, ';'-separated")
    ap.add_argument("--policies", default=",".join(POLICIES), help=f"any of {','.join(POLICIES)}")
    ap.add_argument("--base-ms", type=float, default=10.0)
    ap.add_argument("--compute-ms", type=float, default=1.5, help="per-batch compute on top of the sleep")
    ap.add_argument("--samples", type=int, default=4096)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--seeds", type=int, default=5)
    args = ap.parse_args()
    names = [p for p in args.policies.split(",") if p]
    unknown = [p for p in names if p not in POLICIES]
    if unknown:
        ap.error(f"unknown policies {unknown}; expected {list(POLICIES)}")
    rigs = []
    for rig in [r.strip() for r in args.rigs.split(";") if r.strip()]:
        slow = [float(x) for x in rig.split(",")]
        rigs.append({"slowdown": rig, **{p: run_rig(slow, *POLICIES[p], args) for p in names}})
    print(json.dumps({"bench": "sim_hetero", "samples": args.samples, "epochs": args.epochs,
                      "batch_size": args.batch_size, "seeds": args.seeds, "rigs": rigs}, indent=2))  # fmt: skip


if __name__ == "__main__":
    main()
