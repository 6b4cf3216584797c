"""Whether a connecting socket's peer is there right now: zmq's socket monitor, read on demand.

The agent closes its DEALER with a linger that lets its last ``rank_exited`` frames
reach the coordinator. Once the run ended cleanly, the coordinator has typically
exited already: the frames then sit in a pipe with no connection and the linger is
waited out in full, every run. The monitor says whether the link is up when the socket
closes: a connected peer takes what is queued at once (the kernel holds it, not zmq),
a peer that is gone gets nothing however long we wait.
"""

from __future__ import annotations

import zmq
from zmq.utils.monitor import recv_monitor_message

__all__ = ["PeerLink"]

_UP = zmq.EVENT_HANDSHAKE_SUCCEEDED
_DOWN = zmq.EVENT_DISCONNECTED


class PeerLink:
    def __init__(self, sock: zmq.Socket) -> None:
        self._sock = sock
        self._monitor: zmq.Socket | None = sock.get_monitor_socket(_UP | _DOWN)
        self._up = 0  # handshakes minus disconnects seen so far (a DEALER has one peer)

    def connected(self) -> bool:
        """Whether the peer is connected now (every event queued so far read)."""
        mon = self._monitor
        while mon is not None:
            try:
                event = recv_monitor_message(mon, zmq.NOBLOCK)["event"]
            except zmq.Again:
                break
            if event == _UP:
                self._up += 1
            elif event == _DOWN:
                self._up = max(0, self._up - 1)
        return self._up > 0

    def close(self) -> None:
        """Stop monitoring (before the socket itself closes)."""
        if self._monitor is not None:
            try:
                self._sock.disable_monitor()
            except zmq.ZMQError:
                pass
            self._monitor.close(0)
            self._monitor = None
