"""What the operator view costs the coordinator's loop, per world size.

Peer (same run, same state): ``flodl.core.status_view``, the core's own walk over the
ranks that /status always cost. Measured: the whole per-tick publish
(``StatusBoard.update``: the /status document and the /metrics sample) and one scrape
(``prometheus_client.generate_latest`` over the collector), each the median of
``--repeat`` runs, in milliseconds of this process's CPU time (``time.process_time``: on
a loaded machine wall time mostly measures the other processes), with the ratio to the
peer. The service rebuilds at
most every 0.25 s and within 1/20 of its time (``service.PUBLISH_COST_SHARE``), so
``publish_ms * 4`` bounds the share of a second it can take at the minimum interval.

    python bench/status_cost.py --worlds 64,1024,4096 --repeat 15
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from flodl.core import CoreConfig, initial_state, status_view
from flodl.wire import pb
from flodl_coordinator.metrics import RunBook
from flodl_coordinator.reducer import BusReducer
from flodl_coordinator.status import StatusBoard


def _median_ms(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.process_time()
        fn()
        times.append(time.process_time() - t)
    return statistics.median(times) * 1e3


def measure(world: int, repeat: int) -> dict:
    st = initial_state(CoreConfig(world_size=world))
    board = StatusBoard(RunBook("bench", 64))
    for r in range(world):  # every rank admitted and reporting its time account
        st.ranks[r].incarnation = r + 1
        board.book.time_account(r, r + 1, pb.TimeAccount(training_s=1.0, startup_s=0.5, wall_s=1.5))
    reducer = BusReducer()
    peer = _median_ms(lambda: status_view(st), repeat)
    publish = _median_ms(lambda: board.update(st, {}, reducer), repeat)
    scrape = _median_ms(board.prometheus, repeat)
    return {"world": world, "status_view_ms": round(peer, 3), "publish_ms": round(publish, 3),
            "scrape_ms": round(scrape, 3), "publish_over_status_view": round(publish / peer, 1) if peer else None,
            "publish_share_at_min_interval": round(publish / 250.0, 4)}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worlds", default="64,1024", help="comma-separated world sizes")
    ap.add_argument("--repeat", type=int, default=15)
    args = ap.parse_args()
    rows = [measure(int(w), args.repeat) for w in args.worlds.split(",")]
    print(json.dumps({"bench": "status_cost", "repeat": args.repeat, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
