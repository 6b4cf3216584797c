"""ZeroMQ MAXMSGSIZE on the worker side: the rank's env, the agent's hand-off, the relay."""

import time

import pytest
import zmq

from flodl.limits import DEFAULT_MAX_MESSAGE_BYTES, MIN_MAX_MESSAGE_BYTES
from flodl_worker import cli
from flodl_worker._env import EnvError, RankEnv
from flodl_worker.agent import AgentConfig, rank_env
from flodl_worker.relay import READY_PREFIX

BASE = {"FLODL_RANK": "0", "FLODL_WORLD_SIZE": "1", "FLODL_CONNECT": "tcp://head:5555"}


def test_rank_env_reads_the_message_limit_and_refuses_a_bad_one():
    assert RankEnv.from_environ(BASE).max_message_bytes == DEFAULT_MAX_MESSAGE_BYTES
    assert RankEnv.from_environ({**BASE, "FLODL_MAX_MESSAGE_BYTES": "0"}).max_message_bytes == 0
    assert RankEnv.from_environ({**BASE, "FLODL_MAX_MESSAGE_BYTES": str(8 << 30)}).max_message_bytes == 8 << 30
    with pytest.raises(EnvError, match="FLODL_MAX_MESSAGE_BYTES='lots' is not an integer"):
        RankEnv.from_environ({**BASE, "FLODL_MAX_MESSAGE_BYTES": "lots"})
    with pytest.raises(EnvError, match="FLODL_MAX_MESSAGE_BYTES=1000 must be 0"):
        RankEnv.from_environ({**BASE, "FLODL_MAX_MESSAGE_BYTES": "1000"})


def test_the_agent_hands_its_limit_to_every_rank():
    cfg = AgentConfig(coordinator="tcp://h:1", ranks=2, command=("x",), max_message_bytes=8 << 30)
    env = rank_env(cfg, 1, "ipc:///tmp/r.sock", {"FLODL_MAX_MESSAGE_BYTES": "123"})
    assert env["FLODL_MAX_MESSAGE_BYTES"] == str(8 << 30)
    assert RankEnv.from_environ(env).max_message_bytes == 8 << 30


def test_cli_refuses_a_bad_limit_in_one_line(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["relay", "--coordinator", "tcp://127.0.0.1:1", "--bind", "ipc:///tmp/x", "--max-message-bytes", "7"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and "--max-message-bytes=7 must be 0" in err, err


@pytest.mark.integration
def test_the_relay_disconnects_a_rank_that_sends_a_part_over_the_limit(coordinator, procs, py, lines):
    proc = procs.start(py("flodl_worker", "relay", "--coordinator", coordinator.endpoint, "--bind",
                          "tcp://127.0.0.1:0", "--host", "hostA", "--max-message-bytes", str(MIN_MAX_MESSAGE_BYTES)))
    endpoint = lines(proc.stdout).wait_for(rf"^{READY_PREFIX} (\S+)$").group(1)
    ctx = zmq.Context()
    try:
        big, small = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
        for s in (big, small):
            s.setsockopt(zmq.LINGER, 0)
            s.connect(endpoint)
        big.send_multipart([b"", b"env-big", b"\0" * (MIN_MAX_MESSAGE_BYTES + 1)])
        time.sleep(0.5)  # let the big one reach the relay first (it must never come out)
        small.send_multipart([b"", b"env-small", b"\0" * 1000])
        got = []
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline:
            if coordinator.sock.poll(100):
                got.append(coordinator.sock.recv_multipart()[3])
        assert got == [b"env-small"], got
        assert proc.poll() is None
    finally:
        ctx.destroy(0)
