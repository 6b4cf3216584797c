"""Relay folding end to end: the real coordinator service (in a thread), a real relay
process, and scripted ranks behind it that speak the wire protocol (no torch).

World of 4: ranks 0-2 behind the relay (folded), rank 3 dials the coordinator directly.
Cycle 1: everyone contributes; the coordinator gets one folded frame + rank 3's.
Cycle 2: rank 2 dies before sending (the agent reports it): the service sends the relay
  ``FoldDrop``, the relay flushes 0 and 1, the round completes without rank 2.
Cycle 3: ranks 0 and 1's fold is accepted, then rank 1 dies before the round is done:
  the fold leaves the round whole (mass and tensors); rank 0 still receives the
  consensus, which names only rank 3. Nothing blocks. No sleeps: every wait is a poll.
"""

from __future__ import annotations

import os
import select
import subprocess
import sys
import time

import numpy as np
import pytest
import zmq

from flodl.wire import Endpoint, decode, pack_round, pb, split_routing, unpack_round
from flodl_coordinator.service import CoordinatorService
from flodl_coordinator.settings import load_settings

from runlocal import ROOT

pytestmark = pytest.mark.integration

SESSION = "fold-it"
SHAPES = [(8, 4), (4,)]


def start_relay(coordinator: str, sock_path: str, *extra: str):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "flodl_worker", "relay", "--coordinator", coordinator, "--bind", f"ipc://{sock_path}",
         "--host", "hostF", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT, env=env,
    )  # fmt: skip
    ready, _, _ = select.select([proc.stdout], [], [], 20)
    assert ready, "relay did not start"
    line = proc.stdout.readline().decode()
    assert line.startswith("RELAY_READY "), line
    return proc, line.split()[1]


class Rank:
    """Scripted rank: one batch per cycle, a round on RequestParams, an ack per consensus."""

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

    def send(self, body, msg, blobs=()):
        self.sock.send_multipart(self.ep.frames(body, msg, blobs))

    def hello(self):
        self.send("hello", pb.RankHello(rank=self.rank, world_size=4, model_sig=b"m" * 32, dataset_len=40))

    def step(self):
        epoch, offset, _ = self.plan
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
    def __init__(self, ctx, svc, coord_ep, relay_ep):
        self.svc = svc
        self.ranks = [Rank(ctx, relay_ep if r < 3 else coord_ep, r) for r in range(4)]
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
        self.agent_says(rank_exited=pb.AgentMsg.RankExited(rank=rank, code=-9))

    def pump_until(self, cond, timeout: float = 10.0, what: str = ""):
        deadline = time.monotonic() + timeout
        while not cond():
            left = deadline - time.monotonic()
            assert left > 0, f"timed out waiting for {what}"
            for sock, _ in self.poller.poll(int(left * 1000) + 1):
                r = next(x for x in self.ranks if x.sock is sock)
                while sock.poll(0):
                    r.on(decode(split_routing(sock.recv_multipart())[1], session=SESSION))


@pytest.fixture
def world(tmp_path):
    settings = load_settings(env={}, flags={
        "world_size": 4, "bind": "tcp://127.0.0.1:0", "session": SESSION, "epochs": 1, "batch_size": 1,
        "policy": "sync", "liveness_timeout_s": 60.0, "final_eval": False,
    })  # fmt: skip
    svc = CoordinatorService(settings)
    ep, t = svc.start_thread()
    relay, relay_ep = start_relay(ep, str(tmp_path / "relay.sock"))
    ctx = zmq.Context()
    w = World(ctx, svc, ep, relay_ep)
    yield w
    # Ranks and relay go first: the stop's Shutdown then fails to route at once (the run
    # ends) instead of waiting for a liveness timeout.
    ctx.destroy(0)
    relay.terminate()
    assert relay.wait(10) == 0
    svc.request_stop()
    t.join(15)
    assert not t.is_alive()


def test_folded_rounds_deaths_mid_fold_and_after_the_fold_never_block(world):
    svc, ranks = world.svc, world.ranks
    world.agent_says(hello=pb.AgentMsg.AgentHello(host="hostF", ranks=[0, 1, 2]))
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

    # Cycle 2: rank 2 never sends; the agent reports it dead -> FoldDrop -> fold of 0, 1.
    ranks[2].answer_rounds = False
    world.pump_until(lambda: all(2 in r.sent_rounds for r in ranks[:2]), what="cycle 2's rounds from 0 and 1")
    world.kill(2)
    world.pump_until(lambda: all(2 in r.consensus for r in (ranks[0], ranks[1], ranks[3])), what="cycle 2's consensus")
    h = ranks[0].consensus[2]
    assert list(h.contributing_ranks) == [0, 1, 3] and h.weight == 1 + 2 + 4
    assert svc.reducer.folded_in == 2

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
    for got, p in zip(ranks[0].arrays[3], ranks[3].params):
        np.testing.assert_allclose(got, p, rtol=1e-6)
    assert svc.dropped.get("round_refused", 0) == 0
