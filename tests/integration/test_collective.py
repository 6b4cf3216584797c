"""The collective data plane with real processes: coordinator, agent, relay, three torch
ranks all-reducing through gloo (``flodl run --local --plane collective``).

* a clean run: every epoch's committed coverage exactly once (summary and the ranks' own
  traces), every rank ends on the same parameters;
* a rank killed (-9, from outside) between reduces, right after it acked one;
* a rank killed inside an all-reduce (the ``FLODL_FAULT`` failpoint SIGKILLs it as it
  launches the reduce of a chosen cycle, before its part leaves, so its peers are blocked
  in it: killed just after, a reduce its peers were already waiting in could complete).

In both fault runs the survivors re-form the group as a new generation, the run
finishes, coverage stays exactly once, and the survivors agree on their parameters.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from faults import kill_quietly, rank_pid
from runlocal import ROOT, assert_committed_once_despite_a_death, traced_counts, unreported_by

pytestmark = pytest.mark.integration

TRAIN = 1024  # the synthetic task's training set (no dataset download/import: quick start)
BATCH = 16
TASK = ("--task", "synthetic")
TASK_ARGS = ("--", "--samples", str(TRAIN), "--test-samples", "256", "--hidden", "32")


def _launch(tmp_path: Path, *extra: str, env: dict | None = None):
    summary, trace, journal = tmp_path / "summary.json", tmp_path / "trace", tmp_path / "journal.jsonl"
    trace.mkdir()
    cmd = [
        sys.executable, "-m", "flodl", "run", "--local", "--plane", "collective",
        "--ranks", "3", *TASK, "--slowdown", "1,2,4", "--base-ms", "2",
        "--epochs", "2", "--batch-size", str(BATCH), "--summary", str(summary),
        "--trace-dir", str(trace), "--journal", str(journal),
        "--log-level", "INFO",  # the tests read the ranks' collective decisions from the output
        *extra, *TASK_ARGS,
    ]  # fmt: skip
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT, env={**os.environ, **(env or {})}
    )
    return proc, summary, trace, journal


def _finish(proc, summary: Path) -> tuple[dict, str]:
    out, _ = proc.communicate(timeout=240)
    (summary.parent / "out.txt").write_text(out)  # kept with the run's files for a post-mortem
    assert proc.returncode == 0, out[-5000:]
    return json.loads(summary.read_text()), out


def _exact(summary: dict, expected: int = TRAIN) -> None:
    assert [c["epoch"] for c in summary["coverage"]] == [0, 1]
    for c in summary["coverage"]:
        assert (c["expected"], c["trained"], c["duplicates"], c["missing"]) == (expected, expected, 0, 0), c


def _journal_acks(journal: Path, rank: int) -> list[int]:
    try:
        lines = journal.read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        if '"SyncAcked"' in line:
            rec = json.loads(line)
            if rec.get("rank") == rank:
                out.append(rec["cycle"])
    return out


def _check_fault(summary: dict, trace: Path, victim: int) -> None:
    assert summary["ok"] is True, summary.get("reason")
    _exact(summary)
    dead = [r for r in summary["ranks"] if r["rank"] == victim][0]
    assert dead["phase"] == "DEAD" and dead["reason"] == "killed by signal 9", dead
    col = summary["collective"]
    assert col["generation"] >= 2 and victim not in col["members"], col
    assert sorted(col["members"]) == sorted({0, 1, 2} - {victim}), col
    survivors = {r["param_digest"] for r in summary["ranks"] if r["rank"] != victim}
    assert len(survivors) == 1 and "" not in survivors, summary["ranks"]
    # The ranks' own traces: every sample trained; anything trained twice was trained by
    # the victim in a window that was never committed (or in the batch it died in).
    assert sorted(traced_counts(trace)) == [0, 1]
    unreported = unreported_by(summary, trace, victim)  # what its last report frame had not carried
    assert 0 <= unreported <= 64 * BATCH, (unreported, dead)  # a report frame holds at most 64 batches
    assert_committed_once_despite_a_death(summary, trace, TRAIN, unreported)


def test_three_ranks_all_reduce_exactly_once_and_agree(tmp_path):
    proc, summary_path, trace, _ = _launch(tmp_path)
    summary, out = _finish(proc, summary_path)
    assert summary["ok"] is True and summary["plane"] == "collective"
    _exact(summary)
    seen = traced_counts(trace)
    assert sorted(seen) == [0, 1]
    for e, counts in seen.items():
        assert len(counts) == TRAIN and set(counts.values()) == {1}, f"epoch {e}"
    digests = {r["param_digest"] for r in summary["ranks"]}
    assert len(digests) == 1 and "" not in digests, summary["ranks"]
    assert summary["averages"] > 0
    col = summary["collective"]
    assert (col["backend"], col["generation"], col["members"], col["failures"]) == ("gloo", 1, [0, 1, 2], 0)
    assert summary["bus"]["rounds"] == 0  # nothing went through the coordinator's reducer
    assert "collective generation 1 formed" in out


def test_a_rank_killed_between_reduces(tmp_path):
    victim = 1
    proc, summary_path, trace, journal = _launch(tmp_path, "--policy", "sync")
    try:
        # Strike right after the victim acked its second reduce: its all-reduce is done and
        # the next one cannot start before it has stepped again. Polls the coordinator's
        # journal (its progress), not a clock.
        deadline = time.monotonic() + 120
        while not any(c >= 2 for c in _journal_acks(journal, victim)):
            assert proc.poll() is None and time.monotonic() < deadline, "the victim never acked cycle 2"
            time.sleep(0.01)  # polling another process's progress; nothing to wait on
        pid = rank_pid(trace, victim)
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
    except BaseException:
        proc.kill()
        raise
    summary, _ = _finish(proc, summary_path)
    _check_fault(summary, trace, victim)


def test_a_rank_killed_inside_an_all_reduce(tmp_path):
    victim, cycle = 2, 3
    proc, summary_path, trace, _ = _launch(tmp_path, env={"FLODL_FAULT": f"exit_in_collective:{cycle}@{victim}"})
    try:
        summary, out = _finish(proc, summary_path)
    finally:
        pid = rank_pid(trace, victim)
        if pid is not None:
            kill_quietly(pid)
    assert f"killing this rank inside the all-reduce of cycle {cycle}" in out
    _check_fault(summary, trace, victim)
    # The survivors' reduce of that cycle did not complete with the victim: it failed
    # (peer gone) or was abandoned for the next generation, and was acked without a
    # reduce -- or, a survivor still mid-batch when the victim's death re-formed the
    # group (a loaded machine), it was never launched: its generation was replaced.
    assert ("all-reduce failed" in out or "all-reduce abandoned" in out
            or f"cycle {cycle}: its generation was replaced" in out), out[-4000:]
