"""The real-work examples under flodl against torch DDP at equal epochs.

    python bench/real_models.py [--models cnn,tinylm] [--modes cadence,async] [--epochs 5]
        [--slowdown 1,2,4] [--base-ms 2] [--repeats 5] [--seed 42] [--example-args "--lr-scale none"]

For each example (``flodl_worker.examples.cnn``: conv + BatchNorm + dropout on the
digits; ``flodl_worker.examples.tinylm``: a causal transformer LM), in one invocation:

* flodl, each policy of ``--modes``: ``flodl run --local -- python -m
  flodl_worker.examples.<model>`` (the user-script path), 3 ranks of unequal emulated
  speed. The held-out metrics are computed here from the run's output model
  (``model.pt``, loaded with plain torch into a fresh model): accuracy for the CNN,
  next-token loss and perplexity for the LM -- and, as a check, the summary's accuracy
  (measured by the rank) must equal what the file gives;
* torch DDP (gloo), the same model, optimizer, learning rate, batch size, epochs and
  emulated speeds, each rank on an equal shard of a per-epoch shuffle (DDP all-reduces
  gradients every step, so every step waits for the slowest rank).

The learning rate: DDP runs at the example's ``--lr``. flodl runs the example with its
defaults, and ``--lr-scale auto`` multiplies an *Adam* LR by sqrt(ranks): averaging K
ranks' Adam steps, each normalised by its own batch's gradient noise, moves about
1/sqrt(K) as far as DDP's one Adam step on the K-fold batch (SGD's average is DDP's step
already, so the CNN's LR is not scaled). ``--example-args "--lr-scale none"`` runs flodl
at DDP's LR instead, to show that gap.

Repeat ``i`` runs every contender with seed ``--seed + i`` (initial weights and shuffle):
the medians are over seeds, not over timing noise of one seed.

Prints one JSON object: per model and mode the medians over ``--repeats`` of the held-out
metrics and the wall time, each mode's gap to DDP (accuracy points; loss in nats), and
the per-seed values.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP

from flodl_worker.examples import cnn, tinylm
from flodl_worker.examples._common import classification_step


class Model:
    """One example as the bench needs it: its data, a fresh model, its step, its optimizer."""

    def __init__(self, name: str) -> None:
        self.name = name
        if name == "cnn":
            self.train, self.x_te, self.y_te = cnn.load()
            self.step = classification_step
        else:
            probs = tinylm.source(16, 0)  # the example's defaults (vocab 16, seq-len 32, data seed 0)
            tr, te = tinylm.generate(probs, 2048, 33, 1), tinylm.generate(probs, 512, 33, 2)
            self.train = torch.utils.data.TensorDataset(tr[:, :-1], tr[:, 1:])
            self.x_te, self.y_te = te[:, :-1], te[:, 1:]
            self.entropy = tinylm.source_entropy(probs, te)
            self.step = tinylm.lm_step

    def build(self) -> torch.nn.Module:
        if self.name == "cnn":
            return cnn.cnn(16, 64, 0.25)
        return tinylm.TinyLM(16, 32, 32, 2, 2, 0.1)

    def optimizer(self, model: torch.nn.Module) -> torch.optim.Optimizer:
        if self.name == "cnn":  # the examples' defaults
            return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        return torch.optim.Adam(model.parameters(), lr=1e-2)

    def metrics(self, model: torch.nn.Module) -> dict:
        model.eval()
        with torch.no_grad():
            if self.name == "cnn":
                return {"accuracy": float((model(self.x_te).argmax(1) == self.y_te).float().mean())}
            m = tinylm.heldout_metrics(model, self.x_te, self.y_te)
        return {"heldout_loss": m["loss"], "perplexity": m["perplexity"], "accuracy": m["accuracy"]}


def flodl_run(model: Model, policy: str, args, seed: int) -> dict:
    with tempfile.TemporaryDirectory() as d:
        summary = os.path.join(d, "s.json")
        cmd = [
            sys.executable, "-m", "flodl", "run", "--local", "--quiet", "--ranks", str(len(args.slow)),
            "--slowdown", args.slowdown, "--base-ms", str(args.base_ms), "--epochs", str(args.epochs),
            "--batch-size", str(args.batch_size), "--policy", policy, "--summary", summary, "--seed", str(seed),
            "--", sys.executable, "-m", f"flodl_worker.examples.{model.name}", *shlex.split(args.example_args),
        ]  # fmt: skip
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        if p.returncode != 0 or not os.path.exists(summary):
            return {"error": (p.stdout + p.stderr)[-1500:]}
        with open(summary, encoding="utf-8") as fh:
            s = json.load(fh)
        fresh = model.build()
        fresh.load_state_dict(torch.load(os.path.join(d, "model.pt"), weights_only=True))  # plain torch
    out = model.metrics(fresh)
    out.update(wall_s=s.get("wall_s"), averages=s.get("averages"),
               summary_matches_file=abs(out["accuracy"] - (s.get("accuracy") or -1.0)) < 1e-6,
               exact_coverage=all(c["duplicates"] == 0 and c["missing"] == 0 for c in s.get("coverage", [])))  # fmt: skip
    return out


def _ddp_worker(rank: int, name: str, args, seed: int, port: int, out_q) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=len(args.slow))
    m = Model(name)
    torch.manual_seed(seed)  # the same initial weights as flodl's ranks of this seed
    net = DDP(m.build())
    opt = m.optimizer(net)
    x_all, y_all = m.train.tensors
    n, world = len(m.train), len(args.slow)
    dist.barrier()
    t0 = time.perf_counter()
    for epoch in range(args.epochs):
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1000 + epoch))
        shard = perm[rank::world]
        for i in range(0, len(shard), args.batch_size):
            idx = shard[i : i + args.batch_size]
            m.step(net, opt, (x_all[idx], y_all[idx]))
            time.sleep(args.base_ms * args.slow[rank] / 1000.0)
    dist.barrier()
    if rank == 0:
        out_q.put({**m.metrics(net.module), "wall_s": time.perf_counter() - t0})
    dist.destroy_process_group()


def ddp_run(name: str, args, seed: int) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_ddp_worker, args=(r, name, args, seed, port, q)) for r in range(len(args.slow))]
    for p in procs:
        p.start()
    res = q.get(timeout=1800)
    for p in procs:
        p.join(timeout=60)
    return res


def medians(runs: list[dict], key: str) -> dict:
    ok = [r for r in runs if "error" not in r]
    per_seed = [round(r[key], 4) if key in r else None for r in runs]
    out: dict = {"runs": len(runs), "failed": len(runs) - len(ok), f"{key}_per_seed": per_seed}
    if not ok:
        out["error"] = runs[-1].get("error")
        return out
    for k, v in ok[0].items():
        if isinstance(v, bool):
            out[k] = all(r[k] for r in ok)
        elif isinstance(v, (int, float)):
            out[k] = round(statistics.median(r[k] for r in ok), 4)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="cnn,tinylm")
    ap.add_argument("--modes", default="cadence,async", help="flodl policies (sync, cadence, async)")
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--slowdown", default="1,2,4")
    ap.add_argument("--base-ms", type=float, default=2.0)
    ap.add_argument("--seed", type=int, default=42, help="repeat i uses seed + i (every contender)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--example-args", default="", help='arguments for the flodl example, e.g. "--lr-scale none"')
    args = ap.parse_args()
    args.slow = [float(s) for s in args.slowdown.split(",")]
    res: dict = {"bench": "real_models", "rig": {k: getattr(args, k) for k in
                 ("epochs", "batch_size", "slowdown", "base_ms", "repeats", "seed", "example_args")}}  # fmt: skip
    seeds = [args.seed + i for i in range(args.repeats)]
    for name in args.models.split(","):
        model = Model(name)
        key = "accuracy" if name == "cnn" else "heldout_loss"
        row: dict = {"ddp": medians([ddp_run(name, args, s) for s in seeds], key)}
        for policy in args.modes.split(","):
            row[f"flodl_{policy}"] = medians([flodl_run(model, policy, args, s) for s in seeds], key)
        base = row["ddp"].get(key)
        for mode, r in row.items():
            if mode != "ddp" and base is not None and key in r:
                r[f"{key}_vs_ddp"] = round((r[key] - base) * (100 if key == "accuracy" else 1), 4)
        if name == "tinylm":
            row["source_entropy"] = round(model.entropy, 4)
        res[name] = row
        print(json.dumps({name: row}), file=sys.stderr, flush=True)  # progress, the object comes last
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
