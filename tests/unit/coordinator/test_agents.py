"""Agent exit reports: only the agent a rank itself named may report it; forged reports are refused."""

import time

import zmq

from flodl.wire import Endpoint, decode, pb, split_routing
from flodl_coordinator.agents import AgentBook, token_digest
from flodl_coordinator.service import CoordinatorService
from flodl_coordinator.settings import load_settings

SESSION = "agents-test"
REAL, FORGED = b"r" * 16, b"f" * 16


def _hello(ranks, token=REAL, host="gpu1"):
    return pb.AgentMsg.AgentHello(host=host, ranks=ranks, token=token)


def test_a_report_is_believed_only_from_the_agent_the_rank_vouched_for():
    book = AgentBook(world_size=4)
    real, rogue = (b"agent-real",), (b"agent-rogue",)
    assert book.hello(rogue, _hello([0, 1, 2, 3], FORGED, "evil"), "")[0] is not None  # claims may coexist...
    assert book.hello(real, _hello([0, 1]), "")[0]["token"] == token_digest(REAL)  # ...until a rank vouches
    assert book.rank_admitted(0, REAL) == {"type": "_rank_agent", "rank": 0, "token": token_digest(REAL)}
    assert book.rank_admitted(0, REAL) is None  # a retransmitted hello journals nothing new
    assert book.report_refusal(real, 0, REAL, "") == ""
    assert "did not name" in book.report_refusal(rogue, 0, FORGED, "")  # rank 0 vouched for the real one
    assert "did not name" in book.report_refusal(real, 1, REAL, "")  # rank 1 has not vouched yet
    # ... which, from its own agent, is a rank that ended before its hello (not a forgery)
    assert book.before_hello(real, 1, REAL, "") and not book.before_hello(real, 0, REAL, "")
    assert not book.before_hello(real, 1, FORGED, "") and not book.before_hello((b"stranger",), 1, REAL, "")
    assert "without the agent's token" in book.report_refusal(real, 0, FORGED, "")  # a route taken over
    assert "did not announce" in book.report_refusal(real, 2, REAL, "")
    assert "no agent hello" in book.report_refusal((b"stranger",), 0, REAL, "")
    # A later claim of a rank that vouched for another agent is not theirs.
    record, note = book.hello((b"agent-late",), _hello([0, 3], FORGED, "late"), "")
    assert record["ranks"] == [3] and "claims rank(s) [0]" in note
    # With CURVE the report must come with the key the hello came with.
    book.hello((b"agent-curve",), _hello([2]), "KEY-A")
    book.rank_admitted(2, REAL)
    assert book.report_refusal((b"agent-curve",), 2, REAL, "KEY-A") == ""
    assert "CURVE key" in book.report_refusal((b"agent-curve",), 2, REAL, "KEY-B")


def test_a_rank_that_never_said_hello_is_believed_from_its_only_claimant_while_it_holds_no_slot():
    # A script that failed at import never vouches: its agent's report is what tells the
    # coordinator, before the world forms, that the slot will never come.
    book = AgentBook(world_size=3)
    real, rogue = (b"agent-real",), (b"agent-rogue",)
    book.hello(real, _hello([0, 1]), "")
    assert book.report_refusal(real, 1, REAL, "", admitted=False) == ""
    assert "did not name" in book.report_refusal(real, 1, REAL, "", admitted=True)  # a live rank: never
    assert "without the agent's token" in book.report_refusal(real, 1, FORGED, "", admitted=False)
    book.rank_admitted(0, REAL)
    book.hello(rogue, _hello([0, 1, 2], FORGED, "evil"), "")
    assert "another agent claims it too" in book.report_refusal(real, 1, REAL, "", admitted=False)
    assert "another agent claims it too" in book.report_refusal(rogue, 1, FORGED, "", admitted=False)
    assert "did not announce" in book.report_refusal(rogue, 0, FORGED, "", admitted=False)  # vouched for the real one
    assert book.report_refusal(rogue, 2, FORGED, "", admitted=False) == ""  # its own claim, alone


def test_an_agent_hello_out_of_range_twice_or_oversized_is_refused_whole():
    book = AgentBook(world_size=2)
    for bad in (_hello([0, 2]), _hello([1, 1]), _hello([0], host="h" * 300), _hello([0], token=b"t" * 65)):
        record, note = book.hello((b"a",), bad, "")
        assert record is None and "refused" in note
    assert book.claims == {}


def test_the_book_survives_a_restart_from_its_journal_records():
    book = AgentBook(world_size=2)
    records = [book.hello((b"agent-1",), _hello([0, 1]), "")[0], book.rank_admitted(1, REAL)]
    again = AgentBook(world_size=2)
    for r in records:
        again.restore(r)
    assert again.report_refusal((b"agent-1",), 1, REAL, "") == ""
    assert again.agent_ranks == {(b"agent-1",): {0, 1}}


def _until(cond, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.02)  # polling a condition the service thread sets, with a deadline
    return cond()


class _Peer:
    def __init__(self, ctx, ep, kind, **sender):
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(ep)
        self.me = Endpoint(SESSION, kind, **sender)

    def send(self, body, msg):
        self.sock.send_multipart(self.me.frames(body, msg))

    def hello_ack(self):
        while True:
            assert self.sock.poll(5000), "no hello_ack"
            d = decode(split_routing(self.sock.recv_multipart())[1], session=SESSION)
            if d.kind == "hello_ack":
                return d.envelope.hello_ack


def test_forged_agent_reports_do_not_kill_live_ranks_and_the_real_agent_still_can(serve, tmp_path):
    journal = tmp_path / "run.journal"
    svc, ep, ctx = serve(load_settings(env={}, flags={
        "world_size": 2, "bind": "tcp://127.0.0.1:0", "session": SESSION, "epochs": 1, "batch_size": 4,
        "liveness_timeout_s": 30.0, "journal": str(journal),
    }))  # fmt: skip
    ranks = [_Peer(ctx, ep, pb.Sender.KIND_RANK, rank=r, incarnation=10 + r) for r in (0, 1)]
    for r, peer in enumerate(ranks):
        peer.send("hello", pb.RankHello(rank=r, world_size=2, model_sig=b"a" * 32, dataset_len=100, agent_token=REAL))
        assert peer.hello_ack().accepted
    real = _Peer(ctx, ep, pb.Sender.KIND_AGENT, host="gpu1", incarnation=1)
    real.send("agent", pb.AgentMsg(hello=_hello([0, 1])))
    forger = _Peer(ctx, ep, pb.Sender.KIND_AGENT, host="gpu1", incarnation=2)
    forger.send("agent", pb.AgentMsg(hello=_hello([0, 1, 2, 3], FORGED)))  # refused whole: 2, 3 out of range
    forger.send("agent", pb.AgentMsg(hello=_hello([0, 1], FORGED)))
    for r in (0, 1):
        forger.send("agent", pb.AgentMsg(rank_exited=pb.AgentMsg.RankExited(rank=r, code=-9, token=FORGED)))
        forger.send("agent", pb.AgentMsg(rank_exited=pb.AgentMsg.RankExited(rank=r, code=-9, token=REAL)))
    assert _until(lambda: svc.dropped.get("route_mismatch", 0) == 5), dict(svc.dropped)
    assert svc.state.route_of(0) is not None and svc.state.route_of(1) is not None  # both still alive
    real.send("agent", pb.AgentMsg(rank_exited=pb.AgentMsg.RankExited(rank=1, code=-9, token=REAL)))
    assert _until(lambda: svc.state.route_of(1) is None), "the real agent's report was not believed"
    assert svc.state.route_of(0) is not None
    # The journal keeps digests only, and enough for a restarted service to believe the real agent.
    text = journal.read_text()
    assert REAL.hex() not in text and token_digest(REAL) in text
    copy = tmp_path / "copy.journal"  # the complete lines so far: what a restart would read
    copy.write_text(text[: text.rfind("\n") + 1])
    again = CoordinatorService(load_settings(env={}, flags={
        "world_size": 2, "bind": "tcp://127.0.0.1:0", "session": SESSION, "epochs": 1, "batch_size": 4,
        "liveness_timeout_s": 30.0, "journal": str(copy),
    }))  # fmt: skip
    try:
        route = next(iter(again.agents.claims))
        assert again.agents.claims[route].host == "gpu1" and len(again.agents.claims) == 2
        real_route = next(r for r, c in again.agents.claims.items() if c.digest == token_digest(REAL))
        assert again.agents.report_refusal(real_route, 0, REAL, "") == ""
        forged_route = next(r for r, c in again.agents.claims.items() if c.digest == token_digest(FORGED))
        assert again.agents.report_refusal(forged_route, 0, FORGED, "") != ""
    finally:
        again._journal.close()


def test_with_curve_a_report_must_come_with_the_key_of_the_agents_hello(serve, tmp_path):
    from flodl.curve import client_keys, keygen

    keydir, allowed = tmp_path / "keys", tmp_path / "allowed"
    allowed.mkdir()
    _, server_sec = keygen(str(keydir), "coordinator")
    server_pub = str(keydir / "coordinator.key")
    secrets = {}
    for name in ("host-a", "host-b"):
        pub, secrets[name] = keygen(str(keydir), name)
        (allowed / f"{name}.key").write_bytes(open(pub, "rb").read())
    svc, ep, ctx = serve(load_settings(env={}, flags={
        "world_size": 2, "bind": "tcp://0.0.0.0:0", "session": SESSION, "epochs": 1, "batch_size": 4,
        "liveness_timeout_s": 30.0, "curve_secret_key": server_sec, "curve_allowed_keys": str(allowed),
    }))  # fmt: skip
    ep = ep.replace("0.0.0.0", "127.0.0.1")

    def peer(kind, keyname, identity=None, **sender):
        p = _Peer.__new__(_Peer)
        p.sock = ctx.socket(zmq.DEALER)
        p.sock.setsockopt(zmq.LINGER, 0)
        if identity:
            p.sock.setsockopt(zmq.IDENTITY, identity)
        client_keys(server_pub, secrets[keyname]).apply(p.sock)
        p.sock.connect(ep)
        p.me = Endpoint(SESSION, kind, **sender)
        return p

    ranks = [peer(pb.Sender.KIND_RANK, "host-a", rank=r, incarnation=10 + r) for r in (0, 1)]
    for r, rank in enumerate(ranks):
        rank.send("hello", pb.RankHello(rank=r, world_size=2, model_sig=b"a" * 32, dataset_len=100, agent_token=REAL))
        assert rank.hello_ack().accepted
    agent = peer(pb.Sender.KIND_AGENT, "host-a", b"agent-a-1", host="a", incarnation=1)
    agent.send("agent", pb.AgentMsg(hello=_hello([0, 1])))
    assert _until(lambda: (b"agent-a-1",) in svc.agents.claims)
    agent.sock.close(0)
    # Another allowlisted host takes the agent's route over, token and all: still refused.
    thief = peer(pb.Sender.KIND_AGENT, "host-b", b"agent-a-1", host="a", incarnation=1)
    thief.me._seq = 100
    deadline = time.monotonic() + 30  # reconnects under load can be slow
    while not svc.dropped.get("route_mismatch") and time.monotonic() < deadline:
        thief.send("agent", pb.AgentMsg(rank_exited=pb.AgentMsg.RankExited(rank=0, code=-9, token=REAL)))
        _until(lambda: svc.dropped.get("route_mismatch"), 0.5)  # the route frees once the old pipe is gone
    assert svc.dropped.get("route_mismatch"), dict(svc.dropped)
    assert svc.state.route_of(0) is not None
    thief.sock.close(0)
    back = peer(pb.Sender.KIND_AGENT, "host-a", b"agent-a-1", host="a", incarnation=1)
    back.me._seq = 1000
    deadline = time.monotonic() + 30  # reconnects under load can be slow
    while svc.state.route_of(1) is not None and time.monotonic() < deadline:
        back.send("agent", pb.AgentMsg(rank_exited=pb.AgentMsg.RankExited(rank=1, code=-9, token=REAL)))
        _until(lambda: svc.state.route_of(1) is None, 0.5)
    assert svc.state.route_of(1) is None, dict(svc.dropped)


def test_a_rank_that_failed_before_its_hello_ends_a_forming_run_and_the_agents_are_told(serve, tmp_path):
    svc, ep, ctx = serve(load_settings(env={}, flags={
        "world_size": 2, "bind": "tcp://127.0.0.1:0", "session": SESSION, "epochs": 1, "batch_size": 4,
        "liveness_timeout_s": 30.0,
    }))  # fmt: skip
    rank0 = _Peer(ctx, ep, pb.Sender.KIND_RANK, rank=0, incarnation=10)
    rank0.send("hello", pb.RankHello(rank=0, world_size=2, model_sig=b"a" * 32, dataset_len=100, agent_token=REAL))
    assert rank0.hello_ack().accepted
    agent = _Peer(ctx, ep, pb.Sender.KIND_AGENT, host="gpu1", incarnation=1)
    agent.send("agent", pb.AgentMsg(hello=_hello([0, 1])))
    lines = ["Traceback (most recent call last):", "ModuleNotFoundError: No module named 'x'"]
    agent.send("agent", pb.AgentMsg(rank_exited=pb.AgentMsg.RankExited(
        rank=1, code=1, token=REAL, restarting=True, last_lines=lines)))  # fmt: skip
    assert _until(lambda: "its agent starts it again" in svc.state.run.not_admitted.get(1, ""))
    assert svc.finished is None  # its agent restarts it: the world still waits
    agent.send("agent", pb.AgentMsg(rank_exited=pb.AgentMsg.RankExited(
        rank=1, code=1, token=REAL, restart_count=1, last_lines=lines)))  # fmt: skip
    assert _until(lambda: svc.finished is not None)
    assert not svc.finished.ok and "rank 1: exited with code 1 before the world formed" in svc.finished.reason
    assert "its last line: ModuleNotFoundError: No module named 'x'" in svc.finished.reason
    while True:  # the agent is told to stop its ranks (those still starting never said hello)
        assert agent.sock.poll(5000), "no abort"
        d = decode(split_routing(agent.sock.recv_multipart())[1], session=SESSION)
        if d.kind == "agent" and d.envelope.agent.WhichOneof("msg") == "abort":
            assert d.envelope.agent.abort.reason.startswith("the world did not form: the world can no longer form")
            break


def test_unpinned_ranks_get_their_slot_in_the_ack_and_their_agents_reports_find_it(serve, tmp_path):
    svc, ep, ctx = serve(load_settings(env={}, flags={
        "world_size": 3, "bind": "tcp://127.0.0.1:0", "session": SESSION, "epochs": 1, "batch_size": 4,
        "liveness_timeout_s": 30.0,
    }))  # fmt: skip
    agent = _Peer(ctx, ep, pb.Sender.KIND_AGENT, host="gpu1", incarnation=1)
    agent.send("agent", pb.AgentMsg(hello=_hello([])))  # unpinned: it claims no rank
    pinned = _Peer(ctx, ep, pb.Sender.KIND_RANK, rank=0, incarnation=10)
    pinned.send("hello", pb.RankHello(rank=0, world_size=3, model_sig=b"a" * 32, dataset_len=100))
    assert pinned.hello_ack().rank == 0
    rank = _Peer(ctx, ep, pb.Sender.KIND_RANK, rank=0, incarnation=11)
    hello = pb.RankHello(rank=0, world_size=3, model_sig=b"a" * 32, dataset_len=100, agent_token=REAL, unpinned_slot=1)
    rank.send("hello", hello)
    ack = rank.hello_ack()
    assert ack.accepted and ack.rank == 1  # the lowest free slot
    rank.send("hello", hello)  # a retransmit: the same slot
    assert rank.hello_ack().rank == 1
    assert svc.agents.vouched[1] == token_digest(REAL)
    # Its agent reports local rank 0 (never admitted: a process fewer) and local rank 1 (slot 1).
    agent.send("agent", pb.AgentMsg(rank_exited=pb.AgentMsg.RankExited(
        code=1, token=REAL, unpinned_slot=0, restarting=True)))  # fmt: skip
    agent.send("agent", pb.AgentMsg(rank_exited=pb.AgentMsg.RankExited(code=-9, token=REAL, unpinned_slot=1)))
    assert _until(lambda: svc.state.route_of(1) is None), "the report did not find slot 1"
    assert svc.finished is not None and "rank 1: killed by signal 9 before the world formed" in svc.finished.reason
    assert svc.state.ranks[1].agent == token_digest(REAL) and svc.state.ranks[1].local_rank == 1


def test_an_agents_report_of_a_rank_that_never_said_hello_is_no_dropped_frame(serve):
    # (a host that leaves, or whose ranks die importing, before they said hello: the churn
    # campaign's leaves logged each as a forged report, "route_mismatch")
    svc, ep, ctx = serve(load_settings(env={}, flags={
        "world_size": 2, "bind": "tcp://127.0.0.1:0", "session": SESSION, "epochs": 1, "batch_size": 4,
    }))  # fmt: skip
    agent = _Peer(ctx, ep, pb.Sender.KIND_AGENT, host="gpu1", incarnation=1)
    agent.send("agent", pb.AgentMsg(hello=_hello([0, 1])))
    agent.send("agent", pb.AgentMsg(rank_exited=pb.AgentMsg.RankExited(rank=1, code=-15, token=FORGED)))
    agent.send("agent", pb.AgentMsg(rank_exited=pb.AgentMsg.RankExited(rank=1, code=-15, token=REAL)))
    assert _until(lambda: svc.dropped.get("route_mismatch", 0) == 1), dict(svc.dropped)  # only the forged one
    # The real one is believed (its only claimant): before the world forms it says the slot
    # will never come, and the run fails at once, naming it (flodl.core._formation).
    assert _until(lambda: svc.finished is not None)
    assert "rank 1: killed by signal 15 before the world formed" in svc.finished.reason


def test_a_new_host_takes_over_the_slots_of_one_that_left_and_may_report_them():
    # (the churn campaign: the second host to join slots 6, 7 was refused them, so its
    # ranks' exits were never believed and its leave was seen only as a lost relay link)
    A, B = b"a" * 16, b"b" * 16
    book = AgentBook(world_size=8)
    book.hello((b"agent-a",), _hello([6, 7], A, "a"), "", held=set())
    book.rank_admitted(6, A)
    book.rank_admitted(7, A)
    # Host a left: the run holds neither rank now. Host b claims them, and its ranks vouch.
    record, note = book.hello((b"agent-b",), _hello([6, 7], B, "b"), "", held={0, 1})
    assert record["ranks"] == [6, 7] and note == ""
    records = [record, book.rank_admitted(6, B)]
    assert book.report_refusal((b"agent-b",), 6, B, "") == ""
    assert "did not name" in book.report_refusal((b"agent-a",), 6, A, "")  # not a's any more
    # Still held (an agent restarted before its old ranks were declared dead): refused for
    # now, and its own once the new process's hello vouches for it.
    C = b"c" * 16
    record, note = book.hello((b"agent-c",), _hello([7], C, "c"), "", held={7})
    assert record["ranks"] == [] and record["asked"] == [7] and "vouched for another agent" in note
    records += [record, book.rank_admitted(7, C)]
    assert book.report_refusal((b"agent-c",), 7, C, "") == ""
    # A restarted coordinator's book, from the journal records, agrees.
    again = AgentBook(world_size=8)
    for r in records:
        again.restore(r)
    assert again.report_refusal((b"agent-b",), 6, B, "") == "" and again.report_refusal((b"agent-c",), 7, C, "") == ""
