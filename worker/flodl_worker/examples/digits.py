"""Handwritten digits (scikit-learn ``load_digits``: 1797 real 8x8 images, 10 classes).

    python -m flodl_worker.examples.digits [--hidden 64] [--lr 0.05] [--optimizer sgd|adam]

A fixed, stratified 80/20 train/test split (``random_state=0``), features standardized
with the training part's statistics, an MLP 64 -> hidden -> 10. Ranks train on the
training part only (1437 samples); ``eval_fn`` is the held-out test accuracy. Needs
scikit-learn (``pip install 'flodl-worker[examples]'``).
"""

from __future__ import annotations

import argparse
import sys

import torch
from torch.utils.data import TensorDataset

from flodl_worker.rank import run_rank

from ._common import accuracy_fn, add_optim_args, classification_step, epoch_report_fn, make_optimizer, mlp

SPLIT_SEED = 0
TEST_FRACTION = 0.2


def load(test_fraction: float = TEST_FRACTION):
    """(train TensorDataset, test x, test y): identical on every rank and every run."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
    from sklearn.preprocessing import StandardScaler

    x, y = load_digits(return_X_y=True)
    x_tr, x_te, y_tr, y_te = train_test_split(
        x, y, test_size=test_fraction, random_state=SPLIT_SEED, stratify=y
    )
    scaler = StandardScaler().fit(x_tr)
    as_x = lambda a: torch.tensor(scaler.transform(a), dtype=torch.float32)  # noqa: E731
    as_y = lambda a: torch.tensor(a, dtype=torch.long)  # noqa: E731
    return TensorDataset(as_x(x_tr), as_y(y_tr)), as_x(x_te), as_y(y_te)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m flodl_worker.examples.digits", description=__doc__.split("\n")[0])
    add_optim_args(p, lr=0.05)
    args = p.parse_args(argv)
    train, x_te, y_te = load()
    run_rank(
        lambda: mlp(64, args.hidden, 10),
        make_optimizer(args),
        classification_step,
        train,
        eval_fn=accuracy_fn(x_te, y_te),
        epoch_fn=epoch_report_fn(x_te, y_te) if args.epoch_report else None,
        task="digits",
    )


if __name__ == "__main__":
    main(sys.argv[1:])
