"""Coordinator restarts in the simulator: a large seeded campaign, exactly-once or not.

Each seed draws a small world (3 ranks of mixed speeds, 96-240 samples, 2 epochs,
network latency and down time), runs it clean to learn its journal length, then kills
the coordinator at ``--crashes`` journal positions drawn from the seed and restarts it
from the journal prefix (``flodl.core.replay`` + ``CoordinatorRestarted``), with the
real rank machines (``flodl.rank``) resyncing. CI runs 240 seeds
(tests/sim/test_sim_restart.py); this runs as many as you ask.

Prints one JSON object: per policy, seeds run, exact, failures (seed, crash points,
why), restarts, frames lost in flight, and wall time.
"""

from __future__ import annotations

import argparse
import json
import time

from flodl.sim._restart import restart_case


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=2000, help="seeds per policy")
    ap.add_argument("--crashes", type=int, default=1, help="coordinator kills per run")
    ap.add_argument("--policies", default="sync,cadence,async")
    args = ap.parse_args()
    out: dict = {"bench": "sim_restart", "seeds": args.seeds, "crashes": args.crashes, "policies": {}}
    for policy in args.policies.split(","):
        t0 = time.perf_counter()
        failures, restarts, lost, exact = [], 0, 0, 0
        for seed in range(args.seeds):
            c = restart_case(seed, policy, crashes=args.crashes)
            restarts += c.result.restarts
            lost += c.result.lost_frames
            if c.exact:
                exact += 1
            else:
                failures.append(c.describe())
        out["policies"][policy] = {
            "exact": exact,
            "failed": len(failures),
            "restarts": restarts,
            "lost_frames": lost,
            "wall_s": round(time.perf_counter() - t0, 2),
            "failures": failures[:20],
        }
    out["ok"] = all(p["failed"] == 0 for p in out["policies"].values())
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
