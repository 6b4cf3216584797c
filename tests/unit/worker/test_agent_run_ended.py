"""Once the coordinator says the run ended, the agent restarts no rank and stops what is left.

Found by the churn campaign (``bench/elastic.py --churn``): a rank killed just before the
run's end was restarted by its agent after the coordinator had exited; the new process
waited for a hello nobody answered (the ranks' hello timeout, 60 s), failed, and was
restarted again -- the agent, and the host's service with it, hung for up to
``--max-restarts`` x 60 s after a finished run.
"""

from __future__ import annotations

import sys

import pytest

from flodl.wire import pb
from flodl_worker import agent as agent_mod

# The first process of rank 0 fails at once; the restarted one waits, as a rank waiting
# for the hello_ack of a coordinator that is gone would.
CHILD = r"""
import os, sys, time
if os.environ.get("FLODL_RESTART_COUNT", "0") == "0":
    sys.exit(3)
print("RESTARTED", os.getpid(), flush=True)
time.sleep(120)
"""

RUN_ENDED = pb.AgentMsg(run_ended=pb.AgentMsg.RunEnded(ok=True, reason="completed"))


def test_a_failed_rank_is_not_restarted_once_the_run_ended():
    a = agent_mod.Agent(agent_mod.AgentConfig(coordinator="tcp://127.0.0.1:1", ranks=1, command=("true",),
                                              max_restarts=5))  # fmt: skip
    try:
        child = agent_mod._Child("rank 0", proc=None, rank=0, local=0)
        a._maybe_restart(child, 1)
        assert list(a.restart_at) == [0]  # in backoff ...
        a._on_run_ended(RUN_ENDED.run_ended, now=100.0)
        assert a.restart_at == {}  # ... and not started for a run that is over
        a._maybe_restart(agent_mod._Child("rank 1", proc=None, rank=1, local=1), 1)
        assert a.restart_at == {}  # a rank failing after the end is not restarted either
    finally:
        a.close()


@pytest.mark.integration
def test_a_restarted_rank_left_running_after_the_run_ended_is_stopped(coordinator, procs, py, lines):
    argv = py("flodl_worker", "agent", "--coordinator", coordinator.endpoint, "--session", coordinator.session,
              "--host", "hostB", "--ranks", "1", "--no-relay", "--max-restarts", "50", "--",
              sys.executable, "-c", CHILD)  # fmt: skip
    agent = procs.start(argv)
    route, _ = coordinator.expect("agent", "hello")
    _, d = coordinator.expect("agent", "rank_exited")
    assert d.envelope.agent.rank_exited.code == 3
    lines(agent.stdout).wait_for(r"^\[local 0\] RESTARTED", timeout=30)  # (no --rank-offset: unpinned)
    coordinator.send(route, "agent", RUN_ENDED)
    # Stopped after the grace, not left to time out its hello and be restarted again.
    assert agent.wait(agent_mod.RUN_ENDED_GRACE_S + 10) == 0
    _, d = coordinator.expect("agent", "rank_exited")
    assert d.envelope.agent.rank_exited.code == -15
    err = agent.stderr.read().decode()
    assert "still running 5s after the run ended: stopping them" in err, err[-2000:]
