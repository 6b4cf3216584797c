"""A small CNN with BatchNorm and dropout on the handwritten digits (1x8x8 images).

    flodl run --local --ranks 3 -- python -m flodl_worker.examples.cnn [--channels 16]
        [--dropout 0.25] [--hidden 64] [--lr 0.05] [--optimizer sgd|adam]

The same data and split as ``digits`` (scikit-learn ``load_digits``, a fixed stratified
80/20 split, standardized with the training part's statistics), seen as 1x8x8 images:
conv 3x3 -> BatchNorm -> ReLU -> conv 3x3 -> BatchNorm -> ReLU -> max-pool 2 -> dropout
-> linear -> ReLU -> dropout -> linear (10 classes). ``eval_fn`` is the held-out test
accuracy, measured in ``eval()`` mode (BatchNorm on its running statistics, no dropout).
Trains in seconds on a CPU. Needs scikit-learn (``pip install 'flodl-worker[examples]'``).
"""

from __future__ import annotations

import argparse
import sys

import torch
from torch import nn
from torch.utils.data import TensorDataset

from flodl_worker.rank import run_rank

from . import digits
from ._common import accuracy_fn, add_optim_args, classification_step, epoch_report_fn, make_optimizer

SIDE = 8  # load_digits images are 8x8, one channel


def cnn(channels: int, hidden: int, dropout: float, classes: int = 10) -> nn.Module:
    c = channels
    return nn.Sequential(
        nn.Conv2d(1, c, 3, padding=1, bias=False),  # BatchNorm follows: its shift is the bias
        nn.BatchNorm2d(c),
        nn.ReLU(),
        nn.Conv2d(c, 2 * c, 3, padding=1, bias=False),
        nn.BatchNorm2d(2 * c),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Dropout(dropout),
        nn.Linear(2 * c * (SIDE // 2) ** 2, hidden),
        nn.ReLU(),
        nn.Dropout(dropout),
        nn.Linear(hidden, classes),
    )


def load():
    """(train TensorDataset of 1x8x8 images, test x, test y): the digits split as images."""
    train, x_te, y_te = digits.load()
    x_tr, y_tr = train.tensors
    as_img = lambda x: x.reshape(-1, 1, SIDE, SIDE).contiguous()  # noqa: E731
    return TensorDataset(as_img(x_tr), y_tr), as_img(x_te), y_te


def _dropout(s: str) -> float:
    v = float(s)
    if not 0.0 <= v < 1.0:
        raise argparse.ArgumentTypeError(f"{s} must be in [0, 1)")
    return v


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m flodl_worker.examples.cnn", description=__doc__.split("\n")[0])
    p.add_argument("--channels", type=int, default=16, help="channels of the first conv (default 16; the second has 2x)")
    p.add_argument("--dropout", type=_dropout, default=0.25, help="dropout probability (default 0.25)")
    add_optim_args(p, lr=0.05, hidden=64)
    args = p.parse_args(argv)
    train, x_te, y_te = load()
    run_rank(
        lambda: cnn(args.channels, args.hidden, args.dropout),
        make_optimizer(args),
        classification_step,
        train,
        eval_fn=accuracy_fn(x_te, y_te),
        epoch_fn=epoch_report_fn(x_te, y_te) if args.epoch_report else None,
        task="cnn",
    )


if __name__ == "__main__":
    main(sys.argv[1:])
