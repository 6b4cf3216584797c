"""A resumed coordinator over real sockets: the hello_ack names the model to load.

The service runs in a thread (its loop owns its socket); the test plays ranks with
DEALER sockets, with poll deadlines instead of sleeps.
"""

from __future__ import annotations

import hashlib
import json
import os

import pytest
import zmq

from flodl.core import CoreConfig, initial_state
from flodl.core import checkpoint_meta
from flodl.wire import Endpoint, decode, pb, split_routing
from flodl_coordinator.checkpoints import MODEL_FILE, CheckpointStore
from flodl_coordinator.settings import load_settings

SESSION = "ckpt-svc-test"


@pytest.fixture
def checkpoint(tmp_path):
    st = initial_state(CoreConfig(world_size=2, batch_size=4, num_epochs=3, seed=7, total_samples=100, policy="sync"))
    store = CheckpointStore(str(tmp_path / "ck"))
    path = store.model_path(2, 0)
    with open(path, "wb") as fh:
        fh.write(b"model bytes")
    store.stage_meta(2, json.loads(json.dumps(checkpoint_meta(st, 2))))
    (c,) = store.on_result(2, 0, error=None, sha256=hashlib.sha256(b"model bytes").digest())
    return c.path


@pytest.fixture
def resumed_service(serve, checkpoint, tmp_path):
    return serve(load_settings(env={}, flags={
        "world_size": 2, "bind": "tcp://127.0.0.1:0", "session": SESSION, "epochs": 3, "seed": 7,
        "batch_size": 4, "policy": "sync", "liveness_timeout_s": 30.0, "resume": checkpoint,
        "journal": str(tmp_path / "journal"),
    }))  # fmt: skip


def hello(ctx, ep, rank: int, n: int) -> pb.HelloAck:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(ep)
    me = Endpoint(SESSION, pb.Sender.KIND_RANK, rank=rank, incarnation=rank + 1)
    sock.send_multipart(me.frames("hello", pb.RankHello(rank=rank, world_size=2, model_sig=b"s" * 32, dataset_len=n)))
    while True:
        assert sock.poll(5000), "no hello_ack"
        d = decode(split_routing(sock.recv_multipart())[1], session=SESSION)
        if d.kind == "hello_ack":
            return d.envelope.hello_ack


def test_a_resumed_run_tells_each_rank_which_model_to_load(resumed_service, checkpoint, tmp_path):
    svc, ep, ctx = resumed_service
    short = hello(ctx, ep, 1, 99)  # the epoch size is pinned to the checkpoint's 100
    assert not short.accepted and "total_samples 100" in short.reason and short.run.resume_from == ""
    ack = hello(ctx, ep, 0, 100)
    assert ack.accepted and ack.run.resume_from == os.path.join(checkpoint, MODEL_FILE)
    assert ack.run.total_samples == 100
    start = json.loads((tmp_path / "journal").read_text().splitlines()[0])
    assert start["type"] == "_start" and start["resume_meta"]["version"] == 2  # replay resumes alike
