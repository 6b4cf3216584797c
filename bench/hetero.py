"""Heterogeneous rig benchmark: flodl sync / cadence / async / collective against torch DDP.

The rig: 3 ranks on this machine with emulated device speeds ``--slowdown 1,2,4``
(each batch additionally sleeps ``base_ms × factor``), the synthetic task (same model,
batch size and step function everywhere). Measured in one invocation:

* solo: each rank's throughput training alone (the ceiling is their sum);
* flodl sync, cadence and async: ``flodl run --local`` (real coordinator, relay, ranks),
  on the bus plane;
* flodl collective: cadence with ``--plane collective`` (torch.distributed all-reduce,
  the coordinator only orchestrates) -- reported as skipped, with the reason, when this
  checkout's ``flodl run`` does not accept ``--plane`` yet;
* torch DDP (gloo) on the same emulation (``bench/ddp_peer.py``).

Efficiency = throughput / Σ solo throughputs. ``round_open_share`` = the share of the
run's wall time during which an averaging round was open (under cadence rounds overlap
the next window, so this is not idle time); ``exposed_averaging_share`` = the share during
which every rank had finished its window and waited for the round (ElChe's measure). Then the digits task at an
equal sample budget (same epochs) for accuracy: every flodl mode (async included) vs DDP.

Prints one JSON object. Noisy machine: ``--repeats`` runs each mode and reports the
median.
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
    "async": ("async", []),
    "collective": ("cadence", ["--plane", "collective"]),
}


def run_accepts(flag: str) -> bool:
    """Whether this checkout's ``flodl run`` has ``flag`` (the collective plane is new)."""
    p = subprocess.run([sys.executable, "-m", "flodl", "run", "--help"], capture_output=True, text=True, timeout=120)
    return flag in p.stdout


def flodl_run(task: str, policy: str, args, extra: list[str] | None = None) -> dict:
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
    return {
        "samples_per_s": s.get("samples_per_s"),
        "wall_s": wall,
        "averages": s.get("averages"),
        "averages_per_epoch": round(s.get("averages", 0) / max(1, s.get("epochs_completed", 1)), 2),
        "round_open_share": round(avg_s / wall, 4) if (avg_s is not None and wall) else None,
        "exposed_averaging_share": (
            round((s.get("elche") or {}).get("exposed_sync_s", 0.0) / wall, 4) if (s.get("elche") and wall) else None
        ),
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--slowdown", default="1,2,4")
    ap.add_argument("--base-ms", type=float, default=10.0)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--modes", default="sync,cadence,async,collective", help=f"any of {','.join(MODES)}")
    ap.add_argument("--policies", help="old name of --modes")
    ap.add_argument("--skip-accuracy", action="store_true")
    ap.add_argument("--accuracy-epochs", type=int, default=12, help="digits epochs for the accuracy comparison")
    args = ap.parse_args()
    args.slow = [float(s) for s in args.slowdown.split(",")]
    names = [m for m in (args.policies or args.modes).split(",") if m]
    unknown = [m for m in names if m not in MODES]
    if unknown:
        ap.error(f"unknown mode(s) {unknown}; expected {list(MODES)}")
    skipped: dict = {}
    if "collective" in names and not run_accepts("--plane"):
        skipped["flodl_collective"] = {"skipped": "`flodl run` does not accept --plane yet (collective plane not merged)"}
        names.remove("collective")
    res: dict = {"bench": "hetero", "rig": {"slowdown": args.slowdown, "base_ms": args.base_ms,
                 "batch_size": args.batch_size, "epochs": args.epochs, "task": "synthetic"}}  # fmt: skip
    solos = [solo(s, args.base_ms, args.batch_size) for s in args.slow]
    res["solo_samples_per_s"] = [round(x, 1) for x in solos]
    ceiling = sum(solos)
    res["solo_sum"] = round(ceiling, 1)
    modes: dict = {}
    for name in names:
        policy, extra = MODES[name]
        runs = [flodl_run("synthetic", policy, args, extra) for _ in range(args.repeats)]
        m = dict(runs[-1])
        m["samples_per_s"] = median_of(runs, "samples_per_s")
        m["runs"] = len(runs)
        m["policy"], m["plane"] = policy, "collective" if "--plane" in extra else "bus"
        modes[f"flodl_{name}"] = m
    ddps = [ddp_run("synthetic", args) for _ in range(args.repeats)]
    modes["torch_ddp_gloo"] = {"samples_per_s": median_of(ddps, "samples_per_s"), "runs": len(ddps)}
    for m in modes.values():
        sps = m.get("samples_per_s")
        m["efficiency"] = round(sps / ceiling, 3) if sps else None
    res["modes"] = {**modes, **skipped}
    ddp_sps = modes["torch_ddp_gloo"]["samples_per_s"]
    res["speedup_vs_ddp"] = {k: round(v["samples_per_s"] / ddp_sps, 2) for k, v in modes.items()
                             if v.get("samples_per_s") and ddp_sps}  # fmt: skip
    if not args.skip_accuracy:
        args.epochs = args.accuracy_epochs
        acc = {}
        for name in names:
            policy, extra = MODES[name]
            run = flodl_run("digits", policy, args, extra)
            acc[f"flodl_{name}"] = run.get("accuracy") if "error" not in run else {"error": run["error"][-300:]}
        acc.update({k: None for k in skipped})
        acc["torch_ddp_gloo"] = ddp_run("digits", args)["accuracy"]
        res["digits_accuracy_equal_samples"] = {"epochs": args.epochs, "samples": args.epochs * 1437, **acc}
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
