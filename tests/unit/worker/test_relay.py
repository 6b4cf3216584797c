"""The relay process: identities stack on the way up, unstack on the way down, a reply
to a vanished rank is dropped without harming the others, SIGTERM is a clean exit; it
folds a host's rounds into one frame, and a rank dying mid-fold does not block it."""

from __future__ import annotations

import signal

import numpy as np
import pytest
import zmq

from flodl.wire import Endpoint, decode, pack_round, pb, split_routing, unpack_round
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


# -- folding -----------------------------------------------------------------------------

SHAPES = [(4, 3), (5,)]


class FakeRank:
    """A rank's DEALER behind the relay that only speaks the round protocol."""

    def __init__(self, ctx, endpoint: str, rank: int, session: str):
        self.rank, self.identity = rank, f"rank-{rank}".encode()
        self.sock = rank_socket(ctx, endpoint, self.identity)
        self.ep = Endpoint(session, pb.Sender.KIND_RANK, rank=rank, incarnation=rank + 1)
        rng = np.random.default_rng(rank)
        self.params = [rng.standard_normal(s).astype(np.float32) for s in SHAPES]

    def send_round(self, cycle: int, weight: float, bf16: bool = False) -> None:
        header, blobs = pack_round([p * np.float32(weight) for p in self.params], cycle=cycle, weight=weight, bf16=bf16)
        self.sock.send_multipart(self.ep.frames("round", header, blobs))

    def send_timing(self) -> None:
        self.sock.send_multipart(self.ep.frames("timing", pb.Timing(rank=self.rank, heartbeat=pb.Timing.Heartbeat())))

    def await_control(self) -> None:
        d = decode(split_routing(recv(self.sock))[1], session=None)
        assert d.kind == "control"


def relay_up(coordinator, timeout: float = 5.0):
    """(route, Decoded) of the next frame that reached the coordinator."""
    route, payload = split_routing(up(coordinator, timeout))
    return route, decode(payload, session=coordinator.session)


def open_fold(coordinator, relay_id: bytes, cycle: int, ranks) -> None:
    """FoldOpen, then a RequestParams to each rank *through the relay*: the same FIFO pipe,
    so no rank answers before the relay knows the fold (as in the real protocol)."""
    fo = pb.RelayMsg.FoldOpen(cycle=cycle, ranks=[r.rank for r in ranks], identities=[r.identity for r in ranks])
    coordinator.send((relay_id,), "relay", pb.RelayMsg(fold_open=fo))
    for r in ranks:
        coordinator.control((relay_id, r.identity), request_params=pb.Control.RequestParams(cycle=cycle))
    for r in ranks:
        r.await_control()


def fold_drop(coordinator, relay_id: bytes, cycle: int, rank: int) -> None:
    coordinator.send((relay_id,), "relay", pb.RelayMsg(fold_drop=pb.RelayMsg.FoldDrop(cycle=cycle, rank=rank)))


def start_and_learn_id(procs, py, coordinator, lines, tmp_path, ctx, *extra):
    proc = procs.start(py("flodl_worker", "relay", "--coordinator", coordinator.endpoint,
                          "--bind", f"ipc://{tmp_path}/relay.sock", "--host", "hostF", *extra))  # fmt: skip
    endpoint = lines(proc.stdout).wait_for(rf"^{READY_PREFIX} (\S+)$").group(1)
    ranks = [FakeRank(ctx, endpoint, r, coordinator.session) for r in range(3)]
    ranks[0].send_timing()
    route, _ = relay_up(coordinator)
    return proc, route[0], ranks


@pytest.mark.integration
def test_relay_folds_survives_a_death_mid_fold_and_the_late_drop_race(coordinator, procs, py, lines, tmp_path):
    ctx = zmq.Context()
    try:
        proc, relay_id, (r0, r1, r2) = start_and_learn_id(procs, py, coordinator, lines, tmp_path, ctx)

        # Cycle 1: ranks 0 and 1 send, rank 2 dies before sending: FoldDrop lets the rest go.
        open_fold(coordinator, relay_id, 1, [r0, r1, r2])
        r0.send_round(1, 2.0)
        r0.send_timing()  # control traffic is not held behind an open fold
        route, d = relay_up(coordinator)
        assert (route, d.kind) == ((relay_id, r0.identity), "timing")
        r1.send_round(1, 1.0)
        r2.sock.close(0)
        fold_drop(coordinator, relay_id, 1, 2)
        route, d = relay_up(coordinator)
        assert route == (relay_id,) and d.envelope.sender.kind == pb.Sender.KIND_RELAY
        h = d.envelope.round
        assert (h.cycle, list(h.contributing_ranks), h.weight) == (1, [0, 1], 3.0)
        for got, a, b in zip(unpack_round(h, d.blobs), r0.params, r1.params):
            np.testing.assert_allclose(got, a * 2 + b, rtol=1e-6)

        # Cycle 2, the race: the fold leaves, then the FoldDrop for rank 1 comes too late.
        # The relay sends nothing more for it (the coordinator drops the whole frame) and
        # keeps serving: the next fold works.
        open_fold(coordinator, relay_id, 2, [r0, r1])
        r0.send_round(2, 1.0)
        r1.send_round(2, 1.0, bf16=True)
        route, d = relay_up(coordinator)
        assert route == (relay_id,) and list(d.envelope.round.contributing_ranks) == [0, 1]
        assert all(m.dtype == pb.DTYPE_BF16 for m in d.envelope.round.tensors)  # bf16 in, bf16 up
        fold_drop(coordinator, relay_id, 2, 1)
        open_fold(coordinator, relay_id, 3, [r0, r1])
        r1.send_round(3, 0.0)
        r0.send_round(3, 1.0)
        route, d = relay_up(coordinator)
        assert (route, d.envelope.round.cycle, d.envelope.round.weight) == ((relay_id,), 3, 1.0)

        # A fold in progress at SIGTERM: its part goes up raw (still a valid contribution).
        open_fold(coordinator, relay_id, 4, [r0, r1])
        r0.send_round(4, 1.0)
        r0.send_timing()  # once this is through, the relay holds rank 0's round
        assert relay_up(coordinator)[1].kind == "timing"
        proc.send_signal(signal.SIGTERM)
        route, d = relay_up(coordinator)
        assert route == (relay_id, r0.identity) and d.envelope.round.cycle == 4
        assert proc.wait(10) == 0
    finally:
        ctx.destroy(0)


@pytest.mark.integration
def test_relay_with_no_fold_forwards_rounds_untouched(coordinator, procs, py, lines, tmp_path):
    ctx = zmq.Context()
    try:
        proc, relay_id, (r0, r1, _) = start_and_learn_id(procs, py, coordinator, lines, tmp_path, ctx, "--no-fold")
        open_fold(coordinator, relay_id, 1, [r0, r1])  # ignored
        r0.send_round(1, 1.0)
        r1.send_round(1, 1.0)
        got = {relay_up(coordinator)[0] for _ in range(2)}
        assert got == {(relay_id, r0.identity), (relay_id, r1.identity)}
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
    finally:
        ctx.destroy(0)
