"""The decoder never crashes: any bytes decode or raise a WireError with a reason."""

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flodl.wire import Endpoint, WireError, decode, pack_round, pb, split_routing, unpack_round

SESSION = "fuzz"


def _valid_payloads():
    ep = Endpoint(SESSION, pb.Sender.KIND_RANK, rank=2, incarnation=9)
    t = pb.Timing(rank=2, batch=pb.Timing.Batch(batch_ms=1.5, step_count=4, samples=32, epoch=1, offset=64))
    m = pb.Metrics(rank=2, epoch=1, batches_processed=3, samples_processed=96)
    h, blobs = pack_round([np.ones((2, 3), np.float32)], cycle=5, weight=3.0)
    hello = pb.RankHello(rank=2, world_size=3, model_sig=b"s" * 32, dataset_len=100)
    out = []
    for body, msg, b in (("timing", t, []), ("metrics", m, []), ("round", h, blobs), ("hello", hello, [])):
        frames = ep.frames(body, msg, b, route=(b"relay", b"rank"))
        out.append(split_routing(frames)[1])
    return out


VALID = _valid_payloads()


def _must_decode_or_refuse(payload):
    try:
        d = decode(payload, session=SESSION)
    except WireError as e:
        assert e.reason and e.detail
        return
    if d.kind == "round":
        try:
            unpack_round(d.envelope.round, d.blobs)
        except WireError as e:
            assert e.reason


@settings(max_examples=5000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.binary(max_size=200), min_size=0, max_size=4))
def test_random_frames_never_crash(frames):
    try:
        route, payload = split_routing(frames)
    except WireError:
        return
    _must_decode_or_refuse(payload)


@settings(max_examples=5000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    which=st.integers(0, len(VALID) - 1),
    pos=st.integers(0, 10_000),
    byte=st.integers(0, 255),
    cut=st.integers(0, 10_000),
    drop_blob=st.booleans(),
)
def test_mutated_valid_frames_never_crash(which, pos, byte, cut, drop_blob):
    payload = [bytes(x) for x in VALID[which]]
    env = bytearray(payload[0])
    env[pos % len(env)] = byte
    payload[0] = bytes(env[: max(1, len(env) - cut % 8)])
    if drop_blob and len(payload) > 1:
        payload.pop()
    _must_decode_or_refuse(payload)
