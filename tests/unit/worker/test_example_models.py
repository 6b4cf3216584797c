"""The examples that look like real work: ``cnn`` (BatchNorm + dropout on digits as
images) and ``tinylm`` (a causal transformer LM on an order-2 Markov source). Their
models, data and step functions, in-process (the runs go through ``flodl run`` in
tests/integration/test_user_script.py and bench/)."""

from __future__ import annotations

import math

import pytest
import torch

from flodl_worker.examples import tinylm
from flodl_worker.examples._common import classification_step


def _steps(model, step, batch, n: int, lr: float) -> tuple[float, float]:
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    first = float(step(model, opt, batch))
    for _ in range(n):
        last = float(step(model, opt, batch))
    return first, last


def test_cnn_sees_digits_as_images_with_batchnorm_and_learns_a_batch():
    pytest.importorskip("sklearn")
    from flodl_worker.examples import cnn

    train, x_te, y_te = cnn.load()
    x, y = train.tensors
    assert tuple(x.shape) == (1437, 1, 8, 8) and tuple(x_te.shape) == (360, 1, 8, 8) and len(y_te) == 360
    torch.manual_seed(0)
    model = cnn.cnn(8, 32, 0.25)
    assert {"1.running_mean", "1.running_var", "4.running_mean"} <= set(model.state_dict())
    assert any(isinstance(m, torch.nn.Dropout) for m in model.modules())
    first, last = _steps(model, classification_step, (x[:64], y[:64]), 20, 1e-2)
    assert last < first / 2
    model.eval()
    with torch.no_grad():
        assert tuple(model(x_te).shape) == (360, 10)


def test_tinylm_data_is_a_pure_function_of_the_seeds_and_follows_its_source():
    probs = tinylm.source(8, 3)
    a, b = tinylm.generate(probs, 64, 20, 5), tinylm.generate(probs, 64, 20, 5)
    assert torch.equal(a, b) and not torch.equal(a, tinylm.generate(probs, 64, 20, 6))
    assert torch.allclose(probs.sum(-1), torch.ones(8, 8))
    # Sharpened: far below a uniform source's log(vocab), so there is something to learn.
    assert tinylm.source_entropy(probs, a) < 0.6 * math.log(8)


def test_tinylm_is_causal_and_learns_a_batch():
    torch.manual_seed(0)
    model = tinylm.TinyLM(vocab=8, length=12, d=16, layers=2, heads=2, dropout=0.0).eval()
    x = torch.randint(8, (4, 12))
    changed = x.clone()
    changed[:, 7:] = (x[:, 7:] + 1) % 8
    with torch.no_grad():
        before, after = model(x), model(changed)
    assert tuple(before.shape) == (4, 12, 8)
    assert torch.allclose(before[:, :7], after[:, :7], atol=1e-6)  # the future does not leak back
    assert not torch.allclose(before[:, 7:], after[:, 7:])
    seq = tinylm.generate(tinylm.source(8, 0), 32, 13, 1)
    first, last = _steps(model.train(), tinylm.lm_step, (seq[:, :-1], seq[:, 1:]), 25, 1e-2)
    assert last < first * 0.8
    model.eval()
    with torch.no_grad():
        m = tinylm.heldout_metrics(model, seq[:, :-1], seq[:, 1:])
    assert m["perplexity"] == pytest.approx(math.exp(m["loss"])) and 0.0 <= m["accuracy"] <= 1.0
