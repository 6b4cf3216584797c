"""A generated classification task of configurable size (no downloads, torch only).

    python -m flodl_worker.examples.synthetic [--samples 4096] [--features 32]
        [--classes 4] [--test-samples 1024] [--data-seed 0] [--hidden 64] [--lr 0.05]

Inputs are standard normal; labels come from a fixed random *teacher* (a one-hidden-layer
tanh network drawn from ``--data-seed``), so the task is learnable but not linear. Every
rank generates the same data from the same seed; the held-out set is drawn separately
from the same teacher. ``eval_fn`` = held-out accuracy.
"""

from __future__ import annotations

import argparse
import sys

import torch
from torch.utils.data import TensorDataset

from flodl_worker.rank import run_rank

from ._common import accuracy_fn, add_optim_args, classification_step, epoch_report_fn, make_optimizer, mlp


def generate(samples: int, test_samples: int, features: int, classes: int, seed: int):
    """(train TensorDataset, test x, test y), a pure function of the arguments."""
    g = torch.Generator().manual_seed(seed)
    w1 = torch.randn(features, 2 * features, generator=g) / features**0.5
    w2 = torch.randn(2 * features, classes, generator=g)
    x = torch.randn(samples + test_samples, features, generator=g)
    y = (torch.tanh(x @ w1) @ w2).argmax(dim=1)
    return TensorDataset(x[:samples], y[:samples]), x[samples:], y[samples:]


def _positive(s: str) -> int:
    n = int(s)
    if n < 1:
        raise argparse.ArgumentTypeError(f"{s} must be >= 1")
    return n


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m flodl_worker.examples.synthetic", description=__doc__.split("\n")[0])
    p.add_argument("--samples", type=_positive, default=4096, help="training samples (default 4096)")
    p.add_argument("--test-samples", type=_positive, default=1024, help="held-out samples (default 1024)")
    p.add_argument("--features", type=_positive, default=32, help="input features (default 32)")
    p.add_argument("--classes", type=_positive, default=4, help="classes (default 4)")
    p.add_argument("--data-seed", type=int, default=0, help="seed of the data and teacher (default 0)")
    add_optim_args(p, lr=0.05)
    args = p.parse_args(argv)
    train, x_te, y_te = generate(args.samples, args.test_samples, args.features, args.classes, args.data_seed)
    run_rank(
        lambda: mlp(args.features, args.hidden, args.classes),
        make_optimizer(args),
        classification_step,
        train,
        eval_fn=accuracy_fn(x_te, y_te),
        epoch_fn=epoch_report_fn(x_te, y_te) if args.epoch_report else None,
        task="synthetic",
    )


if __name__ == "__main__":
    main(sys.argv[1:])
