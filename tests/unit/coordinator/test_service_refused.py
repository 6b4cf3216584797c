"""The service over real sockets: a NaN contribution leaves its round at once (issue 9,
item 6). The round completes with the other rank, the refused rank gets the consensus
to reset to, the core discards its window and hands its positions out again, and the
refusal is counted and journaled."""

import json
import time

import numpy as np
import zmq

from flodl.wire import Endpoint, decode, pack_round, pb, split_routing, unpack_round
from flodl_coordinator.settings import load_settings

SESSION = "svc-refused"


class Peer:
    def __init__(self, ctx, ep, rank):
        self.rank = rank
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(ep)
        self.me = Endpoint(SESSION, pb.Sender.KIND_RANK, rank=rank, incarnation=7 + rank)

    def send(self, body, msg, blobs=()):
        self.sock.send_multipart(self.me.frames(body, msg, list(blobs)) if blobs else self.me.frames(body, msg))

    def recv(self, timeout_ms=5000):
        assert self.sock.poll(timeout_ms), "nothing came back"
        return decode(split_routing(self.sock.recv_multipart())[1], session=SESSION)

    def until(self, pred, timeout_ms=5000):
        seen = []
        while True:
            d = self.recv(timeout_ms)
            seen.append(d)
            if pred(d):
                return d, seen

    def timing(self, **kw):
        self.send("timing", pb.Timing(rank=self.rank, **kw))


def _control(kind):
    return lambda d: d.kind == "control" and d.envelope.control.WhichOneof("cmd") == kind


def _until(cond, timeout_s=10.0):
    end = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < end, "condition never met"
        time.sleep(0.01)


def test_a_nan_contribution_leaves_the_round_and_the_run_goes_on(serve, tmp_path):
    journal = tmp_path / "j.jsonl"
    svc, ep, ctx = serve(load_settings(env={}, flags={
        "world_size": 2, "bind": "tcp://127.0.0.1:0", "session": SESSION, "epochs": 1, "batch_size": 4,
        "policy": "sync", "liveness_timeout_s": 30.0, "reduce_stall_s": 300.0, "journal": str(journal),
    }))  # fmt: skip
    peers = [Peer(ctx, ep, r) for r in (0, 1)]
    for p in peers:
        p.send("hello", pb.RankHello(rank=p.rank, world_size=2, model_sig=b"m" * 32, dataset_len=16))
        p.until(lambda d: d.kind == "hello_ack")
    plans = {}
    for p in peers:
        d, _ = p.until(_control("start_epoch"))
        plan = d.envelope.control.start_epoch.plan
        plans[p.rank] = (plan.partition_offset, plan.partition_size)
    assert plans == {0: (0, 8), 1: (8, 8)}
    for p in peers:  # one step each: the Sync round opens
        off = plans[p.rank][0]
        p.timing(batch=pb.Timing.Batch(batch_ms=5.0, step_count=1, batch_loss=1.0, samples=4, epoch=0, offset=off))
    cycles = []
    for p in peers:
        d, _ = p.until(_control("request_params"))
        cycles.append(d.envelope.control.request_params.cycle)
    assert cycles == [1, 1]
    good = np.full((3,), 2.0, dtype=np.float32)
    peers[0].send("round", *pack_round([good], cycle=1, weight=1.0))
    header, blobs = pack_round([good], cycle=1, weight=1.0)
    peers[1].send("round", header, [np.full((3,), np.nan, dtype=np.float32).tobytes()])
    # Both get the consensus at once (no reduce_stall_s wait), rank 1 a copy to reset to.
    rounds = [p.until(lambda d: d.kind == "round", timeout_ms=3000)[0] for p in peers]
    for d in rounds:
        assert d.envelope.round.cycle == 1 and d.envelope.round.weight == 1.0
        np.testing.assert_allclose(unpack_round(d.envelope.round, d.blobs)[0], 2.0)
    assert list(rounds[0].envelope.round.contributing_ranks) == [0]
    assert list(rounds[1].envelope.round.contributing_ranks) == []  # "apply it": reset
    _until(lambda: 1 in svc.state.rounds.refused)  # the core heard it before any ack
    assert svc.dropped["contribution_non_finite"] == 1
    for p in peers:
        p.timing(sync_ack=pb.Timing.SyncAck(cycle=1, step_count=1))
    _until(lambda: svc.state.rounds.version == 1)
    ec = svc.state.coverage.epochs[0]
    assert ec.discarded == 4 and ec.unique == 4  # rank 0's batch committed, rank 1's discarded
    assert svc.state.ranks[1].folded_step == 1 and svc.state.rounds.global_step == 1
    # Rank 1's 4 positions [8, 12) go out again, split between the two ranks.
    got = []
    for p in peers:
        d, _ = p.until(_control("extend_partition"))
        x = d.envelope.control.extend_partition
        got.append((x.partition_offset, x.partition_size))
    assert sorted(got) == [(8, 2), (10, 2)]
    records = [json.loads(line) for line in journal.read_text().splitlines()]
    refused = [r for r in records if r.get("type") == "ContributionRefused"]
    assert len(refused) == 1 and refused[0]["rank"] == 1 and refused[0]["cycle"] == 1
    assert refused[0]["reason"].startswith("non_finite")
