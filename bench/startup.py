"""Start and stop: `make demo`'s run with the ranks forked from the prefork server and,
beside it in the same sitting, with every rank a fresh process (``--no-prefork``, the
peer: what every run did before).

Each run is ``flodl run --local`` on the demo's rig (3 digits ranks, 1,2,4, cadence;
``--epochs``), interleaved mode by mode so a drifting load moves both. Per run, from the
launcher's summary and its own clock:

* ``launcher_wall_s``: the whole command, start to exit;
* ``time_to_first_batch_s``: the launcher's start to the coordinator's first batch;
* ``train_s``: first batch to last batch (the coordinator's timeline);
* ``teardown_s``: the run's end to the launcher's exit;
* ``overhead_share``: the wall time that was not training, over the wall time;
* ``user_cpu_s``: CPU the run's processes spent (children of this bench, user + system);
* ``accuracy``: held-out digits accuracy (the same work is done either way).

``--peer PATH`` adds a third mode, ``peer``: the same command from another checkout
(``PYTHONPATH`` = its three package roots, this interpreter), e.g. the code before a
change, measured in the same sitting.

Prints one JSON object: per mode the runs and their medians, and the ratios of the
medians to the fresh ones (and to the peer's). Noisy machine: compare the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

from benchproc import peer_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODES = {"prefork": [], "fresh": ["--no-prefork"]}
FIELDS = ("launcher_wall_s", "time_to_first_batch_s", "train_s", "teardown_s", "overhead_share", "user_cpu_s")


def run_once(extra: list[str], epochs: int, peer: str | None = None) -> dict:
    env, cwd = dict(os.environ), ROOT
    if peer is not None:
        env, cwd = peer_env(peer), peer
    with tempfile.TemporaryDirectory() as tmp:
        summary_path = os.path.join(tmp, "summary.json")
        cmd = [
            sys.executable, "-m", "flodl", "run", "--local", "--ranks", "3", "--task", "digits",
            "--slowdown", "1,2,4", "--epochs", str(epochs), "--policy", "cadence", "--quiet",
            "--summary", summary_path, *extra,
        ]  # fmt: skip
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t = time.perf_counter()
        proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
        wall = time.perf_counter() - t
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        if proc.returncode != 0:
            raise SystemExit(f"bench/startup: {' '.join(cmd)} exited {proc.returncode}:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
        with open(summary_path, encoding="utf-8") as fh:
            s = json.load(fh)
    tl = s["timeline_s"]
    train = tl["last_batch"] - tl["first_batch"]
    return {
        "launcher_wall_s": round(wall, 3),
        "time_to_first_batch_s": s["time_to_first_batch_s"],
        "train_s": round(train, 3),
        "teardown_s": s["teardown_s"],
        "overhead_share": round(1.0 - train / wall, 3),
        "user_cpu_s": round((after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), 3),
        "accuracy": s.get("accuracy"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--epochs", type=int, default=12, help="the demo's 12")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--peer", metavar="PATH", help="another checkout, run the same way (e.g. the code before)")
    a = ap.parse_args()
    modes = dict(MODES)
    if a.peer:
        modes["peer"] = []
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    for _ in range(a.repeats):
        for mode, extra in modes.items():
            runs[mode].append(run_once(extra, a.epochs, os.path.abspath(a.peer) if mode == "peer" else None))
    out: dict = {"rig": "3 digits ranks, slowdown 1,2,4, cadence", "epochs": a.epochs, "repeats": a.repeats}
    for mode in modes:
        med = {f: round(statistics.median(r[f] for r in runs[mode]), 3) for f in FIELDS}
        out[mode] = {"median": med, "runs": runs[mode]}
    for over in ("fresh", "peer") if a.peer else ("fresh",):
        for mode in modes:
            if mode != over:
                out[f"{mode}_over_{over}"] = {
                    f: round(out[mode]["median"][f] / out[over]["median"][f], 3)
                    for f in FIELDS if out[over]["median"][f]  # fmt: skip
                }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
