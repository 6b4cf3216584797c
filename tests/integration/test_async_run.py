"""``flodl run --local --policy async``: the real process tree, three unequal ranks."""

import pytest

from runlocal import run_local, traced_counts

pytestmark = pytest.mark.integration

DIGITS_TRAIN = 1437  # load_digits: 1797 samples, 80% train split


def test_async_three_unequal_ranks_train_digits_exactly_once(tmp_path):
    proc, summary, trace = run_local(
        tmp_path, "--ranks", "3", "--task", "digits", "--slowdown", "1,2,4", "--base-ms", "2",
        "--epochs", "2", "--batch-size", "32", "--policy", "async", "--easgd-alpha", "0.5",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert summary["ok"] is True and summary["policy"] == "async"
    cov = summary["coverage"]
    assert [c["epoch"] for c in cov] == [0, 1]
    for c in cov:
        assert (c["expected"], c["trained"], c["duplicates"], c["missing"]) == (DIGITS_TRAIN,) * 2 + (0, 0), c
    # Independent audit: what each rank process itself wrote down, by sample id.
    seen = traced_counts(trace)
    assert sorted(seen) == [0, 1]
    for e, counts in seen.items():
        assert len(counts) == DIGITS_TRAIN, f"epoch {e}: {len(counts)} distinct samples"
        assert set(counts.values()) == {1}, f"epoch {e}: some sample trained twice"
    assert sum(r["samples"] for r in summary["ranks"]) == 2 * DIGITS_TRAIN
    assert summary["averages"] > 0 and "max_overshoot" in summary["elche"]
    # EASGD blends rather than overwrites, so the ranks need not end bit-identical; each
    # still reported a digest on its clean exit.
    assert all(r["param_digest"] for r in summary["ranks"])
    assert summary["accuracy"] is not None and 0.0 <= summary["accuracy"] <= 1.0
