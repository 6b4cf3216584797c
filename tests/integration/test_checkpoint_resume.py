"""Checkpoint, stop, resume: coverage exact and training continues (the issue's test).

Run 1 trains with a consensus checkpoint every epoch and is stopped (SIGINT to the
launcher: the coordinator gets SIGTERM) once a checkpoint is committed. Run 2 resumes
from the checkpoint root. The ranks' own traces of run 2 must be *exactly* the samples
the checkpoint left uncovered -- each once, none of the covered ones -- and the run must
go on to the last epoch.
"""

import os
import signal
import subprocess
import sys
import time
from collections import Counter

import pytest

from flodl.core import resume_plan
from flodl.shuffle import epoch_permutation
from flodl_coordinator.checkpoints import load_checkpoint
from runlocal import ROOT, run_local, traced_counts

pytestmark = pytest.mark.integration

EPOCHS = 8
SAMPLES = 256
SEED = 11
ARGS = (
    "--ranks", "2", "--task", "synthetic", "--epochs", str(EPOCHS),
    "--batch-size", "16", "--seed", str(SEED), "--base-ms", "20", "--quiet",
)  # fmt: skip
TASK = ("--", "--samples", str(SAMPLES), "--test-samples", "64", "--features", "8", "--hidden", "16")


def _stop_after_first_checkpoint(ck_dir, tmp_path, policy) -> None:
    cmd = [sys.executable, "-m", "flodl", "run", "--local", *ARGS, "--policy", policy, "--checkpoint-dir", str(ck_dir),
           "--checkpoint-every", "1", "--summary", str(tmp_path / "s1.json"), *TASK]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (ck_dir / "latest").exists():
            assert proc.poll() is None, "run 1 ended without committing a checkpoint"
            assert time.monotonic() < deadline, "no checkpoint within 120 s"
            time.sleep(0.05)  # polling a file another process creates, not synchronising
        proc.send_signal(signal.SIGINT)  # the launcher stops its coordinator and agent
        proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


@pytest.mark.parametrize("policy", ["sync", "cadence"])
def test_checkpoint_stop_resume_trains_exactly_the_uncovered_samples(tmp_path, policy):
    ck_dir = tmp_path / "ck"
    _stop_after_first_checkpoint(ck_dir, tmp_path, policy)
    ck = load_checkpoint(str(ck_dir))  # complete and verified, whatever moment it was stopped
    point = resume_plan(ck.meta)
    assert point.epoch < EPOCHS

    run2 = tmp_path / "run2"
    run2.mkdir()
    proc, summary, trace = run_local(run2, *ARGS, "--policy", policy, "--resume", str(ck_dir), *TASK)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert summary["ok"] is True and summary["checkpoints"]["resumed_from"] == ck.path

    want: dict[int, Counter] = {}
    for e in range(point.epoch, EPOCHS):
        perm = epoch_permutation(SEED, e, SAMPLES)
        want[e] = Counter(int(perm[p]) for off, n in point.uncovered(e) for p in range(off, off + n))
    got = {e: c for e, c in traced_counts(trace).items() if c}
    assert got == {e: c for e, c in want.items() if c}  # exactly the uncovered samples, each once
    for row in summary["coverage"]:
        assert (row["duplicates"], row["missing"]) == (0, 0), row
    assert os.path.isdir(ck.path)


def test_every_asked_checkpoint_is_committed_on_unequal_fast_ranks(tmp_path):
    """Issue 9, item 1: 3 ranks at 1,2,4 with no emulated delay (fast ranks run ahead, as
    on real GPUs) and a checkpoint every epoch. It used to commit 11-14 of 15 and say ok:
    the rank was asked for a consensus it no longer held. Issue 11: two epochs aggregated
    at one consensus (Cadence streams short epochs, run_ahead folds two windows) shared
    one checkpoint. Now every epoch has its own, loadable, of that epoch, and a consensus
    is saved once (a second epoch's checkpoint hard-links the save's files)."""
    ck_dir = tmp_path / "ck"
    proc, summary, _ = run_local(
        tmp_path, "--ranks", "3", "--task", "digits", "--slowdown", "1,2,4", "--base-ms", "0", "--epochs", "15",
        "--checkpoint-dir", str(ck_dir), "--checkpoint-every", "1", "--quiet",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    cks = summary["checkpoints"]
    assert summary["ok"] is True and cks["missing"] == [], cks
    assert [c["epoch"] for c in cks["committed"]] == list(range(15)) == cks["epochs"], cks  # N of N
    inodes: dict[int, set] = {}
    for c in cks["committed"]:
        ck = load_checkpoint(c["path"])
        assert ck.meta["last_aggregated_epoch"] == c["epoch"] and ck.meta["epoch"] == c["epoch"] + 1
        inodes.setdefault(ck.meta["version"], set()).add(os.stat(ck.model_path).st_ino)
    assert all(len(s) == 1 for s in inodes.values()), inodes  # one save per consensus
