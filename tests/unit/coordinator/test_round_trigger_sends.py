"""A round's trigger sends what its pass decided at once; other frames' sends wait for the pass's end.

A drain pass handles up to ``DRAIN_BATCH`` frames and sends their commands together at
its end (one journal fsync for all). The frame that opens an averaging round is the
exception: its ``RequestParams`` to every rank leave before the next frame is read, the
journal synced first as at a pass's end (write-ahead), so the ranks do not wait for the
rest of the pass.
"""

from __future__ import annotations

import zmq

from flodl_coordinator.service import CoordinatorService
from flodl_coordinator.settings import load_settings


class _Socket:
    """Hands out queued messages (then ``zmq.Again``) and logs every read and send in order."""

    def __init__(self, messages: list[list[bytes]], log: list) -> None:
        self.queue, self.cur, self.log = list(messages), [], log

    def recv(self, flags=0, copy=True, track=False):
        if not self.cur:
            if not self.queue:
                raise zmq.Again()
            self.cur = list(self.queue.pop(0))
            self.log.append(("read", self.cur[-1]))
        return self.cur.pop(0)

    def getsockopt(self, opt):
        assert opt == zmq.RCVMORE
        return 1 if self.cur else 0

    def send(self, data, flags=0, copy=True, track=False):
        if not flags & zmq.SNDMORE:
            self.log.append(("sent", bytes(data)))


def _service() -> CoordinatorService:
    return CoordinatorService(load_settings(env={}, flags={
        "world_size": 2, "bind": "tcp://127.0.0.1:0", "session": "trigger", "epochs": 1, "batch_size": 4,
    }), ready=lambda ep: None)  # fmt: skip


def test_a_round_trigger_sends_its_decisions_before_the_next_frame_is_read():
    log: list = []
    svc = _service()
    try:
        svc.sock = _Socket([[b"r", b"", name] for name in (b"batch-1", b"trigger", b"batch-2", b"batch-3")], log)

        def on_routed(route, payload):  # a stand-in for the core's decisions on each frame
            name = payload[0]
            if name == b"trigger":
                svc._opened_round = True  # (what executing OpenRound marks)
                for rank in (0, 1):
                    svc._send_frames([b"r", b"", b"request_params-%d" % rank])
            else:
                svc._send_frames([b"r", b"", b"plan-after-" + name])

        svc._on_routed = on_routed
        svc._sync_journal = lambda: log.append(("fsync", b""))  # write-ahead: before any send
        svc._drain_socket()
    finally:
        svc._wake_r.close()
    assert log == [
        ("read", b"batch-1"),
        ("read", b"trigger"),
        ("fsync", b""),  # what decided batch-1's plan and the round is durable first ...
        ("sent", b"plan-after-batch-1"),  # ... then what the pass decided so far, in order
        ("sent", b"request_params-0"),
        ("sent", b"request_params-1"),
        ("read", b"batch-2"),
        ("read", b"batch-3"),
        ("fsync", b""),  # the pass's end: the rest together
        ("sent", b"plan-after-batch-2"),
        ("sent", b"plan-after-batch-3"),
    ]
    assert svc._outbox is None  # the pass closed
    stats = svc.loop_meter.summary()
    assert (stats["frames"], stats["round_triggers"]) == (4, 1)
