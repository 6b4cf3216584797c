"""The bus reducer's cost per contribution as the round grows.

For each N, ``BusReducer`` opens a round of N ranks and takes N contributions of a small
model (``--floats`` f32 values each, as ``pack_round`` writes them): the first N-1 are
timed together (``us_per_contribution``: checks, decoding, bookkeeping -- what every
rank's frame costs the coordinator's loop), the last one alone (``finish_ms``: the
weighted sum and the consensus, once per round). CPU time (``time.thread_time``), the
median of ``--repeats``. ``growth`` is the largest N's µs per contribution over the
smallest's: 1.0 when a contribution's cost does not depend on the round's size.

``--peer PATH`` runs the same sizes, in the same sitting, in a subprocess with another
checkout on its path (the code before), and adds its rows beside ours. Prints one JSON
object.

    python bench/reducer_scale.py
    python bench/reducer_scale.py --peer /work/wt/base --sizes 256,1024,4096,16384
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from benchproc import peer_env


def measure(n: int, floats: int, repeats: int) -> dict:
    import numpy as np

    from flodl.wire import pack_round
    from flodl_coordinator.reducer import BusReducer

    parts = [pack_round([np.full((floats,), 1.0, dtype=np.float32)], cycle=1, weight=1.0) for _ in range(n)]
    each, finish = [], []
    for _ in range(repeats):
        red = BusReducer()
        red.open(1, range(n))
        t0 = time.thread_time()
        for r in range(n - 1):
            red.contribute(r, *parts[r])
        t1 = time.thread_time()
        result = red.contribute(n - 1, *parts[n - 1])
        t2 = time.thread_time()
        assert result is not None and len(result.to) == n, "the round did not complete with every rank"
        each.append((t1 - t0) / max(1, n - 1) * 1e6)
        finish.append((t2 - t1) * 1e3)
    return {"us_per_contribution": round(statistics.median(each), 2), "finish_ms": round(statistics.median(finish), 3)}


def curve(sizes: list[int], floats: int, repeats: int) -> dict:
    rows = {str(n): measure(n, floats, repeats) for n in sizes}
    first, last = rows[str(sizes[0])], rows[str(sizes[-1])]
    return {"by_n": rows, "growth": round(last["us_per_contribution"] / first["us_per_contribution"], 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="256,1024,4096", help="round sizes (ranks), comma-separated, ascending")
    ap.add_argument("--floats", type=int, default=64, help="f32 values in each contribution")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--peer", default="", help="another checkout to measure beside this one")
    ap.add_argument("--curve-only", action="store_true", help=argparse.SUPPRESS)  # the peer's side
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    ours = curve(sizes, args.floats, args.repeats)
    if args.curve_only:
        print(json.dumps(ours))
        return
    out = {"bench": "reducer_scale", "floats": args.floats, "repeats": args.repeats, "ours": ours}
    if args.peer:
        peer = os.path.abspath(args.peer)
        env = peer_env(peer)
        cmd = [sys.executable, os.path.abspath(__file__), "--sizes", args.sizes, "--floats", str(args.floats),
               "--repeats", str(args.repeats), "--curve-only"]  # fmt: skip
        got = subprocess.run(cmd, env=env, cwd=peer, capture_output=True, text=True, timeout=1800)
        if got.returncode != 0:
            out["peer"] = {"path": peer, "error": got.stderr[-2000:]}
        else:
            theirs = json.loads(got.stdout)
            out["peer"] = {"path": peer, **theirs}
            out["peer_over_ours"] = {
                n: round(theirs["by_n"][n]["us_per_contribution"] / ours["by_n"][n]["us_per_contribution"], 2)
                for n in ours["by_n"]
            }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
