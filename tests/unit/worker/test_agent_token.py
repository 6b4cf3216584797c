"""The agent's token: handed to its ranks only, named in its hello and every exit report."""

import sys

import pytest

from flodl.wire import pb
from flodl_worker._env import EnvError, RankEnv
from flodl_worker.agent import AgentConfig, rank_env

BASE = {"FLODL_RANK": "0", "FLODL_WORLD_SIZE": "1", "FLODL_CONNECT": "tcp://head:5555"}
CHILD = r"""
import os, sys
print("TOKEN", os.environ.get("FLODL_AGENT_TOKEN", "-"), flush=True)
sys.exit(4)
"""


def test_rank_env_carries_only_this_agents_token_and_the_rank_reads_it():
    cfg = AgentConfig(coordinator="tcp://h:1", ranks=1, command=("x",))
    env = rank_env(cfg, 0, "ipc:///tmp/r.sock", {"FLODL_AGENT_TOKEN": "ab" * 16}, b"\x01" * 16)
    assert env["FLODL_AGENT_TOKEN"] == "01" * 16
    assert "FLODL_AGENT_TOKEN" not in rank_env(cfg, 0, "ipc:///tmp/r.sock", {"FLODL_AGENT_TOKEN": "ab" * 16})
    got = RankEnv.from_environ(env)
    assert got.agent_token == b"\x01" * 16 and "01010101" not in repr(got)
    assert RankEnv.from_environ(BASE).agent_token == b""
    with pytest.raises(EnvError, match="FLODL_AGENT_TOKEN is not hex"):
        RankEnv.from_environ({**BASE, "FLODL_AGENT_TOKEN": "zz"})


def test_an_agent_without_rank_offset_pins_no_rank_and_names_its_processes_by_local_rank():
    from flodl_worker._env import UNPINNED
    from flodl_worker.agent import Agent, _Child

    unpinned = AgentConfig(coordinator="tcp://127.0.0.1:1", ranks=2, command=("x",), world_size=4)
    env = rank_env(unpinned, 1, "ipc:///tmp/r.sock", {"FLODL_RANK": "3"})  # an inherited one is dropped
    assert "FLODL_RANK" not in env and (env["FLODL_LOCAL_RANK"], env["FLODL_WORLD_SIZE"]) == ("1", "4")
    got = RankEnv.from_environ(env)
    assert got.rank == UNPINNED and not got.pinned and got.local_rank == 1
    pinned = AgentConfig(coordinator="tcp://h:1", ranks=2, command=("x",), rank_offset=2, world_size=4)
    assert rank_env(pinned, 1, "ipc:///tmp/r.sock", {})["FLODL_RANK"] == "3"
    a = Agent(unpinned)
    try:
        child = _Child("local 1", None, None, 1)
        child.tail.extend(["Traceback (most recent call last):", "x" * 500])
        report = a._exit_report(child, 1, restarting=True)
        assert report.HasField("unpinned_slot") and report.unpinned_slot == 1 and report.restarting
        assert list(report.last_lines) == ["Traceback (most recent call last):", "x" * 300]  # cut to 300
        assert not a._exit_report(_Child("rank 3", None, 3, 1), 0, False).HasField("unpinned_slot")
    finally:
        a.close()


@pytest.mark.integration
def test_the_agent_names_its_ranks_token_in_hello_and_exit_report(coordinator, procs, py, lines):
    agent = procs.start(py("flodl_worker", "agent", "--coordinator", coordinator.endpoint, "--session",
                           coordinator.session, "--host", "hostT", "--ranks", "1", "--no-relay", "--",
                           sys.executable, "-c", CHILD))
    _, d = coordinator.expect("agent", "hello")
    token = d.envelope.agent.hello.token
    assert len(token) == 16
    assert list(d.envelope.agent.hello.ranks) == []  # no --rank-offset: it pins (claims) no rank
    _, d = coordinator.expect("agent", "rank_exited")
    exited = d.envelope.agent.rank_exited
    assert (exited.code, exited.token, exited.HasField("unpinned_slot"), exited.unpinned_slot) == (4, token, True, 0)
    assert lines(agent.stdout).wait_for(r"^\[local 0\] TOKEN (\S+)$").group(1) == token.hex()
    assert agent.wait(15) == 1
