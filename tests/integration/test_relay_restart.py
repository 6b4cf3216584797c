"""kill -9 of a host's relay mid-run.

Today the agent gives the host up and says so: the coordinator logs the agent's reason
naming the relay and lists it under ``agent_errors`` in the summary (before, the ranks
just showed up as "killed by signal 15"). Surviving it -- the agent restarting the relay
on the same bind with the same uplink identity, the run finishing ok with exact
coverage -- needs the coordinator to resynchronise the host's ranks (frames inside the
dead relay are lost); that test is a strict xfail until it does.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from faults import lines_in
from proctree import descendants, kill_all, wait_gone
from runlocal import ROOT, assert_exact_coverage

pytestmark = pytest.mark.integration

TRAIN = 1437


def _relay_pid(launcher: int) -> int | None:
    for pid in descendants(launcher):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"flodl_worker" in cmd and b"relay" in cmd:
            return pid
    return None


def _run_and_kill_the_relay(tmp_path, policy: str, at: int, epochs: int):
    trace = tmp_path / "trace"
    trace.mkdir()
    summary = tmp_path / "summary.json"
    cmd = [
        sys.executable, "-m", "flodl", "run", "--local", "--ranks", "3", "--task", "digits",
        "--slowdown", "1,2,3", "--base-ms", "3", "--epochs", str(epochs), "--batch-size", "16",
        "--policy", policy, "--trace-dir", str(trace), "--summary", str(summary),
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                            start_new_session=True)
    tree: set[int] = set()
    try:
        end = time.monotonic() + 120
        while lines_in(trace / "rank0.trace") < at:
            assert proc.poll() is None and time.monotonic() < end, "the run never got there"
            time.sleep(0.02)  # polling the rank's progress
        tree = descendants(proc.pid)
        relay = _relay_pid(proc.pid)
        assert relay is not None, tree
        t0 = time.monotonic()
        os.kill(relay, signal.SIGKILL)
        out, _ = proc.communicate(timeout=90)
        took = time.monotonic() - t0
        left = wait_gone(tree, 10)
    finally:
        kill_all(tree | {proc.pid})
    data = json.loads(summary.read_text()) if summary.exists() else None
    return proc, out, data, trace, took, left


def test_a_relay_that_dies_is_reported_by_name_and_the_host_stops(tmp_path):
    proc, out, data, _, took, left = _run_and_kill_the_relay(tmp_path, "cadence", 300, 200)
    print(f"relay kill -9 -> run over after {took:.2f}s")
    assert not left, left
    assert proc.returncode != 0 and data is not None and data["ok"] is False, out[-4000:]
    why = "relay exited unexpectedly (killed by signal 9); giving up: stopping ranks [0, 1, 2]"
    assert any(why in e for e in data["agent_errors"]), data.get("agent_errors")
    assert any(line.startswith("[coordinator]") and " ERROR agent on " in line and why in line
               for line in out.splitlines()), out[-4000:]
    assert took < 60, took


@pytest.mark.xfail(strict=True, reason="relay restart needs the coordinator to resync the host's ranks "
                   "(frames inside the dead relay are lost); the agent does not restart it yet")
def test_kill9_of_the_relay_mid_run_is_survived_with_exact_coverage(tmp_path):
    proc, out, data, trace, _, _ = _run_and_kill_the_relay(tmp_path, "cadence", 400, 3)
    assert proc.returncode == 0, out[-5000:]
    assert data["ok"] is True, data["reason"]
    assert all(r["phase"] != "DEAD" for r in data["ranks"]), data["ranks"]
    assert_exact_coverage(data, trace, 3, TRAIN)
