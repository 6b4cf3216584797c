"""The agent: starts its relay and ranks, says hello, reports every exit at once
(Popen semantics: negative = signal), forwards SIGTERM, and drives a real rank end to end."""

from __future__ import annotations

import os
import signal
import sys

import pytest

from flodl.wire import pb
from flodl_worker import cli

STARTUP_S = 30.0  # python + torch import on a loaded machine

# One command for every rank, as with `-- python train.py`: it behaves by FLODL_RANK.
CHILD = r"""
import os, sys, time
rank = int(os.environ["FLODL_RANK"])
keys = ("FLODL_LOCAL_RANK", "FLODL_WORLD_SIZE", "FLODL_SESSION", "FLODL_HOST", "FLODL_SLOWDOWN",
        "FLODL_BASE_MS", "FLODL_TRACE_DIR", "FLODL_CONNECT")
print("ENV", rank, " ".join(f"{k}={os.environ.get(k, '-')}" for k in keys), flush=True)
if os.environ.get("MODE") == "exits" and rank == 0:
    print("rank zero fails", file=sys.stderr, flush=True)
    sys.exit(3)
print("PID", os.getpid(), flush=True)
time.sleep(60)
"""


def start_agent(procs, py, coordinator, *flags, command=(sys.executable, "-c", CHILD), env=None):
    pin = () if "--rank-offset" in flags else ("--rank-offset", "0")  # CHILD behaves by FLODL_RANK
    argv = py("flodl_worker", "agent", "--coordinator", coordinator.endpoint, "--session", coordinator.session,
              "--host", "hostB", *pin, *flags, "--", *command)
    return procs.start(argv, env=env)


def expect_exit(coordinator, rank: int, code: int):
    _, d = coordinator.expect("agent", "rank_exited")
    env = d.envelope
    assert env.sender.kind == pb.Sender.KIND_AGENT and env.sender.host == "hostB"
    assert (env.agent.rank_exited.rank, env.agent.rank_exited.code) == (rank, code)
    return env.agent.rank_exited


@pytest.mark.integration
def test_agent_reports_exit_code_and_signal(coordinator, procs, py, lines, tmp_path):
    agent = start_agent(procs, py, coordinator, "--ranks", "2", "--slowdown", "1,2.5", "--base-ms", "7",
                        "--trace-dir", str(tmp_path), env={"MODE": "exits"})
    _, d = coordinator.expect("agent", "hello")
    assert d.envelope.sender.kind == pb.Sender.KIND_AGENT
    assert (d.envelope.agent.hello.host, list(d.envelope.agent.hello.ranks)) == ("hostB", [0, 1])
    report = expect_exit(coordinator, 0, 3)
    assert list(report.last_lines) == ["rank zero fails"] and not report.restarting  # (no --max-restarts)

    out = lines(agent.stdout)
    env1 = dict(kv.split("=", 1) for kv in out.wait_for(r"^\[rank 1\] ENV 1 (.*)$").group(1).split())
    assert env1["FLODL_LOCAL_RANK"] == "1" and env1["FLODL_WORLD_SIZE"] == "2"
    assert env1["FLODL_SESSION"] == coordinator.session and env1["FLODL_HOST"] == "hostB"
    assert env1["FLODL_SLOWDOWN"] == "2.5" and env1["FLODL_BASE_MS"] == "7.0"
    assert env1["FLODL_TRACE_DIR"] == str(tmp_path) and env1["FLODL_CONNECT"].startswith("ipc://")
    pid = int(out.wait_for(r"^\[rank 1\] PID (\d+)$").group(1))
    os.kill(pid, signal.SIGKILL)
    expect_exit(coordinator, 1, -signal.SIGKILL)

    assert agent.wait(15) == 1  # not every rank exited 0
    assert b"[rank 0] rank zero fails" in agent.stderr.read()


@pytest.mark.integration
def test_agent_sigterm_stops_ranks_and_exits_0(coordinator, procs, py, lines):
    agent = start_agent(procs, py, coordinator, "--ranks", "2", "--rank-offset", "4", "--world-size", "8",
                        "--no-relay")
    _, d = coordinator.expect("agent", "hello")
    assert list(d.envelope.agent.hello.ranks) == [4, 5]
    out = lines(agent.stdout)
    env4 = out.wait_for(r"^\[rank 4\] ENV 4 (.*)$").group(1)
    assert f"FLODL_CONNECT={coordinator.endpoint}" in env4 and "FLODL_WORLD_SIZE=8" in env4
    out.wait_for(r"^\[rank 4\] PID")
    out.wait_for(r"^\[rank 5\] PID")
    agent.send_signal(signal.SIGTERM)
    exits = set()
    for _ in range(2):
        _, d = coordinator.expect("agent", "rank_exited")
        exits.add((d.envelope.agent.rank_exited.rank, d.envelope.agent.rank_exited.code))
    assert exits == {(4, -signal.SIGTERM), (5, -signal.SIGTERM)}
    assert agent.wait(15) == 0


@pytest.mark.integration
def test_agent_runs_a_real_rank_through_its_relay(coordinator, procs, py, tmp_path):
    command = (sys.executable, "-m", "flodl_worker.examples.synthetic", "--samples", "32", "--features", "8",
               "--hidden", "8", "--test-samples", "8")
    agent = start_agent(procs, py, coordinator, "--ranks", "1", "--trace-dir", str(tmp_path), command=command)
    coordinator.expect("agent", "hello")
    route, d = coordinator.expect("hello", timeout=STARTUP_S)
    assert len(route) == 2 and route[0].startswith(b"relay-hostB-")  # [relay_id, rank_id]
    assert d.envelope.hello.host == "hostB"
    run = pb.RunSpec(world_size=1, total_samples=32, batch_size=16, num_epochs=1, seed=3, gamma=1.0,
                     heartbeat_interval_s=1.0, liveness_timeout_s=10.0)
    coordinator.send(route, "hello_ack", pb.HelloAck(accepted=True, run=run))
    coordinator.control(route, start_epoch=pb.Control.StartEpoch(plan=pb.EpochPlan(epoch=0, partition_size=32)))
    for offset in (0, 16):
        _, d = coordinator.expect("timing", "batch")
        assert d.envelope.timing.batch.offset == offset
    coordinator.expect("metrics")
    coordinator.control(route, shutdown=pb.Control.Shutdown(reason="done"))
    _, d = coordinator.expect("timing", "exiting")
    assert d.envelope.timing.exiting.steps == 2
    expect_exit(coordinator, 0, 0)
    assert agent.wait(15) == 0
    assert len((tmp_path / "rank0.trace").read_text().splitlines()) == 32


@pytest.mark.integration
def test_agent_bad_command_is_exit_1(coordinator, procs, py):
    agent = start_agent(procs, py, coordinator, "--ranks", "1", "--no-relay", command=("/nonexistent/flodl-cmd",))
    assert agent.wait(15) == 1
    assert b"flodl agent:" in agent.stderr.read()


def test_cli_bad_flags_one_line_exit_2(capsys, monkeypatch):
    monkeypatch.delenv("FLODL_COORDINATOR", raising=False)
    coord = ["agent", "--coordinator", "tcp://127.0.0.1:1"]
    for argv, needle in [
        ([*coord, "--ranks", "0", "--", "true"], "--ranks"),
        ([*coord, "--ranks", "2"], "after --"),
        ([*coord, "--ranks", "2", "--slowdown", "1,2,3", "--", "x"], "--slowdown"),
        ([*coord, "--ranks", "2", "--world-size", "1", "--", "x"], "exceed"),
        ([*coord, "--ranks", "2", "--world-size", "4", "--slowdown", "1,2,3,4", "--", "x"], "needs --rank-offset"),
        (["agent", "--coordinator", "nope", "--ranks", "1", "--", "x"], "not a ZeroMQ endpoint"),
        (["agent", "--ranks", "1", "--", "x"], "--coordinator is required"),
        (["relay", "--coordinator", "tcp://127.0.0.1:1"], "--bind"),
        (["frobnicate"], "invalid choice"),
    ]:
        with pytest.raises(SystemExit) as e:
            cli.main(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2, (argv, err)
        assert err.count("\n") == 1 and needle in err, (argv, err)


def test_cli_help_names_every_flag(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["agent", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--coordinator", "--ranks", "--rank-offset", "--world-size", "--session", "--host", "--slowdown",
                 "--base-ms", "--trace-dir", "--relay-bind", "--no-relay", "--term-timeout", "-- COMMAND"):
        assert flag in out, flag


def test_a_relay_that_dies_before_it_is_ready_is_started_again(monkeypatch):
    # (a kill -9 of the relay in its first second used to end the agent: no ranks, and a
    # world that never formed)
    from flodl_worker import agent as agent_mod

    a = agent_mod.Agent(agent_mod.AgentConfig(coordinator="tcp://127.0.0.1:1", ranks=1, command=("true",)))
    tries = []

    def start():
        tries.append(1)
        if len(tries) < 3:
            raise RuntimeError("relay did not report RELAY_READY (exit code -9)")
        return "ipc:///tmp/x"

    monkeypatch.setattr(a, "_start_relay", start)
    monkeypatch.setattr(agent_mod.time, "sleep", lambda s: None)
    try:
        assert a._first_relay() == "ipc:///tmp/x" and len(tries) == 3
        tries.clear()
        monkeypatch.setattr(a, "_start_relay", lambda: (tries.append(1), (_ for _ in ()).throw(RuntimeError("dead")))[1])
        with pytest.raises(RuntimeError, match="dead"):
            a._first_relay()
        assert len(tries) == len(agent_mod.RELAY_RESTART_DELAYS_S) + 1  # then it gives up
    finally:
        a.close()


@pytest.mark.integration
def test_agent_tells_systemd_it_is_ready_once_the_coordinator_took_it(coordinator, procs, py, tmp_path):
    import socket

    path = str(tmp_path / "notify.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sd:
        sd.bind(path)
        sd.settimeout(STARTUP_S)
        agent = start_agent(procs, py, coordinator, "--ranks", "1", "--no-relay", env={"NOTIFY_SOCKET": path})
        coordinator.expect("agent", "hello")  # the fake coordinator accepts every agent's hello
        lines = sd.recv(4096).decode().split("\n")
        assert lines[0] == "READY=1" and lines[1].startswith("STATUS=ranks [0] in the run of tcp://")
    agent.send_signal(signal.SIGTERM)
    assert agent.wait(15) == 0
