"""The ROUTER's receive path: small head parts as bytes, tensor blobs zero-copy."""

from __future__ import annotations

import pytest
import zmq

from flodl.wire import MalformedFrame, split_routing
from flodl_coordinator.inbound import recv_frames, recv_message, recv_routed


@pytest.fixture
def pair():
    ctx = zmq.Context()
    router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.IDENTITY, b"rank-0")
    router.bind("inproc://inbound")
    dealer.connect("inproc://inbound")
    yield router, dealer
    router.close(0)
    dealer.close(0)
    ctx.term()


def _wait(sock):
    assert sock.poll(2000, zmq.POLLIN), "nothing arrived"


def test_recv_message_head_is_bytes_blobs_are_frames(pair):
    router, dealer = pair
    blob = bytes(range(256)) * 64
    dealer.send_multipart([b"", b"envelope", blob, b"tiny"])
    _wait(router)
    parts = recv_message(router)
    assert parts[:3] == [b"rank-0", b"", b"envelope"]
    assert all(type(p) is bytes for p in parts[:3])
    assert [type(p) for p in parts[3:]] == [zmq.Frame, zmq.Frame]
    assert parts[3].bytes == blob and parts[4].bytes == b"tiny"


def test_recv_message_without_blobs_and_without_delimiter(pair):
    router, dealer = pair
    dealer.send_multipart([b"", b"envelope"])
    dealer.send_multipart([b"no-delimiter", b"at-all"])
    _wait(router)
    assert recv_message(router) == [b"rank-0", b"", b"envelope"]
    _wait(router)
    assert recv_message(router) == [b"rank-0", b"no-delimiter", b"at-all"]


def test_recv_message_nothing_queued_raises_again(pair):
    router, _ = pair
    with pytest.raises(zmq.Again):
        recv_message(router)


def test_recv_frames_keeps_the_last_part_a_frame(pair):
    router, dealer = pair
    dealer.send_multipart([b"", b"envelope"])
    _wait(router)
    parts = recv_frames(router)
    assert parts[:2] == [b"rank-0", b""]
    assert type(parts[-1]) is zmq.Frame and parts[-1].bytes == b"envelope"


# -- recv_routed: split while receiving, the same split as split_routing --------------


def test_recv_routed_splits_a_relayed_message_head_bytes_blobs_frames(pair):
    router, dealer = pair
    blob = bytes(range(256)) * 64
    dealer.send_multipart([b"rank-7", b"", b"envelope", blob])  # as a relay's proxy stacks it
    _wait(router)
    route, payload = recv_routed(router)
    assert route == (b"rank-0", b"rank-7") and type(route) is tuple
    assert payload[0] == b"envelope" and type(payload[0]) is bytes
    assert type(payload[1]) is zmq.Frame and payload[1].bytes == blob


def test_recv_routed_delimiter_without_envelope_is_an_empty_payload(pair):
    router, dealer = pair
    dealer.send_multipart([b""])
    _wait(router)
    assert recv_routed(router) == ((b"rank-0",), [])


@pytest.mark.parametrize(
    "sent, error",
    [
        ([b"no-delimiter", b"at-all"], "no empty delimiter"),
        ([b"a", b"b", b"c", b"d", b"", b"envelope", b"blob"], "route of 5 hops exceeds 4"),
        ([b"a", b"b", b"c", b"d", b"e", b"f"], "no empty delimiter"),  # too long, and no delimiter at all
    ],
)
def test_recv_routed_hands_back_whole_what_split_routing_refuses(pair, sent, error):
    router, dealer = pair
    dealer.send_multipart(sent)
    _wait(router)
    route, parts = recv_routed(router)
    assert route is None and [bytes(p) for p in parts] == [b"rank-0", *sent]
    with pytest.raises(MalformedFrame, match=error):
        split_routing(parts)
    assert router.poll(0) == 0  # the whole message was taken: the next one starts clean


@pytest.mark.parametrize(
    "sent",
    [
        [b"", b"envelope"],
        [b"a", b"b", b"c", b"", b"envelope", b"x", b"y"],  # 4 hops: the most a route may have
        [b"a", b"", b"envelope", b"", b""],  # empty blobs are blobs
        [b"", b"", b"envelope"],  # the first empty part is the delimiter
    ],
)
def test_recv_routed_agrees_with_split_routing(pair, sent):
    router, dealer = pair
    dealer.send_multipart(sent)
    dealer.send_multipart(sent)
    _wait(router)
    route, payload = recv_routed(router)
    _wait(router)
    want_route, want_payload = split_routing(recv_message(router))
    assert route == want_route
    assert [bytes(p) for p in payload] == [bytes(p) for p in want_payload]


def test_recv_routed_nothing_queued_raises_again(pair):
    router, _ = pair
    with pytest.raises(zmq.Again):
        recv_routed(router)
