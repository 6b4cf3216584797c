"""A rank joining mid-run: what its optimizer state should start as (issue 12).

    python bench/joiner_optimizer_state.py [--models cnn,tinylm] [--epochs 5] [--join-epoch 2]
        [--ranks 3] [--window 10] [--seeds 5]

In-process, torch only (no sockets): the averaging arithmetic of a flodl run, not its
transport. ``--ranks`` replicas of an example start from the same weights and train
cadence-style rounds: every alive replica runs ``--window`` steps on its own next
batches of the shared epoch order (each sample once per epoch), then the parameters are
averaged by steps (``n**gamma``, gamma 1) and the f32 buffers with equal weight, and every
replica takes the average -- what a bus or collective round does. At the start of epoch
``--join-epoch`` one more replica joins: its parameters and buffers are the last
consensus (the seed, as ``flodl_worker.averaging.on_seed`` sets them), and its optimizer
state is one of

* ``fresh``: a new optimizer, no state (what flodl does: momentum / Adam moments start at 0);
* ``copied``: a deep copy of one peer's state (rank 0's);
* ``averaged``: the mean of the alive peers' states (what averaging the moments would seed).

Reported per example and choice, medians over ``--seeds`` seeds: the held-out metric at
the end (accuracy for the CNN, next-token loss for the LM), the metric right after the
first round the joiner contributed to, and the joiner's *jolt* -- its distance from the
seed after its first window over the peers' mean distance (1 = it moved like a peer).
The peer in the same run is ``no_join``: the same schedule with no joiner.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys

import torch

from local_sgd_ab import Task  # bench/: the examples' data, models, optimizers and metrics

CHOICES = ("no_join", "fresh", "copied", "averaged")


def _state_tensors(opt: torch.optim.Optimizer) -> list[dict]:
    return [opt.state.get(p, {}) for g in opt.param_groups for p in g["params"]]


def _seed_state(joiner: torch.optim.Optimizer, peers: list[torch.optim.Optimizer], how: str) -> None:
    """Give the joiner's optimizer the peers' state: rank 0's (copied) or their mean (averaged)."""
    if how == "fresh":
        return
    mine = [p for g in joiner.param_groups for p in g["params"]]
    theirs = [_state_tensors(o) for o in peers]
    for j, p in enumerate(mine):
        states = [t[j] for t in theirs if t[j]]
        if not states:
            continue
        if how == "copied":
            joiner.state[p] = copy.deepcopy(states[0])
            continue
        joiner.state[p] = {
            k: (sum(s[k] for s in states) / len(states)) if torch.is_tensor(v) and v.is_floating_point() else v
            for k, v in states[0].items()
        }


def run(task: Task, how: str, seed: int, args) -> dict:
    world = args.ranks + (0 if how == "no_join" else 1)  # the run's capacity, as the example scales its LR
    torch.manual_seed(seed)
    base = task.build()
    reps = [copy.deepcopy(base) for _ in range(args.ranks)]
    opts = [task.optimizer(m, world=world) for m in reps]
    gens = [torch.Generator().manual_seed(seed + 1 + r) for r in range(world)]
    x, y = task.train.tensors
    n, bs = len(x), args.batch_size
    out: dict = {}
    for epoch in range(args.epochs):
        if epoch == args.join_epoch and how != "no_join":
            joiner = copy.deepcopy(reps[0])  # the seed: every replica holds the consensus now
            jopt = task.optimizer(joiner, world=world)
            _seed_state(jopt, opts, how)
            reps.append(joiner)
            opts.append(jopt)
            out["joined"] = True
        order = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1000 + epoch)).tolist()
        first_round = epoch == args.join_epoch and how != "no_join"
        while order:
            steps = [0] * len(reps)
            for r, (m, o) in enumerate(zip(reps, opts)):
                for _ in range(args.window):
                    if not order:
                        break
                    idx = torch.tensor(order[:bs])
                    del order[:bs]
                    torch.manual_seed(int(torch.randint(1 << 30, (1,), generator=gens[r])))  # per-rank dropout
                    task.step(m, o, (x[idx], y[idx]))
                    steps[r] += 1
            moved = [r for r, s in enumerate(steps) if s > 0]
            with torch.no_grad():
                params = [list(m.parameters()) for m in reps]
                consensus = [sum(steps[r] * params[r][j] for r in moved) / sum(steps) for j in range(len(params[0]))]
                if first_round:  # the joiner's first window: how far it went from the seed, vs a peer
                    dist = [float(sum(((p - c) ** 2).sum() for p, c in zip(params[r], consensus)) ** 0.5)
                            for r in range(len(reps))]  # fmt: skip
                    peers = statistics.mean(dist[:-1])
                    out["jolt"] = dist[-1] / peers if peers > 0 else float("nan")
                for ps in params:
                    for p, c in zip(ps, consensus):
                        p.copy_(c)
                bufs = [[b for b in m.buffers() if b.dtype == torch.float32] for m in reps]
                for j in range(len(bufs[0])):
                    mean = sum(bufs[r][j] for r in moved) / len(moved)
                    for b in bufs:
                        b[j].copy_(mean)
            if first_round:
                out["after_join"] = task.metric(reps[0])
                first_round = False
    out["final"] = task.metric(reps[0])
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="cnn,tinylm")
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--join-epoch", type=int, default=2, help="the joiner arrives at the start of this epoch (0-based)")
    ap.add_argument("--ranks", type=int, default=3, help="replicas from the start")
    ap.add_argument("--window", type=int, default=10, help="steps per replica per round")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--seed", type=int, default=42)
    args = ap.parse_args(argv)
    if not 0 < args.join_epoch < args.epochs:
        ap.error("--join-epoch must be inside the run (0 < join-epoch < epochs)")
    torch.set_num_threads(1)
    rig = {k: getattr(args, k) for k in ("epochs", "join_epoch", "ranks", "window", "batch_size", "seeds")}
    res: dict = {"bench": "joiner_optimizer_state", "in_process": True, "rig": rig}
    for name in args.models.split(","):
        task = Task(name)
        row: dict = {"metric": "accuracy" if name == "cnn" else "heldout_loss"}
        for how in CHOICES:
            runs = [run(task, how, args.seed + i, args) for i in range(args.seeds)]
            keys = [k for k in ("final", "after_join", "jolt") if k in runs[0]]
            row[how] = {k: round(statistics.median(r[k] for r in runs), 4) for k in keys}
            row[how]["final_per_seed"] = [round(r["final"], 4) for r in runs]
        res[name] = row
        print(json.dumps({name: row}), file=sys.stderr, flush=True)  # progress, the object comes last
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
