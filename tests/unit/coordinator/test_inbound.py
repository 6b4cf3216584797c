"""The ROUTER's receive path: small head parts as bytes, tensor blobs zero-copy."""

from __future__ import annotations

import pytest
import zmq

from flodl_coordinator.inbound import recv_frames, recv_message


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
