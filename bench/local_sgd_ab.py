"""In-process A/B of flodl's averaging arithmetic against DDP's, torch only (issue 13).

    python bench/local_sgd_ab.py [--models tinylm] [--epochs 5] [--seeds 3] [--ranks 3]
        [--variants "ddp;local;local lr=0.01732;local state=avg;ddp lr=0.03"]

No sockets, no processes: the quick way to ask *why* a flodl run trains worse than DDP
before paying for real runs (``bench/real_models.py`` gives the numbers that count).

* ``ddp``: one model; every step is the mean gradient of ``--ranks`` shards of
  ``--batch-size`` each (a DDP step, rank 0's BatchNorm buffers), on an equal shard of a
  per-epoch shuffle;
* ``local``: ``--ranks`` replicas from the same weights; every round each runs its
  window of steps on the next batches of the shared epoch order, then the parameters are
  averaged by steps (``n**gamma``) and the f32 buffers with equal weight (a flodl round;
  the first round is one probe batch each, as ``probe_batches`` 1).

A variant is a mode and ``key=value`` options: ``lr`` (default: the example's), ``window``
(steps per replica per round, a comma list for unequal ranks; default 12,9,8: the windows
of a 1,2,4 run), ``state`` (the optimizer's state after a round: ``local`` kept per
replica as flodl does, ``avg`` averaged like the parameters, ``reset`` zeroed),
``outer_lr`` / ``outer_momentum`` / ``nesterov`` (an outer step on the round's progress,
the coordinator's ``outer_optimizer``), ``alpha`` (an EASGD blend instead of the
overwrite; the metric is then the consensus's). Prints one JSON object: per model and
variant the held-out metric per epoch (seed ``--seed``) and at the end, per seed and
the median (accuracy for the CNN, next-token loss for the LM).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import statistics
import sys

import torch
from torch import nn

from flodl_worker.examples import cnn, tinylm
from flodl_worker.examples._common import classification_step, scaled_lr


class Task:
    """One example: its data, a fresh model, its step, its optimizer and its held-out metric."""

    def __init__(self, name: str) -> None:
        self.name = name
        if name == "cnn":
            self.train, self.x_te, self.y_te = cnn.load()
            self.step = classification_step
        else:  # the example's defaults (vocab 16, seq-len 32, data seed 0)
            probs = tinylm.source(16, 0)
            tr, te = tinylm.generate(probs, 2048, 33, 1), tinylm.generate(probs, 512, 33, 2)
            self.train = torch.utils.data.TensorDataset(tr[:, :-1], tr[:, 1:])
            self.x_te, self.y_te = te[:, :-1], te[:, 1:]
            self.step = tinylm.lm_step
        self.base_lr = 0.05 if name == "cnn" else 1e-2

    def build(self) -> nn.Module:
        return cnn.cnn(16, 64, 0.25) if self.name == "cnn" else tinylm.TinyLM(16, 32, 32, 2, 2, 0.1)

    def optimizer(self, model: nn.Module, lr: float | None = None, world: int = 1) -> torch.optim.Optimizer:
        """The example's optimizer at ``lr``, else at its default LR with ``--lr-scale auto`` for ``world``."""
        kind = "sgd" if self.name == "cnn" else "adam"
        lr = scaled_lr(self.base_lr, "auto", world, kind) if lr is None else lr
        if kind == "sgd":
            return torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
        return torch.optim.Adam(model.parameters(), lr=lr)

    def loss(self, model: nn.Module, idx: torch.Tensor) -> torch.Tensor:
        x, y = self.train.tensors
        out = model(x[idx])
        return nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y[idx].reshape(-1))

    def metric(self, model: nn.Module) -> float:
        model.eval()
        with torch.no_grad():
            if self.name == "cnn":
                out = float((model(self.x_te).argmax(1) == self.y_te).float().mean())
            else:
                out = tinylm.heldout_metrics(model, self.x_te, self.y_te)["loss"]
        model.train()
        return out


def ddp(task: Task, seed: int, args, lr: float | None = None) -> list[float]:
    torch.manual_seed(seed)
    m = task.build()
    opt = task.optimizer(m, lr)
    n, k, bs = len(task.train), args.ranks, args.batch_size
    curve = []
    for e in range(args.epochs):
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1000 + e))
        shards = [perm[r::k] for r in range(k)]
        for i in range(math.ceil(len(shards[0]) / bs)):
            parts = [p for p in (s[i * bs : (i + 1) * bs] for s in shards) if len(p)]
            opt.zero_grad(set_to_none=True)
            for r, idx in enumerate(parts):
                (task.loss(m, idx) / len(parts)).backward()  # DDP's mean gradient
                if r == 0:
                    rank0 = [b.clone() for b in m.buffers()]
            with torch.no_grad():
                for b, b0 in zip(m.buffers(), rank0):  # DDP broadcasts rank 0's buffers
                    b.copy_(b0)
            opt.step()
        curve.append(task.metric(m))
    return curve


def _state(opts: list, weights: list[float], how: str) -> None:
    """The optimizers' state after a round: kept (local), averaged by ``weights`` or zeroed."""
    if how == "local":
        return
    per = [[o.state.get(p) for g in o.param_groups for p in g["params"]] for o in opts]
    for states in zip(*per):
        if any(not s for s in states):
            continue
        for key, v in states[0].items():
            if not torch.is_tensor(v) or (key == "step" and how == "avg"):  # Adam's count stays the replica's
                continue
            mean = sum(w * s[key] for w, s in zip(weights, states)) / sum(weights) if how == "avg" else 0.0
            for s in states:
                s[key].copy_(mean) if how == "avg" else s[key].zero_()


def local(task: Task, seed: int, args, lr=None, window="12,9,8", state="local", gamma=1.0,
          outer_lr=1.0, outer_momentum=0.0, nesterov=False, alpha=1.0) -> list[float]:  # fmt: skip
    counts = [int(c) for c in str(window).split(",")]
    counts = (counts * args.ranks)[: args.ranks] if len(counts) < args.ranks else counts[: args.ranks]
    torch.manual_seed(seed)
    base = task.build()
    reps = [copy.deepcopy(base) for _ in counts]
    opts = [task.optimizer(m, lr) for m in reps]
    gens = [torch.Generator().manual_seed(seed + 1 + r) for r in range(len(reps))]
    center = [p.detach().clone() for p in base.parameters()]
    velocity = [torch.zeros_like(p) for p in center]
    n, bs = len(task.train), args.batch_size
    order: list[int] = []
    next_epoch, trained, curve, probe = 0, 0, [], True
    while trained < args.epochs * n:
        steps = [0] * len(reps)
        for r, c in enumerate([1] * len(reps) if probe else counts):
            for _ in range(c):
                if len(order) < bs and next_epoch < args.epochs:  # an epoch's order runs on into the next
                    g = torch.Generator().manual_seed(seed * 1000 + next_epoch)
                    order += torch.randperm(n, generator=g).tolist()
                    next_epoch += 1
                if not order:
                    break
                idx = torch.tensor(order[:bs])
                del order[:bs]
                torch.manual_seed(int(torch.randint(1 << 30, (1,), generator=gens[r])))  # per-rank dropout
                task.step(reps[r], opts[r], task.train[idx])
                steps[r] += 1
                trained += len(idx)
        probe = False
        w = [s**gamma if s > 0 else 0.0 for s in steps]
        with torch.no_grad():
            params = [list(m.parameters()) for m in reps]
            for j, c in enumerate(center):
                avg = sum(wi * p[j] for wi, p in zip(w, params)) / sum(w)
                if outer_lr != 1.0 or outer_momentum != 0.0:  # the coordinator's outer step (outer.py)
                    delta = c - avg
                    velocity[j].mul_(outer_momentum).add_(delta)
                    avg = c - outer_lr * (delta + outer_momentum * velocity[j] if nesterov else velocity[j])
                c.copy_(avg)
                for p in params:
                    p[j].lerp_(avg, alpha)
            bufs = [[b for b in m.buffers() if b.dtype == torch.float32] for m in reps]
            movers = [r for r, s in enumerate(steps) if s > 0]
            for j in range(len(bufs[0])):
                mean = sum(bufs[r][j] for r in movers) / len(movers)
                for b in bufs:
                    b[j].copy_(mean)
        _state(opts, w, state)
        while len(curve) < args.epochs and trained >= (len(curve) + 1) * n:
            ev = copy.deepcopy(reps[0])
            with torch.no_grad():
                for p, c in zip(ev.parameters(), center):
                    p.copy_(c)
            curve.append(task.metric(ev))
    return curve


def _parse(variant: str) -> tuple[str, dict]:
    mode, *opts = variant.split()
    kw: dict = {}
    for o in opts:
        k, _, v = o.partition("=")
        kw[k] = v if k in ("window", "state") else (v == "true" if k == "nesterov" else float(v))
    if mode not in ("ddp", "local") or (mode == "ddp" and set(kw) - {"lr"}):
        raise SystemExit(f"bad variant {variant!r}: ddp [lr=] or local [lr= window= state= gamma= outer_lr= ...]")
    return mode, kw


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="tinylm")
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--ranks", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--variants", default="ddp;local;local state=avg;local lr=0.01732")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    variants = [v.strip() for v in args.variants.split(";") if v.strip()]
    res: dict = {"bench": "local_sgd_ab", "in_process": True,
                 "rig": {k: getattr(args, k) for k in ("epochs", "ranks", "batch_size", "seeds", "seed")}}  # fmt: skip
    for name in args.models.split(","):
        task = Task(name)
        row: dict = {"metric": "accuracy" if name == "cnn" else "heldout_loss"}
        for v in variants:
            mode, kw = _parse(v)
            curves = [(ddp if mode == "ddp" else local)(task, args.seed + i, args, **kw) for i in range(args.seeds)]
            finals = [round(c[-1], 4) for c in curves]
            row[v] = {"final": round(statistics.median(finals), 4), "final_per_seed": finals,
                      "curve": [round(x, 4) for x in curves[0]]}  # fmt: skip
            print(json.dumps({name: {v: row[v]}}), file=sys.stderr, flush=True)  # progress
        res[name] = row
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
