"""A generated classification task of configurable size (no downloads, torch only).

    python -m flodl_worker.examples.synthetic [--samples 4096] [--features 32]
        [--classes 4] [--test-samples 1024] [--data-seed 0] [--hidden 64] [--lr 0.05]
        [--batchnorm] [--lr-schedule cosine|onecycle] [--num-workers N] [--sample-ms MS]

Inputs are standard normal; labels come from a fixed random *teacher* (a one-hidden-layer
tanh network drawn from ``--data-seed``), so the task is learnable but not linear. Every
rank generates the same data from the same seed; the held-out set is drawn separately
from the same teacher. ``eval_fn`` = held-out accuracy.

``--batchnorm`` puts a BatchNorm1d after the hidden layer (its running stats are
averaged with the parameters). ``--lr-schedule`` follows the run's progress, not the
rank's steps (``flodl_worker.progress``): every rank ends at the same LR. ``--sample-ms``
makes the training set a map-style dataset whose ``__getitem__`` takes that long (an
emulated per-sample read); ``--num-workers`` loads it in worker processes.
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import torch
from torch import nn
from torch.utils.data import Dataset, TensorDataset

from flodl_worker.rank import run_rank

from ._common import (
    accuracy_fn,
    add_optim_args,
    classification_step,
    epoch_report_fn,
    make_optimizer,
    mlp,
    positive_int,
)


def generate(samples: int, test_samples: int, features: int, classes: int, seed: int):
    """(train TensorDataset, test x, test y), a pure function of the arguments."""
    g = torch.Generator().manual_seed(seed)
    w1 = torch.randn(features, 2 * features, generator=g) / features**0.5
    w2 = torch.randn(2 * features, classes, generator=g)
    x = torch.randn(samples + test_samples, features, generator=g)
    y = (torch.tanh(x @ w1) @ w2).argmax(dim=1)
    return TensorDataset(x[:samples], y[:samples]), x[samples:], y[samples:]


class SlowSamples(Dataset):
    """A map-style view of a TensorDataset whose ``__getitem__`` waits ``sample_ms`` (an
    emulated per-sample read: it sleeps, so it needs no spare core to overlap) plus a
    per-sample transform (a little noise on x)."""

    def __init__(self, base: TensorDataset, sample_ms: float) -> None:
        self.x, self.y = base.tensors
        self.sample_ms = sample_ms

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int):
        time.sleep(self.sample_ms / 1e3)
        return self.x[i] + 0.01 * torch.randn_like(self.x[i]), self.y[i]


def model_fn(features: int, hidden: int, classes: int, batchnorm: bool):
    if not batchnorm:
        return lambda: mlp(features, hidden, classes)
    return lambda: nn.Sequential(nn.Linear(features, hidden), nn.BatchNorm1d(hidden), nn.ReLU(), nn.Linear(hidden, classes))


def lr_schedule(kind: str, peak: float):
    """A per-step schedule of the run's progress fraction (``flodl_worker.Progress``)."""
    if kind == "cosine":  # peak -> 1% of peak
        return lambda p: peak * (0.01 + 0.99 * 0.5 * (1.0 + math.cos(math.pi * p.fraction)))
    if kind == "onecycle":  # 30% warm-up from peak/25, then cosine down to peak/1e4
        def onecycle(p):
            f = p.fraction
            if f < 0.3:
                return peak / 25 + (peak - peak / 25) * 0.5 * (1 - math.cos(math.pi * f / 0.3))
            return peak / 1e4 + (peak - peak / 1e4) * 0.5 * (1 + math.cos(math.pi * (f - 0.3) / 0.7))

        return onecycle
    return None


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m flodl_worker.examples.synthetic", description=__doc__.split("\n")[0])
    p.add_argument("--samples", type=positive_int, default=4096, help="training samples (default 4096)")
    p.add_argument("--test-samples", type=positive_int, default=1024, help="held-out samples (default 1024)")
    p.add_argument("--features", type=positive_int, default=32, help="input features (default 32)")
    p.add_argument("--classes", type=positive_int, default=4, help="classes (default 4)")
    p.add_argument("--data-seed", type=int, default=0, help="seed of the data and teacher (default 0)")
    p.add_argument("--batchnorm", action="store_true", help="a BatchNorm1d after the hidden layer")
    p.add_argument("--lr-schedule", choices=("none", "cosine", "onecycle"), default="none",
                   help="per-step LR schedule of the run's progress (default none)")
    p.add_argument("--num-workers", type=int, default=0, help="data-loader worker processes (default 0: inline)")
    p.add_argument("--sample-ms", type=float, default=0.0,
                   help="cost of one __getitem__ in ms (a map-style dataset; default 0: a TensorDataset)")
    add_optim_args(p, lr=0.05)
    args = p.parse_args(argv)
    train, x_te, y_te = generate(args.samples, args.test_samples, args.features, args.classes, args.data_seed)
    run_rank(
        model_fn(args.features, args.hidden, args.classes, args.batchnorm),
        make_optimizer(args),
        classification_step,
        eval_fn=accuracy_fn(x_te, y_te),
        epoch_fn=epoch_report_fn(x_te, y_te) if args.epoch_report else None,
        task="synthetic",
        lr_schedule=lr_schedule(args.lr_schedule, args.lr),
        num_workers=args.num_workers,
        train_dataset=SlowSamples(train, args.sample_ms) if args.sample_ms > 0 else train,
    )


if __name__ == "__main__":
    main(sys.argv[1:])
