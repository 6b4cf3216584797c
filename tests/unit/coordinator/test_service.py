"""The service over real sockets: admission refusals and route checks, in one process.

The service runs in a thread (its loop owns its socket); the test plays ranks with
DEALER sockets and reads what comes back, with poll deadlines instead of sleeps.
"""


import time

import pytest
import zmq

from flodl.wire import Endpoint, decode, pb, split_routing
from flodl_coordinator.settings import load_settings

SESSION = "svc-test"


@pytest.fixture
def service(serve):
    return serve(load_settings(env={}, flags={
        "world_size": 2, "bind": "tcp://127.0.0.1:0", "session": SESSION, "epochs": 1,
        "batch_size": 4, "liveness_timeout_s": 30.0,
    }))  # fmt: skip


class Peer:
    def __init__(self, ctx, ep, rank, inc):
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(ep)
        self.me = Endpoint(SESSION, pb.Sender.KIND_RANK, rank=rank, incarnation=inc)

    def send(self, body, msg):
        self.sock.send_multipart(self.me.frames(body, msg))

    def recv(self, timeout_ms=5000):
        assert self.sock.poll(timeout_ms), "nothing came back"
        return decode(split_routing(self.sock.recv_multipart())[1], session=SESSION)

    def hello(self, rank, sig=b"a" * 32, n=100):
        self.send("hello", pb.RankHello(rank=rank, world_size=2, model_sig=sig, dataset_len=n))
        while True:
            m = self.recv()
            if m.kind == "hello_ack":
                return m.envelope.hello_ack


def test_second_claim_of_a_rank_and_a_foreign_model_are_refused_by_name(service):
    svc, ep, ctx = service
    assert Peer(ctx, ep, 0, 1).hello(0).accepted
    dup = Peer(ctx, ep, 0, 2).hello(0)
    assert not dup.accepted and "already" in dup.reason
    other = Peer(ctx, ep, 1, 3).hello(1, sig=b"b" * 32)
    assert not other.accepted and "model" in other.reason
    assert other.deferred  # before the world forms a cohort conflict waits for a quorum
    short = Peer(ctx, ep, 1, 4).hello(1, n=99)
    assert not short.accepted and "dataset" in short.reason


def test_frames_claiming_a_rank_the_route_does_not_own_are_dropped(service):
    svc, ep, ctx = service
    r0 = Peer(ctx, ep, 0, 1)
    assert r0.hello(0).accepted
    impostor = Peer(ctx, ep, 0, 9)  # speaks as rank 0 from another socket, never admitted
    impostor.send("timing", pb.Timing(rank=0, heartbeat=pb.Timing.Heartbeat(step_count=1)))
    r0.send("timing", pb.Timing(rank=1, heartbeat=pb.Timing.Heartbeat(step_count=1)))  # body lies
    # A third, honest frame from rank 0 proves the service still serves it: it is admitted
    # and waiting; a beacon arrives on its socket.
    r0.send("timing", pb.Timing(rank=0, heartbeat=pb.Timing.Heartbeat(step_count=1)))
    got = r0.recv(5000)
    assert got.kind == "control"
    deadline = 50
    while svc.dropped.get("route_mismatch", 0) < 2 and deadline:
        r0.sock.poll(100)
        deadline -= 1
    assert svc.dropped["route_mismatch"] == 2, dict(svc.dropped)


def test_an_illegal_batch_report_is_refused_and_the_service_goes_on(service):
    svc, ep, ctx = service
    r0, r1 = Peer(ctx, ep, 0, 1), Peer(ctx, ep, 1, 2)
    assert r0.hello(0).accepted and r1.hello(1).accepted
    # The core raises RankViolation for a batch of an epoch that was never dispatched; the
    # service must count it and keep serving (it used to let the exception end the loop).
    r0.send("timing", pb.Timing(rank=0, batch=pb.Timing.Batch(step_count=1, samples=4, epoch=7, offset=0)))
    deadline = time.monotonic() + 10
    while not svc.dropped.get("rank_violation") and time.monotonic() < deadline:
        time.sleep(0.02)  # polling a condition the service thread sets, with a deadline
    assert svc.dropped["rank_violation"] == 1, dict(svc.dropped)
    # Still alive: a heartbeat from rank 1 is answered by the beacon / plan traffic.
    r1.send("timing", pb.Timing(rank=1, heartbeat=pb.Timing.Heartbeat(step_count=0)))
    assert r1.recv(5000).kind == "control"
    assert svc.finished is None


def _until(cond, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.02)  # polling a condition the service thread sets, with a deadline
    return cond()


def test_a_forged_frame_with_a_huge_seq_does_not_poison_the_real_ranks_sequence(service):
    svc, ep, ctx = service
    r0, r1 = Peer(ctx, ep, 0, 1), Peer(ctx, ep, 1, 2)
    assert r0.hello(0).accepted and r1.hello(1).accepted
    forged = Peer(ctx, ep, 1, 2)  # rank 1's incarnation, from another route
    forged.me._seq = 2**63 - 1
    forged.send("timing", pb.Timing(rank=1, heartbeat=pb.Timing.Heartbeat(step_count=1)))
    assert _until(lambda: svc.dropped.get("route_mismatch", 0) == 1), dict(svc.dropped)
    seen = svc.state.ranks[1].last_seen
    r1.send("timing", pb.Timing(rank=1, heartbeat=pb.Timing.Heartbeat(step_count=1)))
    assert _until(lambda: svc.state.ranks[1].last_seen > seen), dict(svc.dropped)
    assert svc.dropped.get("out_of_sequence", 0) == 0, dict(svc.dropped)



def test_malformed_routes_replays_and_foreign_senders_are_each_dropped_by_reason(service):
    """The receive path splits a message as it arrives; what it cannot split (no
    delimiter, a route of more hops than a relay stacks) is still refused by
    ``split_routing``'s reason, and the checks after it (sender kind, sequence) hold."""
    svc, ep, ctx = service
    r0 = Peer(ctx, ep, 0, 1)
    assert r0.hello(0).accepted
    beat = pb.Timing(rank=0, heartbeat=pb.Timing.Heartbeat(step_count=1))
    r0.sock.send_multipart([b"no-delimiter", b"at-all"])
    r0.sock.send_multipart([b"a", b"b", b"c", b"d", b"", *r0.me.frames("timing", beat)[1:]])  # 5 hops
    replayed = r0.me.frames("timing", beat)
    r0.sock.send_multipart(replayed)
    r0.sock.send_multipart(replayed)  # the same seq again
    agent = Endpoint(SESSION, pb.Sender.KIND_AGENT, host="h", incarnation=5)
    r0.sock.send_multipart(agent.frames("timing", beat))  # a timing frame from an agent
    want = {"malformed": 2, "out_of_sequence": 1, "route_mismatch": 1}
    assert _until(lambda: {k: svc.dropped.get(k, 0) for k in want} == want), dict(svc.dropped)
    seen = svc.state.ranks[0].last_seen
    r0.send("timing", beat)  # and rank 0 is still served
    assert _until(lambda: svc.state.ranks[0].last_seen > seen), dict(svc.dropped)
    assert svc.finished is None

def test_the_journal_is_created_owner_only(tmp_path):
    import os

    from flodl_coordinator.service import CoordinatorService

    journal = tmp_path / "run.journal"
    old = os.umask(0o022)
    try:
        svc = CoordinatorService(load_settings(env={}, flags={
            "world_size": 2, "bind": "tcp://127.0.0.1:0", "session": SESSION, "journal": str(journal),
        }))  # fmt: skip
    finally:
        os.umask(old)
    svc._journal.close()
    assert journal.stat().st_mode & 0o777 == 0o600


def _settings(**over):
    flags = {"world_size": 2, "bind": "tcp://127.0.0.1:0", "session": SESSION, "epochs": 1, "batch_size": 4,
             "liveness_timeout_s": 30.0}
    return load_settings(env={}, flags={**flags, **over})


def test_an_oversized_hello_is_refused_by_name_and_never_journaled(serve, tmp_path):
    journal = tmp_path / "run.journal"
    svc, ep, ctx = serve(_settings(journal=str(journal)))
    huge = Peer(ctx, ep, 0, 1)
    huge.send("hello", pb.RankHello(rank=0, world_size=2, model_sig=b"a" * 32, dataset_len=100, host="h" * 100_000))
    ack = huge.recv().envelope.hello_ack
    assert not ack.accepted and "host name of 100000 characters" in ack.reason
    sig = Peer(ctx, ep, 0, 2)
    sig.send("hello", pb.RankHello(rank=0, world_size=2, model_sig=b"s" * 4096, dataset_len=100))
    ack = sig.recv().envelope.hello_ack
    assert not ack.accepted and "model_sig of 4096 bytes" in ack.reason
    assert Peer(ctx, ep, 0, 3).hello(0).accepted  # the slot is still free for the honest rank
    assert svc.dropped["oversized"] == 2, dict(svc.dropped)
    text = journal.read_text()
    assert "hhhh" not in text and ("73" * 64) not in text
    assert max(len(line) for line in text.splitlines()) < 20_000


def test_a_message_part_over_max_message_bytes_disconnects_its_peer_unread(serve):
    from flodl.limits import MIN_MAX_MESSAGE_BYTES

    svc, ep, ctx = serve(_settings(max_message_bytes=MIN_MAX_MESSAGE_BYTES))
    big = Peer(ctx, ep, 0, 1)  # a well-formed hello, but one blob part over the limit
    hello = pb.RankHello(rank=0, world_size=2, model_sig=b"a" * 32, dataset_len=100)
    big.sock.send_multipart(big.me.frames("hello", hello, blobs=[b"\0" * (MIN_MAX_MESSAGE_BYTES + 1)]))
    assert not big.sock.poll(1500), "the oversized message was read and answered"
    assert svc.state.route_of(0) is None
    assert Peer(ctx, ep, 0, 2).hello(0).accepted  # never admitted: the slot is free


def test_drop_warnings_are_per_reason_not_per_route(service, caplog):
    import logging

    caplog.set_level(logging.WARNING, logger="flodl.coordinator")
    svc, ep, ctx = service
    for _ in range(30):  # a new connection (a new route) per bad frame
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 1000)
        s.connect(ep)
        s.send_multipart([b"", b"\xff\x00garbage"])
        s.close()
    assert _until(lambda: svc.dropped.get("malformed", 0) == 30), dict(svc.dropped)
    lines = [r.getMessage() for r in caplog.records if "malformed" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith("dropped frame from "), lines


def test_a_hello_of_another_session_is_refused_by_name_in_its_own_session(service):
    svc, ep, ctx = service
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(ep)
    me = Endpoint("typo", pb.Sender.KIND_RANK, rank=0, incarnation=9)
    sock.send_multipart(me.frames("hello", pb.RankHello(rank=0, world_size=2, model_sig=b"a" * 32, dataset_len=100)))
    assert sock.poll(5000), "a wrong-session hello got no answer"
    d = decode(split_routing(sock.recv_multipart())[1], session="typo")  # readable in the peer's session
    ack = d.envelope.hello_ack
    assert not ack.accepted and "session 'typo' is not this coordinator's run" in ack.reason
    assert SESSION not in ack.reason and d.envelope.session == "typo"  # ours is not told
    assert svc.dropped["wrong_session"] == 1
    sock.close(0)


def test_every_agent_hears_that_the_run_ended(service):
    # (so that none restarts a rank for a run that is gone: tests/unit/worker/test_agent_run_ended.py)
    svc, ep, ctx = service
    agent = ctx.socket(zmq.DEALER)
    agent.setsockopt(zmq.LINGER, 0)
    agent.connect(ep)
    me = Endpoint(SESSION, pb.Sender.KIND_AGENT, host="gpu1")
    agent.send_multipart(me.frames("agent", pb.AgentMsg(hello=pb.AgentMsg.AgentHello(host="gpu1", ranks=[0, 1]))))
    got = []
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and "run_ended" not in got:
        if agent.poll(100):
            m = decode(split_routing(agent.recv_multipart())[1], session=SESSION).envelope.agent
            got.append(m.WhichOneof("msg"))
            if got[-1] == "run_ended":
                ended = m.run_ended
        elif got == ["hello_ack"]:
            svc.request_stop()  # the run ends (by signal, before the world formed: not ok)
    assert got == ["hello_ack", "run_ended"], got
    assert not ended.ok and ended.reason
    agent.close(0)


def test_a_second_stop_request_stops_at_once_without_the_ranks_acknowledging():
    """One stop asks the ranks to shut down and waits for them (up to the liveness
    timeout); a second one, like a second SIGTERM, stops now: the run ends unfinished."""
    from flodl_coordinator.service import CoordinatorService

    svc = CoordinatorService(load_settings(env={}, flags={
        "world_size": 2, "bind": "tcp://127.0.0.1:0", "session": SESSION, "epochs": 1,
        "batch_size": 4, "liveness_timeout_s": 60.0,
    }))  # fmt: skip
    ep, t = svc.start_thread()
    ctx = zmq.Context()
    try:
        peers = [Peer(ctx, ep, r, r + 1) for r in (0, 1)]
        assert all(p.hello(r).accepted for r, p in enumerate(peers))  # a world; neither acknowledges a Shutdown
        assert _until(lambda: svc.state.run.phase != "FORMING"), svc.state.run.phase
        svc.request_stop()
        t.join(1.0)
        assert t.is_alive()  # the graceful stop waits for the ranks (their liveness: 60 s)
        svc.request_stop()
        t.join(30)
        assert not t.is_alive() and svc.exit_code == 1 and svc.finished is None
    finally:
        ctx.destroy(0)
