"""`flodl run --local` under SIGTERM (kill, timeout, schedulers), SIGINT (Ctrl-C) and kill -9.

A stop signal must stop the whole tree -- coordinator, agent, relay, ranks -- within a
bound, print the summary so far, and exit non-zero (the run did not complete); a
launcher killed outright must not leave its children running either.
"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from faults import lines_in
from proctree import commands, descendants, kill_all, wait_gone
from runlocal import ROOT

pytestmark = pytest.mark.integration

RANKS = 2  # coordinator + agent + relay + 2 ranks


def _start(tmp_path):
    trace = tmp_path / "trace"
    trace.mkdir()
    summary = tmp_path / "summary.json"
    cmd = [
        sys.executable, "-m", "flodl", "run", "--local", "--ranks", str(RANKS), "--task", "digits",
        "--slowdown", "1", "--base-ms", "2", "--epochs", "500", "--policy", "sync",
        "--trace-dir", str(trace), "--summary", str(summary),
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            start_new_session=True)
    end = time.monotonic() + 120
    while lines_in(trace / "rank0.trace") < 100:  # training, mid-epoch
        assert proc.poll() is None and time.monotonic() < end, "the run never started training"
        time.sleep(0.05)  # polling the rank's progress file
    tree = descendants(proc.pid)
    assert len(tree) >= 3 + RANKS, tree  # coordinator, agent, relay, ranks (+ their helpers)
    return proc, tree, summary


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_signal_stops_the_whole_tree_and_prints_the_summary_so_far(tmp_path, sig):
    proc, tree, summary = _start(tmp_path)
    try:
        t0 = time.monotonic()
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=60)
        took = time.monotonic() - t0
        left = wait_gone(tree, 10)
    finally:
        kill_all(tree | {proc.pid})
    print(f"{sig.name}: launcher exited after {took:.2f}s with {proc.returncode}")
    assert not left, f"still running after the launcher exited: {left}"
    assert took < 40, took
    assert proc.returncode == 128 + sig, (proc.returncode, err[-3000:])
    assert "Traceback" not in err, err[-3000:]
    assert "=== flodl run summary ===" in out, (out[-2000:], err[-2000:])
    assert f"stopped by {sig.name}" in err
    data = json.loads(summary.read_text())
    assert data["ok"] is False and data["epochs_completed"] < 500, data["reason"]
    assert sum(r["samples"] for r in data["ranks"]) > 0  # the summary so far, not an empty one


def test_children_die_with_a_launcher_killed_outright(tmp_path):
    proc, tree, _ = _start(tmp_path)
    named = commands(tree)
    try:
        proc.kill()  # SIGKILL: no handler runs; only PR_SET_PDEATHSIG can stop the children
        proc.wait(10)
        t0 = time.monotonic()
        left = wait_gone(tree, 30)
        took = time.monotonic() - t0
    finally:
        kill_all(tree)
    print(f"kill -9 of the launcher: its tree was gone after {took:.2f}s")
    assert not left, f"orphans of a killed launcher: {({p: named.get(p, '?') for p in left})}"
