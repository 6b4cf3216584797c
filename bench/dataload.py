"""Data loading that keeps up: a dataset whose ``__getitem__`` costs 1 ms, loaded inline
vs by worker processes (``run_rank(num_workers=...)``, ``flodl_worker.loader``).

Two measurements, each against its inline peer in the same invocation:

* ``loader``: one rank's training loop without the cluster -- the rank's own
  ``BatchLoader`` driven along a plan of batches (the epoch's permutation, as the rank
  machine hands them out), one SGD step of the synthetic task's MLP per batch -- for
  ``--workers`` 0 (inline) and each N given. Samples/s and the mean time a step waited
  for its batch (``data_ms``, what the rank reports). Two per-sample costs: ``busy``
  (a CPU-bound decode: needs free cores to parallelise) and ``sleep`` (I/O-like).
* ``run`` (``--e2e``): ``flodl run --local`` with the synthetic task's ``--sample-ms``
  (sleeping) dataset, inline vs ``--num-workers``; samples/s from the run summary, and that
  coverage stayed exact.

Medians of ``--repeats`` runs, ratios vs inline. Prints one JSON object.
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

import numpy as np
import torch
from torch.utils.data import Dataset

from flodl_worker.examples._common import classification_step, mlp
from flodl_worker.examples.synthetic import generate
from flodl_worker.loader import BatchLoader

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class CostlySamples(Dataset):
    """``__getitem__`` costs ``ms``: spinning (``busy``) or sleeping (``sleep``)."""

    def __init__(self, x, y, ms: float, kind: str) -> None:
        self.x, self.y, self.s, self.kind = x, y, ms / 1e3, kind

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i):
        if self.kind == "sleep":
            time.sleep(self.s)
        else:
            end = time.perf_counter() + self.s
            while time.perf_counter() < end:
                pass
        return self.x[i], self.y[i]


def loader_loop(samples: int, batch: int, ms: float, kind: str, workers: int) -> dict:
    torch.set_num_threads(1)
    train, *_ = generate(samples, 16, 32, 4, 0)
    ds = CostlySamples(*train.tensors, ms, kind)
    perm = np.random.default_rng(0).permutation(samples)
    plan = [(0, off, min(batch, samples - off)) for off in range(0, samples, batch)]
    pos = {"next": 0}
    loader = BatchLoader(
        ds, lambda e, o, c: perm[o : o + c], lambda n: plan[pos["next"] : pos["next"] + n], num_workers=workers
    )
    loader.start()
    torch.manual_seed(0)
    model = mlp(32, 64, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    waited = 0.0
    try:
        t0 = time.perf_counter()
        for key in plan:
            pos["next"] += 1  # the machine hands the batch out, then the rank asks for it
            a = time.perf_counter()
            b = loader.get(*key)
            waited += time.perf_counter() - a
            classification_step(model, opt, b)
        wall = time.perf_counter() - t0
    finally:
        loader.close()
    return {"samples_per_s": samples / wall, "data_ms_per_batch": 1e3 * waited / len(plan)}


def flodl_run(samples: int, batch: int, ms: float, workers: int, ranks: int) -> dict:
    with tempfile.TemporaryDirectory() as d:
        summary = os.path.join(d, "s.json")
        cmd = [
            sys.executable, "-m", "flodl", "run", "--local", "--ranks", str(ranks), "--task", "synthetic",
            "--epochs", "1", "--batch-size", str(batch), "--summary", summary, "--quiet", "--",
            "--samples", str(samples), "--test-samples", "64", "--sample-ms", str(ms), "--num-workers", str(workers),
        ]  # fmt: skip
        p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=600)
        if p.returncode != 0 or not os.path.exists(summary):
            return {"error": (p.stdout + p.stderr)[-2000:]}
        s = json.load(open(summary))
        exact = all(c["trained"] == c["expected"] and c["duplicates"] == 0 and c["missing"] == 0 for c in s["coverage"])
        return {"samples_per_s": s.get("samples_per_s"), "coverage_exact": exact}


def median_of(runs: list[dict], key: str) -> float | None:
    vals = [r[key] for r in runs if key in r]
    return round(statistics.median(vals), 2) if vals else None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--samples", type=int, default=2048)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--sample-ms", type=float, default=1.0)
    p.add_argument("--workers", type=int, nargs="+", default=[2])
    p.add_argument("--kinds", nargs="+", choices=("busy", "sleep"), default=["busy", "sleep"])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--e2e", action="store_true", help="also measure flodl run --local inline vs workers")
    p.add_argument("--ranks", type=int, default=1, help="ranks of the --e2e run (default 1)")
    a = p.parse_args()
    out: dict = {"cpus": os.cpu_count(), "load_1m": os.getloadavg()[0], "samples": a.samples,
                 "batch_size": a.batch_size, "sample_ms": a.sample_ms, "repeats": a.repeats, "loader": {}}
    for kind in a.kinds:
        res = {}
        for w in [0, *a.workers]:
            runs = [loader_loop(a.samples, a.batch_size, a.sample_ms, kind, w) for _ in range(a.repeats)]
            res[f"workers_{w}"] = {k: median_of(runs, k) for k in ("samples_per_s", "data_ms_per_batch")}
        base = res["workers_0"]["samples_per_s"]
        for w in a.workers:
            res[f"workers_{w}"]["x_inline"] = round(res[f"workers_{w}"]["samples_per_s"] / base, 2)
        out["loader"][kind] = res
    if a.e2e:
        e2e = {}
        for w in [0, *a.workers]:
            runs = [flodl_run(a.samples, a.batch_size, a.sample_ms, w, a.ranks) for _ in range(a.repeats)]
            e2e[f"workers_{w}"] = {
                "samples_per_s": median_of(runs, "samples_per_s"),
                "coverage_exact": all(r.get("coverage_exact") for r in runs),
                "errors": [r["error"] for r in runs if "error" in r][:1],
            }
        base = e2e["workers_0"]["samples_per_s"]
        for w in a.workers:
            s = e2e[f"workers_{w}"]["samples_per_s"]
            e2e[f"workers_{w}"]["x_inline"] = round(s / base, 2) if s and base else None
        out["run"] = {"ranks": a.ranks, **e2e}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
