"""Handwritten digits (scikit-learn ``load_digits``: 1797 real 8x8 images, 10 classes).

    python -m flodl_worker.examples.digits [--hidden 64] [--lr 0.05] [--optimizer sgd|adam]

A fixed, stratified 80/20 train/test split (seed 0), features standardized with the
training part's statistics, an MLP 64 -> hidden -> 10. Ranks train on the training part
only (1437 samples); ``eval_fn`` is the held-out test accuracy. Needs scikit-learn
installed (``pip install 'flodl-worker[examples]'``) for its bundled data file, which is
read without importing scikit-learn.
"""

from __future__ import annotations

import argparse
import gzip
import importlib.util
import os
import sys

import numpy as np

import torch
from torch.utils.data import TensorDataset

from flodl_worker.rank import run_rank

from ._common import accuracy_fn, add_optim_args, classification_step, epoch_report_fn, make_optimizer, mlp

SPLIT_SEED = 0
TEST_FRACTION = 0.2
DATA_FILE = ("datasets", "data", "digits.csv.gz")  # inside the scikit-learn package


def _raw() -> tuple[np.ndarray, np.ndarray]:
    """(x float64 [1797, 64], y int64): the file ``load_digits`` reads, read without
    importing scikit-learn (which costs a rank 1.4-1.9 s of start-up: scipy and all)."""
    spec = importlib.util.find_spec("sklearn")  # finds the package, runs nothing of it
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("the digits example needs scikit-learn's bundled data: pip install 'flodl-worker[examples]'")
    path = os.path.join(spec.submodule_search_locations[0], *DATA_FILE)
    if not os.path.exists(path):  # a layout we do not know: let scikit-learn find it
        from sklearn.datasets import load_digits

        x, y = load_digits(return_X_y=True)
        return np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.int64)
    with gzip.open(path, "rt") as fh:
        data = np.loadtxt(fh, delimiter=",")
    return data[:, :-1], data[:, -1].astype(np.int64)


def stratified_split(y: np.ndarray, test_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train indices, test indices), each sorted: ``ceil(test_fraction * n)`` test samples
    shared out over the classes in proportion (largest remainders, ties to the lower
    class), each class's own drawn with one seeded generator. Identical on every rank."""
    classes, counts = np.unique(y, return_counts=True)
    n_test = int(np.ceil(test_fraction * len(y)))
    exact = counts * (n_test / len(y))
    share = np.floor(exact).astype(np.int64)
    order = np.lexsort((classes, -(exact - share)))  # largest remainder first
    share[order[: n_test - int(share.sum())]] += 1
    rng = np.random.default_rng(seed)
    test = np.concatenate([rng.permutation(np.flatnonzero(y == c))[:k] for c, k in zip(classes, share)])
    mask = np.ones(len(y), dtype=bool)
    mask[test] = False
    return np.flatnonzero(mask), np.sort(test)


def load(test_fraction: float = TEST_FRACTION):
    """(train TensorDataset, test x, test y): identical on every rank and every run.
    Features are standardized with the training part's mean and (population) deviation."""
    x, y = _raw()
    tr, te = stratified_split(y, test_fraction, SPLIT_SEED)
    mean = x[tr].mean(axis=0)
    scale = x[tr].std(axis=0)
    scale[scale == 0.0] = 1.0  # constant pixels (always 0 in the corners) stay 0
    as_x = lambda a: torch.tensor((a - mean) / scale, dtype=torch.float32)  # noqa: E731
    as_y = lambda a: torch.tensor(a, dtype=torch.long)  # noqa: E731
    return TensorDataset(as_x(x[tr]), as_y(y[tr])), as_x(x[te]), as_y(y[te])


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
