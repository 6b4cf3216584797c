"""Relay folding end to end: the real coordinator service (in a thread), a real relay
process, and scripted ranks behind it that speak the wire protocol (no torch).

World of 4: ranks 0-2 behind the relay (folded), rank 3 dials the coordinator directly.
Cycle 1: everyone contributes; the coordinator gets one folded frame + rank 3's, and
  sends the consensus twice: once to the relay (fan-out, ``deliver_to`` [0, 1, 2]),
  once to rank 3.
Cycle 2: rank 2 dies before sending (the agent reports it): the service sends the relay
  ``FoldDrop``, the relay flushes 0 and 1, the round completes without rank 2, and the
  fan-out delivers to 0 and 1 only (rank 2's socket stays open: it gets nothing).
Cycle 3: ranks 0 and 1's fold is accepted, then rank 1 dies before the round is done:
  the fold leaves the round whole (mass and tensors); rank 0 still receives the
  consensus, which names only rank 3, on its own route (one rank left: no fan-out).
Nothing blocks. No sleeps: every wait is a poll. Every rank checks the coordinator's
sequence numbers (direct and fanned-out frames interleave on the relay's pipe).

Two relays of 2 ranks each, folding on and off: the consensus costs the coordinator
2 copies per round instead of 4.
"""

from __future__ import annotations

import contextlib
import os
import select
import subprocess
import sys
import time

import numpy as np
import pytest
import zmq

from flodl.wire import Endpoint, SeqTracker, decode, pack_round, pb, split_routing, unpack_round
from flodl_coordinator.service import CoordinatorService
from flodl_coordinator.settings import load_settings

from runlocal import ROOT

pytestmark = pytest.mark.integration

SESSION = "fold-it"
TOKEN = b"agent-token-hostF"  # what a real agent hands its ranks as FLODL_AGENT_TOKEN
SHAPES = [(8, 4), (4,)]
MODEL_BYTES = sum(int(np.prod(s)) for s in SHAPES) * 4  # one f32 copy of the consensus's blobs


def start_relay(coordinator: str, sock_path: str, *extra: str, host: str = "hostF"):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "flodl_worker", "relay", "--coordinator", coordinator, "--bind", f"ipc://{sock_path}",
         "--host", host, *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT, env=env,
    )  # fmt: skip
    ready, _, _ = select.select([proc.stdout], [], [], 20)
    assert ready, "relay did not start"
    line = proc.stdout.readline().decode()
    assert line.startswith("RELAY_READY "), line
    return proc, line.split()[1]


class Rank:
    """Scripted rank: ``1 + rank`` batches per cycle, a round on RequestParams weighted by
    them (the coordinator checks a weight against the steps it saw), an ack per consensus."""

    def __init__(self, ctx, endpoint: str, rank: int):
        self.rank = rank
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.IDENTITY, f"r{rank}".encode())
        self.sock.connect(endpoint)
        self.ep = Endpoint(SESSION, pb.Sender.KIND_RANK, rank=rank, incarnation=100 + rank)
        rng = np.random.default_rng(rank)
        self.params = [rng.standard_normal(s).astype(np.float32) for s in SHAPES]
        self.plan = None
        self.used = self.steps = 0
        self.answer_rounds = True
        self.sent_rounds: set[int] = set()
        self.consensus: dict[int, pb.RoundHeader] = {}
        self.arrays: dict[int, list] = {}
        self.seq = SeqTracker()  # the coordinator's frames, direct or fanned out, in order

    def send(self, body, msg, blobs=()):
        self.sock.send_multipart(self.ep.frames(body, msg, blobs))

    def hello(self):
        hello = pb.RankHello(rank=self.rank, world_size=4, model_sig=b"m" * 32, dataset_len=80, agent_token=TOKEN)
        self.send("hello", hello)  # names the agent below: its exit reports are believed

    def step(self):
        epoch, offset, _ = self.plan
        for _ in range(1 + self.rank):  # the weight of its round: n = 1 + rank steps, gamma 1
            self.steps += 1
            batch = pb.Timing.Batch(batch_ms=1.0, step_count=self.steps, samples=1, epoch=epoch, offset=offset + self.used)
            self.used += 1
            self.send("timing", pb.Timing(rank=self.rank, batch=batch))

    def on(self, d) -> None:
        if d.kind == "round":  # the consensus
            h = d.envelope.round
            self.consensus[h.cycle] = h
            self.arrays[h.cycle] = unpack_round(h, d.blobs)
            ack = pb.Timing.SyncAck(cycle=h.cycle, step_count=self.steps)
            self.send("timing", pb.Timing(rank=self.rank, sync_ack=ack))
        elif d.kind == "control":
            c = d.envelope.control
            which = c.WhichOneof("cmd")
            if which == "start_epoch":
                p = c.start_epoch.plan
                self.plan, self.used = (p.epoch, p.partition_offset, p.partition_size), 0
                self.step()
            elif which == "request_params" and self.answer_rounds:
                if c.request_params.HasField("next_plan"):  # protocol 1.2: the window rides in the trigger
                    p = c.request_params.next_plan
                    self.plan, self.used = (p.epoch, p.partition_offset, p.partition_size), 0
                    self.step()
                w = 1.0 + self.rank
                header, blobs = pack_round([a * np.float32(w) for a in self.params], cycle=c.request_params.cycle, weight=w)
                self.send("round", header, blobs)
                self.sent_rounds.add(c.request_params.cycle)
            elif which == "update":
                if c.update.HasField("next_plan"):
                    p = c.update.next_plan
                    self.plan, self.used = (p.epoch, p.partition_offset, p.partition_size), 0
                self.step()


class World:
    def __init__(self, ctx, svc, coord_ep, rank_eps):
        self.svc = svc
        self.ranks = [Rank(ctx, e, r) for r, e in enumerate(rank_eps)]
        self.agent = ctx.socket(zmq.DEALER)
        self.agent.setsockopt(zmq.LINGER, 0)
        self.agent.connect(coord_ep)
        self.agent_ep = Endpoint(SESSION, pb.Sender.KIND_AGENT, host="hostF", incarnation=7)
        self.poller = zmq.Poller()
        for r in self.ranks:
            self.poller.register(r.sock, zmq.POLLIN)

    def agent_says(self, **msg):
        self.agent.send_multipart(self.agent_ep.frames("agent", pb.AgentMsg(**msg)))

    def kill(self, rank: int):
        r = self.ranks[rank]
        self.poller.unregister(r.sock)
        r.sock.close(0)
        self.agent_says(rank_exited=pb.AgentMsg.RankExited(rank=rank, code=-9, token=TOKEN))

    def report_dead(self, rank: int):
        """The agent says ``rank`` exited, but its socket stays open (and read)."""
        self.agent_says(rank_exited=pb.AgentMsg.RankExited(rank=rank, code=-9, token=TOKEN))

    def pump_until(self, cond, timeout: float = 10.0, what: str = ""):
        deadline = time.monotonic() + timeout
        while not cond():
            left = deadline - time.monotonic()
            assert left > 0, f"timed out waiting for {what}"
            for sock, _ in self.poller.poll(int(left * 1000) + 1):
                r = next(x for x in self.ranks if x.sock is sock)
                while sock.poll(0):
                    d = decode(split_routing(sock.recv_multipart())[1], session=SESSION)
                    r.seq.check(d.envelope)  # raises OutOfSequence
                    r.on(d)


@contextlib.contextmanager
def running(tmp_path, hosts: list[int], *relay_flags: str):
    """Service + one relay per distinct host number in ``hosts`` (rank r sits behind
    relay ``hosts[r]``; -1 = dials the coordinator directly)."""
    settings = load_settings(env={}, flags={
        "world_size": len(hosts), "bind": "tcp://127.0.0.1:0", "session": SESSION, "epochs": 1, "batch_size": 1,
        "policy": "sync", "liveness_timeout_s": 60.0, "final_eval": False,
    })  # fmt: skip
    svc = CoordinatorService(settings)
    ep, t = svc.start_thread()
    relays, eps = [], {-1: ep}
    ctx = zmq.Context()
    try:
        for h in sorted(set(hosts) - {-1}):
            proc, eps[h] = start_relay(ep, str(tmp_path / f"relay{h}.sock"), *relay_flags, host=f"host{h}")
            relays.append(proc)
        yield World(ctx, svc, ep, [eps[h] for h in hosts])
    finally:
        # Ranks and relays go first: the stop's Shutdown then fails to route at once (the
        # run ends) instead of waiting for a liveness timeout.
        ctx.destroy(0)
        for relay in relays:
            relay.terminate()
        codes = [relay.wait(10) for relay in relays]
        svc.request_stop()
        t.join(15)
    assert codes == [0] * len(relays)
    assert not t.is_alive()


@pytest.fixture
def world(tmp_path):
    with running(tmp_path, [0, 0, 0, -1]) as w:
        yield w


def test_folded_rounds_deaths_mid_fold_and_after_the_fold_never_block(world):
    svc, ranks = world.svc, world.ranks
    world.agent_says(hello=pb.AgentMsg.AgentHello(host="hostF", ranks=[0, 1, 2], token=TOKEN))
    for r in ranks:
        r.hello()

    # Cycle 1: one folded frame (0, 1, 2) + rank 3's own.
    world.pump_until(lambda: all(1 in r.consensus for r in ranks), what="cycle 1's consensus")
    h = ranks[0].consensus[1]
    assert list(h.contributing_ranks) == [0, 1, 2, 3] and h.weight == 1 + 2 + 3 + 4
    want = [sum(r.params[i] * (1.0 + r.rank) for r in ranks) / 10.0 for i in range(len(SHAPES))]
    for got, w in zip(ranks[3].arrays[1], want):
        np.testing.assert_allclose(got, w, rtol=1e-5, atol=1e-6)
    assert svc.reducer.folded_in == 1 and svc.dropped.get("round_refused", 0) == 0
    # Fan-out: the relay got one copy for 0, 1, 2 (and handed it on as is); rank 3 its own.
    assert all(list(r.consensus[1].deliver_to) == [0, 1, 2] for r in ranks[:3])
    assert list(ranks[3].consensus[1].deliver_to) == []
    assert svc.reducer.bytes_out == 2 * MODEL_BYTES  # not 4

    # Cycle 2: rank 2 never sends; the agent reports it dead -> FoldDrop -> fold of 0, 1.
    ranks[2].answer_rounds = False
    world.pump_until(lambda: all(2 in r.sent_rounds for r in ranks[:2]), what="cycle 2's rounds from 0 and 1")
    world.report_dead(2)  # its socket stays open: it must not be handed the consensus
    world.pump_until(lambda: all(2 in r.consensus for r in (ranks[0], ranks[1], ranks[3])), what="cycle 2's consensus")
    h = ranks[0].consensus[2]
    assert list(h.contributing_ranks) == [0, 1, 3] and h.weight == 1 + 2 + 4
    assert list(h.deliver_to) == [0, 1] and list(ranks[1].consensus[2].deliver_to) == [0, 1]
    assert svc.reducer.folded_in == 2 and svc.reducer.bytes_out == 4 * MODEL_BYTES

    # Cycle 3: 0 and 1 fold and are accepted, rank 3 holds back; then rank 1 dies.
    ranks[3].answer_rounds = False
    world.pump_until(lambda: svc.reducer.folded_in == 3, what="cycle 3's fold accepted")
    world.kill(1)
    world.pump_until(lambda: svc.reducer.folds_discarded == 1, what="the fold leaving the round")
    h3, blobs = pack_round([a * np.float32(4.0) for a in ranks[3].params], cycle=3, weight=4.0)
    ranks[3].send("round", h3, blobs)
    world.pump_until(lambda: 3 in ranks[0].consensus and 3 in ranks[3].consensus, what="cycle 3's consensus")
    h = ranks[0].consensus[3]
    assert list(h.contributing_ranks) == [3] and h.weight == 4.0  # rank 0 is sent it, but excluded
    assert list(h.deliver_to) == []  # one rank left behind the relay: its own copy
    assert svc.reducer.bytes_out == 6 * MODEL_BYTES
    assert ranks[2].consensus == {1: ranks[2].consensus[1]}  # declared dead in cycle 2: nothing since
    for got, p in zip(ranks[0].arrays[3], ranks[3].params):
        np.testing.assert_allclose(got, p, rtol=1e-6)
    assert svc.dropped.get("round_refused", 0) == 0


@pytest.mark.parametrize("fold", [True, False], ids=["fold", "no-fold"])
def test_fan_out_halves_the_coordinator_s_bytes_out_with_two_ranks_per_relay(tmp_path, fold):
    with running(tmp_path, [0, 0, 1, 1], *([] if fold else ["--no-fold"])) as world:
        ranks, svc = world.ranks, world.svc
        for r in ranks:
            r.hello()
        world.pump_until(lambda: all(2 in r.consensus for r in ranks), what="two rounds' consensus")
        for c in (1, 2):
            h = ranks[0].consensus[c]
            assert list(h.contributing_ranks) == [0, 1, 2, 3] and h.weight == 1 + 2 + 3 + 4
            want = [sum(r.params[i] * (1.0 + r.rank) for r in ranks) / 10.0 for i in range(len(SHAPES))]
            for r in ranks:
                for got, w in zip(r.arrays[c], want):
                    np.testing.assert_allclose(got, w, rtol=1e-5, atol=1e-6)
                via_relay = ([0, 1] if r.rank < 2 else [2, 3]) if fold else []
                assert list(r.consensus[c].deliver_to) == via_relay
        rounds = svc.reducer.rounds_completed
        assert rounds >= 2 and svc.reducer.folded_in == (2 * rounds if fold else 0)
        assert svc.reducer.bytes_out == rounds * MODEL_BYTES * (2 if fold else 4)
        assert svc.dropped.get("round_refused", 0) == 0
