"""The real process tree on loopback: coordinator, one agent, its relay, three ranks."""

import pytest

from runlocal import run_local, traced_counts

pytestmark = pytest.mark.integration

DIGITS_TRAIN = 1437  # load_digits: 1797 samples, 80% train split


def _assert_exact_coverage(summary, trace, epochs, expected):
    cov = summary["coverage"]
    assert [c["epoch"] for c in cov] == list(range(epochs))
    for c in cov:
        assert (c["expected"], c["trained"], c["duplicates"], c["missing"]) == (expected, expected, 0, 0), c
    # Independent audit: what each rank process itself wrote down, by sample id.
    seen = traced_counts(trace)
    assert sorted(seen) == list(range(epochs))
    for e, counts in seen.items():
        assert len(counts) == expected, f"epoch {e}: {len(counts)} distinct samples"
        assert set(counts.values()) == {1}, f"epoch {e}: some sample trained twice"


def test_three_unequal_ranks_train_digits_exactly_once_and_agree(tmp_path):
    proc, summary, trace = run_local(
        tmp_path, "--ranks", "3", "--task", "digits", "--slowdown", "1,2,4", "--base-ms", "2",
        "--epochs", "2", "--batch-size", "32", "--policy", "sync",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert summary["ok"] is True
    _assert_exact_coverage(summary, trace, 2, DIGITS_TRAIN)
    digests = {r["param_digest"] for r in summary["ranks"]}
    assert len(digests) == 1 and "" not in digests, summary["ranks"]
    assert summary["averages"] > 0
    assert sum(r["samples"] for r in summary["ranks"]) == 2 * DIGITS_TRAIN
    assert summary["accuracy"] is not None and 0.0 <= summary["accuracy"] <= 1.0
