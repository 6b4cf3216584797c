"""Elastic membership: what a join costs and what it buys, and churn campaigns.

Three modes, one JSON object on stdout:

``--sim`` (virtual time, fast): ``flodl.sim._churn.churn_case`` over ``--seeds`` seeds
per policy -- late joins, a host that never comes, killed ranks restarted by their agent,
coordinator restarts -- counting runs exactly-once or not, joins, restarts, joiners that
trained before their seed (goal 0), samples lost / doubled (goal 0 / 0), and Sync's trims
(``repartition``: sent, how they ended, samples moved to joiners).

default (real processes on loopback): a coordinator (``--max-ranks 4 --min-ranks 2``),
one agent with two ranks slowed ``--slow`` x ``--base-ms`` per batch, and, once the world
formed, a second agent with two unslowed ranks that join the running world. Read from
the summary and the journal, per run:

* ``hello_to_seeded_s`` / ``hello_to_first_commit_s`` per joiner: from its hello to its
  ``Timing.seeded``, and to the first ``sync_ack`` that folds a step of its own;
* ``seed_bytes`` and ``seeds_sent`` (the transfer), ``seed_s`` (admission -> seeded);
* ``repartition`` (Sync): the trims that gave the joiners a share of the live epoch;
* throughput before / after the join: committed samples per second over the epochs
  trained by the first two ranks only, and over those the joiners trained in, and their
  ratio (the peer measured in the same run is the world before the join).

``--planes bus,collective`` runs the same scenario on each data plane, interleaved run by
run (the bus join is the collective join's peer, measured under the same load). On the
collective plane the joiners are seeded by a broadcast in a new generation instead of a
consensus from the coordinator: ``seed_bytes`` / ``broadcast_s`` are then the joiners'
own log lines (``joined the running world ... broadcast in Xs (N bytes)``: the f32
payload, and launch -> completion seen on the joiner), and ``generations`` the group's.

``--broadcast`` (gloo alone, ``--ranks`` processes on loopback): the seed broadcast's
cost by payload size (``--sizes``, f32 elements) next to its peer, an all-reduce of the
same buffer in the same group (what every round costs): medians of ``--reps``.

Medians over ``--runs`` runs. The machine may be shared: ratios from the same run stay
meaningful; absolute seconds include process start-up under that load.

``--churn`` (real processes, several minutes): ``--ranks`` ranks (6) over two agents with
``--max-restarts``, the synthetic task sized by ``--samples`` / ``--epochs``, and a fault
every ``--every`` s (10, +- 20 %) from a seeded schedule (``churn_plan``; a kill or a stop
strikes only while at least half the ranks train besides its victim): kill -9 of a
training rank (its agent restarts it, it rejoins), SIGSTOP of one past the liveness
timeout then SIGCONT or SIGKILL, a third agent joining with ``--join-ranks`` more ranks,
and that host leaving (SIGTERM to its agent, once its ranks trained). The same run
without faults, measured first in the same invocation, is the baseline. Reported:

* ``goodput_ratio``: committed samples per second (world's first batch -> last commit)
  of the churn run over the baseline's;
* ``samples_lost`` / ``samples_doubled`` (goal 0 / 0): the summary's coverage, and the
  ranks' own traces (``never_trained``; ``trained_again``, which a dead rank's discarded
  windows explain up to ``discarded_samples`` + one batch per death);
* per fault: ``detection_s`` (the fault -> the core's decision that the rank is gone, from
  a replay of the journal), ``recovery_s`` (the fault -> the survivors training at full
  rate again, defined in ``churn_plan``; goal for a kill the agent reports: <= 2 x the
  heartbeat interval), ``stall_s`` (the survivors' longest batch gap meanwhile), and for a
  kill or a join the join times of the rank(s) that (re)joined;
* ``by_kind``: medians per kind; ``join_times``: every seeded joiner.

``--quick`` is a short one to see it work: 4 ranks, kills and stops only (a joining host
would not have started yet), a fault every ~2.5 s, ~10 s of training per run; process
start-up (twice: the baseline, then the churn run) is most of its wall time, about 30 s on
an idle 2-core machine and more under load.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from churn_report import churn, churn_args

ROOT = Path(__file__).resolve().parents[1]

# A joiner's line on the collective plane (flodl_worker.collective).
_BROADCAST = re.compile(r"joined the running world: parameters and buffers from the generation \d+ broadcast "
                        r"in ([0-9.]+)s \((\d+) bytes\)")  # fmt: skip


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _sim(seeds: int, policies: list[str]) -> dict:
    from flodl.sim._churn import churn_case

    out: dict = {"bench": "elastic", "mode": "sim", "seeds": seeds, "policies": {}}
    for policy in policies:
        t0 = time.perf_counter()
        cases = [churn_case(seed, policy) for seed in range(seeds)]
        lost = doubled = 0
        for c in cases:
            for cov in c.result.summary.get("coverage", []):
                lost += cov["missing"]
                doubled += cov["duplicates"]
        bad = [c.describe() for c in cases if not c.exact]
        trims: dict = {}  # Sync re-partitions for joiners: trims sent, how they ended, samples moved
        for c in cases:
            for k, v in c.result.summary.get("elastic", {}).get("repartition", {}).items():
                trims[k] = trims.get(k, 0) + v
        out["policies"][policy] = {
            "exact": len(cases) - len(bad),
            "failed": len(bad),
            "joins": sum(c.joins for c in cases),
            "rank_restarts": sum(c.result.respawns for c in cases),
            "coordinator_restarts": sum(c.result.restarts for c in cases),
            "joiners_trained_unseeded": sum(len(c.result.violations) for c in cases),
            "samples_lost": lost,
            "samples_doubled": doubled,
            "repartition": trims,
            "wall_s": round(time.perf_counter() - t0, 2),
            "failures": bad[:10],
        }
    out["ok"] = all(p["failed"] == 0 for p in out["policies"].values())
    return out


def _wait_for(path: Path, text: str, proc: subprocess.Popen, deadline_s: float = 300.0) -> None:
    t_end = time.monotonic() + deadline_s
    while time.monotonic() < t_end:
        if path.exists() and text in path.read_text():
            return
        if proc.poll() is not None:
            raise RuntimeError(f"coordinator exited before {text!r}")
        time.sleep(0.1)  # polling another process's log
    raise RuntimeError(f"never saw {text!r}")


def _one_run(args, tmp: Path, plane: str = "bus") -> dict:
    port = _free_port()
    endpoint = f"tcp://127.0.0.1:{port}"
    summary, journal, log = tmp / "summary.json", tmp / "journal", tmp / "coordinator.log"
    coord = subprocess.Popen(
        [sys.executable, "-m", "flodl_coordinator", "serve", "--bind", endpoint, "--session", "bench-elastic",
         "--max-ranks", "4", "--min-ranks", "2", "--join-timeout", "0", "--epochs", str(args.epochs),
         "--batch-size", "16", "--policy", args.policy, "--summary", str(summary), "--journal", str(journal),
         "--plane", plane],
        cwd=ROOT, stdout=open(log, "w"), stderr=subprocess.STDOUT,
    )  # fmt: skip

    def agent(*extra: str) -> subprocess.Popen:
        cmd = [sys.executable, "-m", "flodl_worker", "agent", "--coordinator", endpoint, "--session", "bench-elastic",
               "--world-size", "4", "--base-ms", str(args.base_ms), *extra, "--", sys.executable, "-m",
               "flodl_worker.examples.digits"]  # fmt: skip
        return subprocess.Popen(cmd, cwd=ROOT, stdout=open(tmp / f"agent{len(procs)}.log", "w"), stderr=subprocess.STDOUT)

    procs: list[subprocess.Popen] = [coord]
    procs.append(agent("--ranks", "2", "--rank-offset", "0", "--slowdown", str(args.slow)))
    try:
        _wait_for(log, "world_formed", coord)
        procs.append(agent("--ranks", "2", "--slowdown", "1"))  # unpinned: the free slots 2, 3
        coord.wait(timeout=args.timeout)
        for p in procs[1:]:
            p.wait(timeout=60)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    data = json.loads(summary.read_text())
    events = [json.loads(line) for line in journal.read_text().splitlines() if line.startswith("{")]
    # When each joiner's hello was admitted (the core's clock, as the journal's): the
    # second agent pins no rank, so its journaled hellos name none -- the core's join
    # records say which slot each got.
    hello_at = {j["rank"]: j["admitted_at"] for j in data.get("elastic", {}).get("joins", [])}
    seeded_at: dict[int, float] = {}
    first_commit: dict[int, float] = {}
    for ev in events:
        t, r = ev.get("type"), ev.get("rank")
        if t == "JoinerSeeded":
            seeded_at.setdefault(r, ev["now"])
        elif t == "SyncAcked" and r in seeded_at and ev.get("step_count", 0) > 0:
            first_commit.setdefault(r, ev["now"])
    epochs = data["epochs"]
    before = [e for e in epochs if not any(e["per_rank_throughput"][2:])]
    after = [e for e in epochs if all(e["per_rank_throughput"][2:])]
    total = data["total_samples"]

    def rate(rows):
        ms = sum(e["epoch_ms"] for e in rows)
        return total * len(rows) / (ms / 1e3) if ms > 0 else None

    r_before, r_after = rate(before), rate(after)
    if plane == "collective":
        lines = _BROADCAST.findall((tmp / "agent2.log").read_text())
        seed_bytes, seeds_sent = sum(int(b) for _, b in lines), len(lines)
        seed_extra = {"broadcast_s": [float(s) for s, _ in lines], "generations": data["collective"]["generation"]}
    else:
        seed_bytes, seeds_sent = data["bus"].get("seed_bytes", 0), data["bus"].get("seeds_sent", 0)
        seed_extra = {}
    return {
        "plane": plane,
        "ok": data["ok"],
        "exact": all(c["trained"] == c["expected"] and c["duplicates"] == 0 for c in data["coverage"]),
        "joins": len(data.get("elastic", {}).get("joins", [])),
        "hello_to_seeded_s": {r: round(seeded_at[r] - hello_at[r], 3) for r in seeded_at if r in hello_at},
        "hello_to_first_commit_s": {r: round(first_commit[r] - hello_at[r], 3) for r in first_commit if r in hello_at},
        "seed_bytes": seed_bytes,
        "seeds_sent": seeds_sent,
        **seed_extra,
        "repartition": data.get("elastic", {}).get("repartition"),  # Sync: the joiners' share of the live epoch
        "samples_per_s_before": r_before and round(r_before, 1),
        "samples_per_s_after": r_after and round(r_after, 1),
        "after_over_before": round(r_after / r_before, 2) if r_before and r_after else None,
    }


def _medians(runs: list[dict]) -> dict:
    def med(key):
        vals = [r[key] for r in runs if r.get(key) is not None]
        return statistics.median(vals) if vals else None

    def med_map(key):
        vals = [v for r in runs for v in r[key].values()]
        return round(statistics.median(vals), 3) if vals else None

    out = {
        "hello_to_seeded_s": med_map("hello_to_seeded_s"),
        "hello_to_first_commit_s": med_map("hello_to_first_commit_s"),
        "seed_bytes_per_join": (med("seed_bytes") or 0) / 2,
        "after_over_before": med("after_over_before"),
    }
    broadcasts = [s for r in runs for s in r.get("broadcast_s", [])]
    if broadcasts:
        out["broadcast_s"] = round(statistics.median(broadcasts), 4)
    return out


def _gloo_worker(rank: int, size: int, port: int, sizes: list[int], reps: int, out) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, size, rank == 0, timedelta(seconds=120))
    group = dist.ProcessGroupGloo(dist.PrefixStore("bench", store), rank, size, timedelta(seconds=120))
    rows = []
    for n in sizes:
        buf = torch.ones(n, dtype=torch.float32)
        times: dict[str, list[float]] = {"broadcast": [], "allreduce": []}
        for _ in range(reps + 1):  # the first of each is a warm-up
            opts = dist.BroadcastOptions()
            opts.rootRank, opts.rootTensor = 0, 0
            t0 = time.perf_counter()
            group.broadcast([buf], opts).wait()
            times["broadcast"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            group.allreduce([buf]).wait()
            times["allreduce"].append(time.perf_counter() - t0)
        rows.append({"elements": n, "bytes": 4 * n,
                     **{f"{k}_s": statistics.median(v[1:]) for k, v in times.items()}})  # fmt: skip
    if rank == 0:
        out.put(rows)


def _broadcast(args) -> dict:
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    sizes = [int(float(s)) for s in args.sizes.split(",")]
    procs = [ctx.Process(target=_gloo_worker, args=(r, args.ranks, port, sizes, args.reps, q)) for r in range(args.ranks)]
    for p in procs:
        p.start()
    rows = q.get(timeout=args.timeout)
    for p in procs:
        p.join(timeout=60)
    for row in rows:
        row["broadcast_over_allreduce"] = round(row["broadcast_s"] / row["allreduce_s"], 2) if row["allreduce_s"] else None
        row["broadcast_s"], row["allreduce_s"] = round(row["broadcast_s"], 5), round(row["allreduce_s"], 5)
    return {"bench": "elastic", "mode": "broadcast", "backend": "gloo", "ranks": args.ranks, "reps": args.reps,
            "sizes": rows, "note": "loopback, one machine; the all-reduce of the same buffer is the peer"}  # fmt: skip


def _real(args) -> dict:
    planes = args.planes.split(",")
    runs = []
    for i in range(args.runs):
        for plane in planes:  # interleaved: each plane's peer ran under the same load
            with tempfile.TemporaryDirectory(prefix="flodl-bench-elastic-") as tmp:
                runs.append(_one_run(args, Path(tmp), plane))
    by_plane = {p: [r for r in runs if r["plane"] == p] for p in planes}
    medians = {p: _medians(rs) for p, rs in by_plane.items()}
    out = {
        "bench": "elastic", "mode": "processes", "policy": args.policy, "runs": runs, "epochs": args.epochs,
        "median": medians[planes[0]] if len(planes) == 1 else medians,
        "ok": all(r["ok"] and r["exact"] and r["joins"] == 2 for r in runs),
        "note": "loopback, one machine; absolute times include process start-up under the machine's load",
    }
    if {"bus", "collective"} <= set(planes):
        b, c = medians["bus"]["hello_to_first_commit_s"], medians["collective"]["hello_to_first_commit_s"]
        out["collective_over_bus_hello_to_first_commit"] = round(c / b, 2) if b and c else None
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sim", action="store_true", help="the simulated churn campaign instead of real processes")
    ap.add_argument("--churn", action="store_true", help="the real-process churn campaign (goodput, recovery)")
    churn_args(ap)
    ap.add_argument("--seeds", type=int, default=500, help="--sim: seeds per policy")
    ap.add_argument("--policies", default="sync,cadence,async", help="--sim: policies")
    ap.add_argument("--policy", default="cadence", help="processes: the averaging policy (sync or cadence on collective)")
    ap.add_argument("--planes", default="bus", help="processes: data planes to run, interleaved (bus,collective)")
    ap.add_argument("--runs", type=int, default=3, help="processes: runs (medians)")
    ap.add_argument("--epochs", type=int, default=None, help="default 20 (joins); --churn 50, quick 12")
    ap.add_argument("--slow", type=float, default=60.0, help="processes: the first agent's slowdown factor")
    ap.add_argument("--base-ms", type=float, default=None, help="emulated ms per batch: default 1 (joins), 20 (--churn)")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds a run may take (--churn: each; quick 120)")
    ap.add_argument("--broadcast", action="store_true", help="gloo's seed broadcast vs an all-reduce, by payload size")
    ap.add_argument("--sizes", default="5e3,1e6,1e7", help="--broadcast: f32 elements per payload")
    ap.add_argument("--ranks", type=int, default=None,
                    help="--broadcast: group size (3); --churn: ranks over the two agents (6; quick 4)")
    ap.add_argument("--reps", type=int, default=5, help="--broadcast: timed repetitions per size (medians)")
    args = ap.parse_args()
    if not args.churn:
        args.epochs = 20 if args.epochs is None else args.epochs
        args.base_ms = 1.0 if args.base_ms is None else args.base_ms
        args.ranks = 3 if args.ranks is None else args.ranks
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    if args.churn:
        out = churn(args)
    elif args.broadcast:
        out = _broadcast(args)
    else:
        out = _sim(args.seeds, args.policies.split(",")) if args.sim else _real(args)
    print(json.dumps(out, indent=2))
    if args.churn and not out["ok"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
