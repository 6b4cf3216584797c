"""Framing: route split, envelope checks, sequence tracking."""

import pytest

from flodl.wire import (
    DELIMITER,
    PROTOCOL_MAJOR,
    Endpoint,
    MalformedFrame,
    OutOfSequence,
    SeqTracker,
    VersionMismatch,
    WrongSession,
    decode,
    pb,
    split_routing,
)


def _rank_endpoint(rank=1, inc=7, session="s1"):
    return Endpoint(session, pb.Sender.KIND_RANK, rank=rank, incarnation=inc)


def _batch(rank=1):
    return pb.Timing(rank=rank, batch=pb.Timing.Batch(batch_ms=2.5, step_count=3, samples=8))


def test_roundtrip_through_two_routing_hops():
    frames = _rank_endpoint().frames("timing", _batch(), route=(b"relay", b"rank"))
    route, payload = split_routing(frames)
    assert route == (b"relay", b"rank")
    d = decode(payload, session="s1")
    assert d.kind == "timing"
    assert d.envelope.timing.batch.step_count == 3
    assert d.envelope.seq == 1 and d.envelope.protocol_major == PROTOCOL_MAJOR


def test_blobs_travel_as_frames_and_are_counted():
    blobs = [b"\x00" * 16, memoryview(b"abcd")]
    frames = _rank_endpoint().frames("round", pb.RoundHeader(cycle=1), blobs)
    _, payload = split_routing(frames)
    d = decode(payload, session="s1")
    assert d.blobs == blobs
    frames.append(b"extra")
    _, payload = split_routing(frames)
    with pytest.raises(MalformedFrame, match="announces 2 blobs, frame has 3"):
        decode(payload, session="s1")


def test_missing_delimiter_is_malformed():
    with pytest.raises(MalformedFrame, match="no empty delimiter"):
        split_routing([b"id", b"envelope"])


def test_wrong_session_is_refused_by_name():
    _, payload = split_routing(_rank_endpoint(session="other").frames("timing", _batch()))
    with pytest.raises(WrongSession, match="'other'"):
        decode(payload, session="s1")


def test_other_major_version_is_refused_with_both_versions():
    env = pb.Envelope(protocol_major=PROTOCOL_MAJOR + 1, session="s1", seq=1)
    env.sender.kind = pb.Sender.KIND_RANK
    env.timing.CopyFrom(_batch())
    with pytest.raises(VersionMismatch, match=f"protocol {PROTOCOL_MAJOR + 1}.0"):
        decode([env.SerializeToString()], session="s1")


def test_garbage_envelope_is_malformed():
    with pytest.raises(MalformedFrame, match="does not parse"):
        decode([b"\xff\xff\xff\xff"], session="s1")


def test_envelope_without_body_or_sender_is_malformed():
    env = pb.Envelope(protocol_major=PROTOCOL_MAJOR, session="s1", seq=1)
    env.sender.kind = pb.Sender.KIND_RANK
    with pytest.raises(MalformedFrame, match="no body"):
        decode([env.SerializeToString()], session="s1")
    env.timing.CopyFrom(_batch())
    env.sender.kind = pb.Sender.KIND_UNSPECIFIED
    with pytest.raises(MalformedFrame, match="no sender kind"):
        decode([env.SerializeToString()], session="s1")


def test_seq_tracker_refuses_replay_and_accepts_new_incarnation():
    ep = _rank_endpoint(inc=1)
    t = SeqTracker()
    envs = []
    for _ in range(3):
        _, payload = split_routing(ep.frames("timing", _batch()))
        envs.append(decode(payload, session="s1").envelope)
    for e in envs:
        t.check(e)
    with pytest.raises(OutOfSequence, match="seq 2 after 3"):
        t.check(envs[1])
    restarted = _rank_endpoint(inc=2)
    _, payload = split_routing(restarted.frames("timing", _batch()))
    t.check(decode(payload, session="s1").envelope)  # seq 1 of a new incarnation is fine


def test_delimiter_is_empty_bytes():
    assert DELIMITER == b""


def test_seq_tracker_keeps_one_counter_per_route_and_verify_records_nothing():
    real, forged = _rank_endpoint(inc=3), _rank_endpoint(inc=3)  # same rank, same incarnation
    forged._seq = 2**63 - 1  # its next frame carries seq 2**63
    t = SeqTracker()
    env = lambda ep: decode(split_routing(ep.frames("timing", _batch()))[1], session="s1").envelope  # noqa: E731
    t.check(env(real), (b"real",))
    big = env(forged)
    t.check(big, (b"rogue",))  # recorded for the rogue's own route only
    t.check(env(real), (b"real",))  # the real rank's seq 2 still counts up from its own 1
    t.verify(env(forged), (b"real",))  # verify alone never records...
    t.check(env(real), (b"real",))  # ...so seq 3 on the real route still passes
    with pytest.raises(OutOfSequence):
        t.check(big, (b"rogue",))  # a replay on the rogue's own route is still refused


def test_an_envelope_over_the_limit_is_refused_before_it_is_parsed():
    from flodl.wire import MAX_ENVELOPE_BYTES, Oversized

    ep = _rank_endpoint()
    hello = pb.RankHello(rank=1, world_size=2, model_sig=b"a" * 32, host="h" * MAX_ENVELOPE_BYTES)
    _, payload = split_routing(ep.frames("hello", hello))
    with pytest.raises(Oversized, match="exceeds"):
        decode(payload, session="s1")
    _, payload = split_routing(ep.frames("hello", pb.RankHello(rank=1, world_size=2, host="h" * 1000)))
    assert decode(payload, session="s1").envelope.hello.host == "h" * 1000


def test_endpoint_writes_the_envelope_protobuf_would_serialize():
    # Written in pieces (a prefix serialised once, then seq, blob count, body): the
    # same bytes as building the Envelope and serialising it, for every body kind.
    from flodl.wire._codec import PROTOCOL_MAJOR, PROTOCOL_MINOR

    ep = Endpoint("s", pb.Sender.KIND_RANK, rank=3, host="h", incarnation=2**63 - 5)
    bodies = [
        ("control", pb.Control(command_id=5, request_params=pb.Control.RequestParams(cycle=1))),
        ("timing", pb.Timing(rank=3, batch=pb.Timing.Batch(batch_ms=1.5, step_count=9))),
        ("timing", pb.Timing()),  # an empty body is still the one the oneof names
        ("round", pb.RoundHeader(cycle=3)),
        ("hello", pb.RankHello(rank=3, model_sig=b"x" * 32)),
    ]
    for seq_from in (0, 126, 300, 2**40):  # one- and many-byte varints
        ep._seq = seq_from
        for name, body in bodies:
            for blobs in ((), (b"a", b"bb")):
                frames = ep.frames(name, body, blobs, route=(b"r",))
                ref = pb.Envelope(protocol_major=PROTOCOL_MAJOR, protocol_minor=PROTOCOL_MINOR, session="s",
                                  seq=ep._seq, blob_count=len(blobs))  # fmt: skip
                ref.sender.CopyFrom(ep.sender)
                getattr(ref, name).CopyFrom(body)
                assert frames[2] == ref.SerializeToString(), (name, seq_from)
                d = decode(frames[2:], session="s")
                assert d.kind == name and d.envelope == ref


def test_endpoint_session_set_later_is_the_one_its_frames_name():
    ep = Endpoint("", pb.Sender.KIND_RELAY, host="relay-a", incarnation=3)  # a relay's folder, before FoldOpen
    ep.session = "run-7"
    frames = ep.frames("round", pb.RoundHeader(cycle=1))
    assert decode(frames[1:], session="run-7").envelope.sender.host == "relay-a"


def test_seq_tracker_accept_with_verifys_key_is_accept_without_it():
    """The service records a frame with the key ``verify`` built for it (not twice);
    the counter it moves is the one a plain ``accept`` would."""
    ep = _rank_endpoint(inc=4)
    env = lambda: decode(split_routing(ep.frames("timing", _batch()))[1], session="s1").envelope  # noqa: E731
    keyed, plain = SeqTracker(), SeqTracker()
    for _ in range(3):
        e = env()
        keyed.accept(e, [b"r"], key=keyed.verify(e, [b"r"]))  # a list route: the key is a tuple all the same
        plain.verify(e, (b"r",))
        plain.accept(e, (b"r",))
    assert keyed._last == plain._last and list(keyed._last) == [((b"r",), (pb.Sender.KIND_RANK, 1))]
    late = env()
    keyed.accept(late, (b"r",), key=keyed.verify(late, (b"r",)))
    with pytest.raises(OutOfSequence, match="seq 4 after 4"):
        keyed.verify(late, (b"r",))


def test_split_routing_copies_frame_routes_to_bytes():
    import zmq

    route, payload = split_routing([zmq.Frame(b"relay"), zmq.Frame(b"rank"), zmq.Frame(b""), b"env"])
    assert route == (b"relay", b"rank") and all(type(r) is bytes for r in route)
    assert payload == [b"env"]


def test_varint_is_protobufs_at_every_length_boundary():
    from flodl.wire._codec import _varint

    assert _varint(0) == b"\x00"  # (proto3 writes no zero field: nothing to compare with)
    edges = [1, 127, 128, 129, 300, 16383, 16384, 16385, 2**21 - 1, 2**21, 2**28, 2**35 + 5, 2**63 - 1]
    for n in edges + list(range(1, 20000, 7)) + list(range(2**21 - 5000, 2**21 + 50, 3)):
        assert _varint(n) == pb.Envelope(seq=n).SerializeToString()[1:], n
