"""The real process tree on loopback: coordinator, one agent, its relay, three ranks."""

import pytest

from runlocal import alarming, assert_exact_coverage, run_local

pytestmark = pytest.mark.integration

DIGITS_TRAIN = 1437  # load_digits: 1797 samples, 80% train split


def test_three_unequal_ranks_train_digits_exactly_once_and_agree(tmp_path):
    proc, summary, trace = run_local(
        tmp_path, "--ranks", "3", "--task", "digits", "--slowdown", "1,2,4", "--base-ms", "2",
        "--epochs", "2", "--batch-size", "32", "--policy", "sync",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert summary["ok"] is True
    assert_exact_coverage(summary, trace, 2, DIGITS_TRAIN)
    digests = {r["param_digest"] for r in summary["ranks"]}
    assert len(digests) == 1 and "" not in digests, summary["ranks"]
    assert summary["averages"] > 0
    assert sum(r["samples"] for r in summary["ranks"]) == 2 * DIGITS_TRAIN
    assert summary["accuracy"] is not None and 0.0 <= summary["accuracy"] <= 1.0
    # A healthy run says nothing alarming: no warning, no error, no traceback, nothing dropped.
    out = proc.stdout + proc.stderr
    bad = alarming(out)
    assert not bad, bad
    assert summary["dropped_frames"] == {}, summary["dropped_frames"]
    # Start-up and teardown are in the summary, and they add up with the training: the
    # first batch came before the end, and both fit in the launcher's wall time.
    timeline = summary["timeline_s"]
    assert 0 < timeline["first_batch"] < timeline["run_finished"], timeline
    assert 0 < summary["time_to_first_batch_s"] < summary["launcher_wall_s"], summary
    assert 0 <= summary["teardown_s"] < summary["launcher_wall_s"] - summary["time_to_first_batch_s"], summary
    assert "time to first batch:" in proc.stdout
    # The end of the run is named: 99 % committed comes before the end, which follows soon.
    assert timeline["first_batch"] < timeline["committed_99pct"] <= timeline["run_finished"], timeline
    assert 0 <= summary["end_of_run_s"] < summary["launcher_wall_s"], summary
    assert "end of run:" in proc.stdout
