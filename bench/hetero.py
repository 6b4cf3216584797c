"""Heterogeneous rig benchmark: flodl sync / cadence / async / collective against torch DDP.

A rig: one rank per entry of its slowdown list on this machine (each batch additionally
sleeps ``base_ms x factor``), the synthetic task (same model, batch size and step function
everywhere). ``--rigs`` runs several in one invocation (default: the 1,2,4 rig and the
6-rank 1,1,2,3,5,8 rig, where ElChe's windows grow to most of an epoch). Measured per rig,
side by side:

* solo: each rank's throughput training alone (the ceiling is their sum), measured
  before each repeat of the modes (interleaved, so a drifting load moves both), median;
* flodl sync, cadence and async: ``flodl run --local`` (real coordinator, relay, ranks),
  on the bus plane; ``cadence_barrier`` (on request) is cadence with ``run_ahead`` off,
  the default before issue 11;
* flodl collective: cadence with ``--plane collective`` (torch.distributed all-reduce,
  the coordinator only orchestrates) -- reported as skipped, with the reason, when this
  checkout's ``flodl run`` does not accept ``--plane`` yet;
* torch DDP (gloo) on the same emulation (``bench/ddp_peer.py``).

Per mode: the median throughput of ``--repeats`` runs (each run's too), ``efficiency`` =
throughput / sum of solo throughputs, ``vs_ddp`` = throughput / DDP's median.
``rank_busy_share`` = each rank's samples per second of the run over its solo rate (1.0: it
never waited; below that it idled, or the machine slowed it). ``round_open_share`` = the
share of the run's wall time during which an averaging round was open (under cadence
rounds overlap the next window, so this is not idle time); ``exposed_averaging_share`` =
the share during which every rank had finished its window and waited for the round
(ElChe's measure); ``plan_wait_share`` / ``rank_wait_share`` = the time the ranks (each rank)
waited for a plan over the time they trained or waited (the summary's, measured by the
ranks). Then the digits task at an equal sample budget (same epochs) for
accuracy: every flodl mode (async included) vs DDP, and the gap in points.

Prints one JSON object. Noisy machine: compare the ratios, which are measured against
peers in the same invocation.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
import ddp_peer  # noqa: E402

from flodl_worker.examples._common import classification_step, mlp  # noqa: E402
from flodl_worker.examples.synthetic import generate  # noqa: E402


def solo(slow: float, base_ms: float, batch: int, batches: int = 60) -> float:
    torch.set_num_threads(1)
    train, *_ = generate(4096, 1024, 32, 4, 0)
    torch.manual_seed(0)
    model = mlp(32, 64, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    x, y = train.tensors
    t0 = time.perf_counter()
    for i in range(batches):
        j = (i * batch) % (len(train) - batch)
        classification_step(model, opt, (x[j : j + batch], y[j : j + batch]))
        time.sleep(base_ms * slow / 1000.0)
    return batches * batch / (time.perf_counter() - t0)


# mode -> (policy, extra ``flodl run`` flags)
MODES = {
    "sync": ("sync", []),
    "cadence": ("cadence", []),
    "cadence_barrier": ("cadence", ["--no-run-ahead"]),  # run_ahead off: the default before issue 11
    "async": ("async", []),
    "collective": ("cadence", ["--plane", "collective"]),
}


def run_accepts(flag: str) -> bool:
    """Whether this checkout's ``flodl run`` has ``flag`` (the collective plane is new)."""
    p = subprocess.run([sys.executable, "-m", "flodl", "run", "--help"], capture_output=True, text=True, timeout=120)
    return flag in p.stdout


def flodl_run(task: str, policy: str, args, extra: list[str] | None = None, solos: list[float] | None = None) -> dict:
    with tempfile.TemporaryDirectory() as d:
        summary = os.path.join(d, "s.json")
        cmd = [
            sys.executable, "-m", "flodl", "run", "--local", "--quiet", "--ranks", str(len(args.slow)),
            "--task", task, "--slowdown", args.slowdown, "--base-ms", str(args.base_ms),
            "--epochs", str(args.epochs), "--batch-size", str(args.batch_size), "--policy", policy,
            "--summary", summary, *(extra or []),
        ]  # fmt: skip
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        if p.returncode != 0 or not os.path.exists(summary):
            return {"error": (p.stdout + p.stderr)[-1500:]}
        s = json.load(open(summary))
    wall = s.get("wall_s") or 0.0
    avg_s = s.get("averaging_s")
    busy = None
    if solos and wall:
        samples = [r.get("samples", 0) for r in sorted(s.get("ranks", []), key=lambda r: r["rank"])]
        busy = [round(n / wall / solo, 3) for n, solo in zip(samples, solos)]
    return {
        "samples_per_s": s.get("samples_per_s"),
        "wall_s": wall,
        "averages": s.get("averages"),
        "averages_per_epoch": round(s.get("averages", 0) / max(1, s.get("epochs_completed", 1)), 2),
        "round_open_share": round(avg_s / wall, 4) if (avg_s is not None and wall) else None,
        "exposed_averaging_share": (
            round((s.get("elche") or {}).get("exposed_sync_s", 0.0) / wall, 4) if (s.get("elche") and wall) else None
        ),
        "rank_busy_share": busy,
        # The ranks' own measure of their idling: the time they waited for a plan over the
        # time they trained or waited (the summary's, from their batches' wait_ms).
        "plan_wait_share": s.get("plan_wait_share"),
        "rank_wait_share": [round(r["wait_s"] / (r["train_s"] + r["wait_s"]), 3) if r.get("train_s") else None
                            for r in sorted(s.get("ranks", []), key=lambda r: r["rank"])],  # fmt: skip
        "accuracy": s.get("accuracy"),
        "exact_coverage": all(c["duplicates"] == 0 and c["missing"] == 0 for c in s.get("coverage", [])),
        "elche": s.get("elche"),
    }


def ddp_run(task: str, args) -> dict:
    a = ddp_peer.parser().parse_args([
        "--task", task, "--ranks", str(len(args.slow)), "--slowdown", args.slowdown,
        "--base-ms", str(args.base_ms), "--epochs", str(args.epochs), "--batch-size", str(args.batch_size),
    ])  # fmt: skip
    return ddp_peer.run(a)


def median_of(runs: list[dict], key: str):
    xs = [r[key] for r in runs if isinstance(r.get(key), (int, float))]
    return statistics.median(xs) if xs else None


def bench_rig(slowdown: str, names: list[str], skipped: dict, args) -> dict:
    """One rig: solos, every mode and DDP (``--repeats`` each), then digits accuracy."""
    args.slowdown, args.slow = slowdown, [float(x) for x in slowdown.split(",")]
    args.epochs = args.train_epochs
    res: dict = {"rig": {"slowdown": slowdown, "ranks": len(args.slow), "base_ms": args.base_ms,
                         "batch_size": args.batch_size, "epochs": args.epochs, "task": "synthetic"}}  # fmt: skip
    # Interleaved: each repeat measures the solos, then runs every mode once, so a load
    # that drifts during the bench moves the ceiling and the runs alike.
    solo_runs: list[list[float]] = []
    per_mode: dict[str, list[dict]] = {name: [] for name in names}
    for _ in range(args.repeats):
        solo_runs.append([solo(x, args.base_ms, args.batch_size) for x in args.slow])
        for name in names:
            policy, extra = MODES[name]
            per_mode[name].append(flodl_run("synthetic", policy, args, extra, solo_runs[-1]))
    solos = [statistics.median(run[r] for run in solo_runs) for r in range(len(args.slow))]
    res["solo_samples_per_s"] = [round(x, 1) for x in solos]
    res["solo_sum_runs"] = [round(sum(run), 1) for run in solo_runs]
    ceiling = sum(solos)
    res["solo_sum"] = round(ceiling, 1)
    modes: dict = {}
    for name in names:
        policy, extra = MODES[name]
        runs = per_mode[name]
        m = dict(runs[-1])
        m["samples_per_s"] = median_of(runs, "samples_per_s")
        m["runs_samples_per_s"] = [r.get("samples_per_s") for r in runs]
        m["exact_coverage"] = all(r.get("exact_coverage") for r in runs)
        m["errors"] = sum(1 for r in runs if "error" in r)
        m["runs"] = len(runs)
        m["policy"], m["plane"] = policy, "collective" if "--plane" in extra else "bus"
        modes[f"flodl_{name}"] = m
    ddps = [ddp_run("synthetic", args) for _ in range(args.repeats)]
    modes["torch_ddp_gloo"] = {"samples_per_s": median_of(ddps, "samples_per_s"), "runs": len(ddps),
                               "runs_samples_per_s": [d.get("samples_per_s") for d in ddps]}  # fmt: skip
    ddp_sps = modes["torch_ddp_gloo"]["samples_per_s"]
    for m in modes.values():
        sps = m.get("samples_per_s")
        m["efficiency"] = round(sps / ceiling, 3) if sps else None
        m["vs_ddp"] = round(sps / ddp_sps, 3) if (sps and ddp_sps) else None
    res["modes"] = {**modes, **skipped}
    if not args.skip_accuracy:
        args.epochs = args.accuracy_epochs
        acc: dict = {}
        for name in names:
            policy, extra = MODES[name]
            run = flodl_run("digits", policy, args, extra)
            acc[f"flodl_{name}"] = run.get("accuracy") if "error" not in run else {"error": run["error"][-300:]}
        acc.update({k: None for k in skipped})
        ddp_acc = ddp_run("digits", args)["accuracy"]
        acc["torch_ddp_gloo"] = ddp_acc
        gap = {k: round(100 * (v - ddp_acc), 2) for k, v in acc.items()
               if isinstance(v, float) and k != "torch_ddp_gloo"}  # fmt: skip
        res["digits_accuracy_equal_samples"] = {"epochs": args.epochs, "samples": args.epochs * 1437, **acc,
                                                "points_vs_ddp": gap}  # fmt: skip
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rigs", default="1,2,4;1,1,2,3,5,8", help="slowdown lists, one per rig, ';'-separated")
    ap.add_argument("--slowdown", help="one rig only (same as --rigs with one entry)")
    ap.add_argument("--base-ms", type=float, default=10.0)
    ap.add_argument("--epochs", dest="train_epochs", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--modes", default="sync,cadence,async,collective", help=f"any of {','.join(MODES)}")
    ap.add_argument("--policies", help="old name of --modes")
    ap.add_argument("--skip-accuracy", action="store_true")
    ap.add_argument("--accuracy-epochs", type=int, default=12, help="digits epochs for the accuracy comparison")
    args = ap.parse_args()
    rigs = [args.slowdown] if args.slowdown else [r.strip() for r in args.rigs.split(";") if r.strip()]
    for rig in rigs:
        try:
            if not all(float(x) > 0 for x in rig.split(",")):
                raise ValueError
        except ValueError:
            ap.error(f"rig {rig!r}: expected positive slowdown factors like 1,2,4")
    names = [m for m in (args.policies or args.modes).split(",") if m]
    unknown = [m for m in names if m not in MODES]
    if unknown:
        ap.error(f"unknown mode(s) {unknown}; expected {list(MODES)}")
    skipped: dict = {}
    if "collective" in names and not run_accepts("--plane"):
        skipped["flodl_collective"] = {"skipped": "`flodl run` does not accept --plane yet (collective plane not merged)"}
        names.remove("collective")
    res: dict = {"bench": "hetero", "repeats": args.repeats, "cpus": os.cpu_count(),
                 "load_avg_at_start": [round(x, 2) for x in os.getloadavg()],
                 "rigs": [bench_rig(rig, names, skipped, args) for rig in rigs]}  # fmt: skip
    res["load_avg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
