"""bf16 on the wire with a real rank process: half the bytes each way, exact f32 at rest.

``RunSpec.bf16_wire`` (from the coordinator's settings, in the hello_ack) makes the rank
send its round as bf16; a bf16 consensus comes back at half the size too. What the rank
then holds, saves (``model.pt``) and digests is f32: the bf16 values widened exactly,
never re-rounded, never stored as bf16.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch
import zmq

from flodl.wire import Endpoint, bf16_to_f32, decode, f32_to_bf16, pack_round, pb, split_routing, unpack_round
from flodl_coordinator.service import CoordinatorService
from flodl_coordinator.settings import load_settings
from test_rank_checkpoint import admit, checkpoint, expect_result, load, spec, start_rank, train_epoch, wait_exit

SHAPES = [(16, 8), (16,), (3, 16), (3,)]  # the synthetic example's parameters at these sizes


def test_the_setting_reaches_the_run_spec_ranks_receive_and_the_reducer():
    s = load_settings(env={"FLODL_BF16_WIRE": "1"}, flags={"world_size": 1, "bind": "tcp://127.0.0.1:0",
                                                          "session": "bf16"})  # fmt: skip
    svc = CoordinatorService(s)
    assert svc.reducer.bf16_wire
    ep, t = svc.start_thread()
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        sock.connect(ep)
        me = Endpoint("bf16", pb.Sender.KIND_RANK, rank=0, incarnation=1)
        sock.send_multipart(me.frames("hello", pb.RankHello(rank=0, world_size=1, model_sig=b"m" * 32, dataset_len=8)))
        while True:
            assert sock.poll(5000), "no hello_ack"
            d = decode(split_routing(sock.recv_multipart())[1], session="bf16")
            if d.kind == "hello_ack":
                break
        assert d.envelope.hello_ack.accepted and d.envelope.hello_ack.run.bf16_wire
    finally:
        ctx.destroy(0)
        svc.request_stop()
        t.join(15)


@pytest.mark.integration
def test_bf16_round_trip_halves_bytes_and_the_checkpoint_stays_exact_f32(coordinator, procs, py, tmp_path):
    proc = start_rank(procs, py, coordinator)
    route = admit(coordinator, spec(bf16_wire=True))
    train_epoch(coordinator, route, 0, 64)
    checkpoint(coordinator, route, 1, tmp_path / "a" / "model.pt", cycle=1)  # armed: saved on apply

    coordinator.control(route, request_params=pb.Control.RequestParams(cycle=1))
    _, d = coordinator.expect("round")
    up = d.envelope.round
    numel = [int(np.prod(s)) for s in SHAPES]
    assert [tuple(m.shape) for m in up.tensors] == SHAPES
    assert all(m.dtype == pb.DTYPE_BF16 for m in up.tensors)
    assert [len(b) for b in d.blobs] == [2 * n for n in numel]  # half of f32, upstream
    assert all(a.dtype == np.float32 for a in unpack_round(up, d.blobs))

    rng = np.random.default_rng(0)
    consensus = [rng.standard_normal(s).astype(np.float32) for s in SHAPES]
    header, blobs = pack_round(consensus, cycle=1, weight=4.0, bf16=True)
    assert [len(b) for b in blobs] == [2 * n for n in numel]  # and downstream
    coordinator.send(route, "round", header, blobs)
    _, d = coordinator.expect("timing", "sync_ack")
    res = expect_result(coordinator)
    assert (res.version, res.HasField("error")) == (1, False)

    widened = [bf16_to_f32(f32_to_bf16(c)) for c in consensus]
    saved = load(tmp_path / "a" / "model.pt")["model"]
    for t, w in zip(saved.values(), widened):
        assert t.dtype == torch.float32
        assert np.array_equal(t.numpy(), w)  # bit for bit: f32 at rest, no second rounding

    coordinator.control(route, shutdown=pb.Control.Shutdown(reason="done"))
    _, d = coordinator.expect("timing", "exiting")
    digest = hashlib.sha256(b"".join(w.astype("<f4").tobytes() for w in widened)).digest()
    assert d.envelope.timing.exiting.param_digest == digest
    code, err = wait_exit(proc)
    assert code == 0, err
