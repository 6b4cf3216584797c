"""The service's send path: part by part for bytes messages, send_multipart for blobs."""

from __future__ import annotations

import pytest
import zmq

from flodl_coordinator.service import _send_parts


@pytest.fixture
def pair():
    ctx = zmq.Context()
    router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    router.setsockopt(zmq.ROUTER_MANDATORY, 1)
    dealer.setsockopt(zmq.IDENTITY, b"rank-0")
    router.bind("inproc://send-parts")
    dealer.connect("inproc://send-parts")
    dealer.send_multipart([b"", b"hello"])  # the router learns the dealer's identity
    assert router.poll(2000)
    router.recv_multipart()
    yield router, dealer
    router.close(0)
    dealer.close(0)
    ctx.term()


def _got(dealer):
    assert dealer.poll(2000), "nothing arrived"
    return dealer.recv_multipart()


def test_bytes_and_blob_messages_arrive_whole_and_in_order(pair):
    router, dealer = pair
    blob = bytes(range(256)) * 300
    _send_parts(router, [b"rank-0", b"", b"control"])
    _send_parts(router, [b"rank-0", b"", b"round", zmq.Frame(blob), memoryview(b"tail")])
    _send_parts(router, [b"rank-0", b"", b"after"])
    assert _got(dealer) == [b"", b"control"]
    assert _got(dealer) == [b"", b"round", blob, b"tail"]
    assert _got(dealer) == [b"", b"after"]


def test_an_unroutable_peer_fails_before_anything_is_queued(pair):
    router, dealer = pair
    with pytest.raises(zmq.ZMQError) as e:
        _send_parts(router, [b"gone", b"", b"lost"])
    assert e.value.errno == zmq.EHOSTUNREACH
    with pytest.raises(zmq.ZMQError):
        _send_parts(router, [b"gone", b"", b"round", zmq.Frame(b"x" * 100_000)])
    _send_parts(router, [b"rank-0", b"", b"next"])  # no half message left behind either way
    assert _got(dealer) == [b"", b"next"]
    assert dealer.poll(100) == 0
