"""The relay process: identities stack on the way up, unstack on the way down, a reply
to a vanished rank is dropped without harming the others, SIGTERM is a clean exit."""

from __future__ import annotations

import signal

import pytest
import zmq

from flodl_worker.relay import READY_PREFIX


def start_relay(procs, py, coordinator, bind: str):
    return procs.start(
        py("flodl_worker", "relay", "--coordinator", coordinator.endpoint, "--bind", bind, "--host", "hostA")
    )


def rank_socket(ctx, endpoint: str, identity: bytes) -> zmq.Socket:
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.IDENTITY, identity)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(endpoint)
    return s


def recv(sock: zmq.Socket, timeout: float = 5.0) -> list[bytes]:
    assert sock.poll(int(timeout * 1000)), "nothing arrived"
    return sock.recv_multipart()


def up(coordinator, timeout: float = 5.0) -> list[bytes]:
    assert coordinator.sock.poll(int(timeout * 1000)), "nothing reached the coordinator"
    return coordinator.sock.recv_multipart()


@pytest.mark.integration
@pytest.mark.parametrize("scheme", ["tcp", "ipc"])
def test_relay_routes_both_ways_and_survives_vanished_rank(coordinator, procs, py, lines, tmp_path, scheme):
    bind = "tcp://127.0.0.1:0" if scheme == "tcp" else f"ipc://{tmp_path}/relay.sock"
    proc = start_relay(procs, py, coordinator, bind)
    endpoint = lines(proc.stdout).wait_for(rf"^{READY_PREFIX} (\S+)$").group(1)
    if scheme == "tcp":
        assert endpoint.startswith("tcp://127.0.0.1:") and not endpoint.endswith(":0")
    else:
        assert endpoint == bind

    ctx = zmq.Context()
    try:
        a = rank_socket(ctx, endpoint, b"rank-a")
        b = rank_socket(ctx, endpoint, b"rank-b")
        a.send_multipart([b"", b"env-a", b"blob"])
        relay_id, rank_id, delim, *payload = up(coordinator)
        assert relay_id.startswith(b"relay-hostA-")
        assert (rank_id, delim, payload) == (b"rank-a", b"", [b"env-a", b"blob"])
        b.send_multipart([b"", b"env-b"])
        assert up(coordinator) == [relay_id, b"rank-b", b"", b"env-b"]

        coordinator.sock.send_multipart([relay_id, b"rank-a", b"", b"reply-a"])
        assert recv(a) == [b"", b"reply-a"]

        # rank-b goes away; a reply to it, and one to a rank that never existed, must be
        # dropped (no ROUTER_MANDATORY on the frontend), not take the proxy down.
        b.close(0)
        coordinator.sock.send_multipart([relay_id, b"rank-b", b"", b"to-the-gone"])
        coordinator.sock.send_multipart([relay_id, b"never-was", b"", b"to-nobody"])
        coordinator.sock.send_multipart([relay_id, b"rank-a", b"", b"still-here"])
        assert recv(a) == [b"", b"still-here"]
        a.send_multipart([b"", b"env-a2"])
        assert up(coordinator) == [relay_id, b"rank-a", b"", b"env-a2"]
        assert proc.poll() is None
    finally:
        ctx.destroy(0)

    proc.send_signal(signal.SIGTERM)
    assert proc.wait(10) == 0


@pytest.mark.integration
def test_relay_bind_failure_is_exit_1(procs, py, coordinator):
    proc = start_relay(procs, py, coordinator, "ipc:///nonexistent-dir/for/flodl/relay.sock")
    assert proc.wait(10) == 1
    assert b"cannot bind" in proc.stderr.read()
