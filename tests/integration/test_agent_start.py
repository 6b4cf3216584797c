"""The agent says in seconds what is wrong with its coordinator, and restarts a failed rank.

* no coordinator at the address: a warning naming the address and the session after ~5 s,
  while it keeps trying (before: the ranks' 60 s hello timeout, naming the relay's ipc path);
* a wrong session: the coordinator answers the hello with a refusal naming the session,
  and the agent exits 2 (a configuration error) at once;
* ``--max-restarts``: a rank process that fails before the world forms is started again
  (FLODL_RESTART_COUNT) and the run completes.
"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from runlocal import ROOT, free_port

pytestmark = pytest.mark.integration

TASK = [sys.executable, "-m", "flodl_worker.examples.digits"]


def _agent(port: int, session: str, *extra: str, command=TASK) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "flodl_worker", "agent", "--coordinator", f"tcp://127.0.0.1:{port}",
           "--ranks", "2", "--rank-offset", "0", "--session", session, "--base-ms", "0", *extra, "--", *command]  # fmt: skip
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _coordinator(port: int, session: str, summary) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "flodl_coordinator", "serve", "--bind", f"tcp://127.0.0.1:{port}",
           "--session", session, "--world-size", "2", "--epochs", "2", "--summary", str(summary)]  # fmt: skip
    log = open(summary.parent / "coordinator.log", "w")
    p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=log, text=True)
    assert p.stdout.readline().startswith("COORDINATOR_READY")
    return p


def test_no_coordinator_is_named_within_seconds_while_the_agent_keeps_trying():
    port = free_port()  # nobody listens there
    agent = _agent(port, "lonely")
    t0 = time.monotonic()
    try:
        for line in agent.stderr:
            if "no answer from the coordinator" in line:
                break
        took = time.monotonic() - t0
        assert f"tcp://127.0.0.1:{port}" in line and "'lonely'" in line and "still trying" in line, line
        assert took < 20, took  # ~5 s, with the interpreter's start-up
        assert agent.poll() is None  # still trying
    finally:
        agent.send_signal(signal.SIGTERM)
        agent.communicate(timeout=30)


def test_a_wrong_session_is_refused_by_name_and_the_agent_exits_2(tmp_path):
    port = free_port()
    coord = _coordinator(port, "the-run", tmp_path / "summary.json")
    try:
        agent = _agent(port, "typo-run")
        _, err = agent.communicate(timeout=60)
    finally:
        coord.send_signal(signal.SIGTERM)
        coord.communicate(timeout=30)
    assert agent.returncode == 2, err[-3000:]
    assert "refused this agent: session 'typo-run' is not this coordinator's run" in err, err[-3000:]
    assert "the-run" not in err  # the coordinator does not tell a stranger its session


def test_a_rank_that_fails_before_the_world_forms_is_restarted_and_the_run_completes(tmp_path):
    port = free_port()
    summary = tmp_path / "summary.json"
    coord = _coordinator(port, "restarts", summary)
    # rank 1's first process fails at once; its restart (FLODL_RESTART_COUNT=1) trains
    flaky = ["sh", "-c", 'if [ "$FLODL_RANK" = 1 ] && [ -z "$FLODL_RESTART_COUNT" ]; then exit 3; fi; exec "$@"',
             "flaky", *TASK]  # fmt: skip
    agent = _agent(port, "restarts", "--max-restarts", "1", command=flaky)
    try:
        _, err = agent.communicate(timeout=180)
        coord.communicate(timeout=60)
        out = (tmp_path / "coordinator.log").read_text()
    finally:
        for p in (agent, coord):
            if p.poll() is None:
                p.kill()
    assert coord.returncode == 0, out[-3000:]
    data = json.loads(summary.read_text())
    assert data["ok"] is True and all(c["missing"] == 0 and c["duplicates"] == 0 for c in data["coverage"])
    assert "rank 1 failed (exit code 3): restarting it in 1s (restart 1 of 1)" in err, err[-3000:]
    assert agent.returncode == 0, err[-3000:]  # the restarted process exited cleanly
