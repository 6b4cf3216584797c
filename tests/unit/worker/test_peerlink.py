"""flodl_worker.peerlink: whether the coordinator is connected, from zmq's socket monitor,
and the agent's closing linger that follows from it (none once a clean run's coordinator
hung up; the full linger for a failure's reports, which a restarting coordinator wants)."""

import time

import zmq

from flodl_worker.agent import CLEAN_LINGER_MS, LINGER_MS, Agent
from flodl_worker.peerlink import PeerLink


def _until(cond, what, timeout=5.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return
        time.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


def test_the_link_follows_the_peer_going_and_coming_back():
    ctx = zmq.Context()
    try:
        router = ctx.socket(zmq.ROUTER)
        port = router.bind_to_random_port("tcp://127.0.0.1")
        dealer = ctx.socket(zmq.DEALER)
        link = PeerLink(dealer)
        assert not link.connected()  # not connected yet
        dealer.connect(f"tcp://127.0.0.1:{port}")
        _until(link.connected, "the handshake")
        router.close(0)  # the coordinator exits
        _until(lambda: not link.connected(), "the disconnect")
        again = ctx.socket(zmq.ROUTER)
        again.bind(f"tcp://127.0.0.1:{port}")  # ... and a restarted one binds the same address
        _until(link.connected, "the reconnect")
        link.close()
        link.close()  # idempotent
        again.close(0)
        dealer.close(0)
    finally:
        ctx.term()


class _Link:
    def __init__(self, up):
        self.up = up

    def connected(self):
        return self.up


def test_the_agent_waits_for_a_coordinator_only_where_one_can_take_the_frames():
    agent = object.__new__(Agent)
    agent.link = _Link(up=False)
    assert agent._linger_ms(clean=True) == 0  # a clean run, the coordinator gone: nobody to wait for
    assert agent._linger_ms(clean=False) == LINGER_MS  # a failure's reports: it may be restarting
    agent.link = _Link(up=True)
    assert agent._linger_ms(clean=True) == CLEAN_LINGER_MS
    assert agent._linger_ms(clean=False) == LINGER_MS
