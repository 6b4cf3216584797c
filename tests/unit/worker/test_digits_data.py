"""The digits example's data: scikit-learn's bundled file read without importing
scikit-learn (a rank's start-up), a stratified split that is the same on every rank,
and features standardized by the training part alone."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from flodl_worker.examples import digits


def test_the_file_read_directly_is_what_load_digits_returns():
    sklearn_datasets = pytest.importorskip("sklearn.datasets")
    x, y = digits._raw()
    want_x, want_y = sklearn_datasets.load_digits(return_X_y=True)
    assert x.shape == (1797, 64) and np.array_equal(x, want_x) and np.array_equal(y, want_y)


def test_the_split_is_stratified_disjoint_complete_and_seeded():
    pytest.importorskip("sklearn")
    _, y = digits._raw()
    tr, te = digits.stratified_split(y, 0.2, seed=0)
    assert len(te) == 360 and len(tr) == 1437  # ceil(0.2 * 1797) held out, as scikit-learn's split
    assert np.intersect1d(tr, te).size == 0 and np.array_equal(np.sort(np.concatenate([tr, te])), np.arange(1797))
    per_class = np.bincount(y[te], minlength=10)
    assert np.all(np.abs(per_class - np.bincount(y) * 0.2) < 1.0)  # each class within a sample of its share
    again_tr, again_te = digits.stratified_split(y, 0.2, seed=0)
    assert np.array_equal(tr, again_tr) and np.array_equal(te, again_te)
    _, other_te = digits.stratified_split(y, 0.2, seed=1)
    assert not np.array_equal(te, other_te)


def test_features_are_standardized_by_the_training_part():
    pytest.importorskip("sklearn")
    train, x_te, y_te = digits.load()
    x, y = train.tensors
    assert tuple(x.shape) == (1437, 64) and tuple(x_te.shape) == (360, 64) and len(y_te) == 360
    assert float(x.mean(0).abs().max()) < 1e-5
    std = x.std(0, unbiased=False)
    assert float(((std - 1.0).abs() < 1e-4).float().sum() + (std == 0).float().sum()) == 64  # 1, or 0: constant pixels


def test_loading_does_not_import_scikit_learn():
    pytest.importorskip("sklearn")
    code = "import sys; from flodl_worker.examples import digits; digits.load(); print('sklearn' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
