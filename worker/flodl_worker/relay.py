"""flodl_worker.relay: the per-host relay: forwards control, folds averaging rounds.

    flodl-worker relay --coordinator tcp://HEAD:5555 --bind ipc:///run/flodl/relay.sock [--no-fold]

Theory of operation
-------------------
One thread, one poll loop, three sockets it alone owns:

- frontend ROUTER (bind, loopback or ipc) for this host's ranks. A rank's
  ``[b"", envelope, blobs...]`` arrives as ``[rank_id, b"", ...]``;
- backend DEALER (connect, identity ``relay-<host>-<pid>-<random>``) to the coordinator, whose
  ROUTER therefore sees ``[relay_id, rank_id, b"", ...]``, and whose reply
  ``[relay_id, rank_id, b"", ...]`` comes back here as ``[rank_id, b"", ...]`` and is
  routed to that rank. A reply with no rank id (``[b"", envelope]``: the coordinator
  sent it to the route ``(relay_id,)``) is for the relay itself: ``RelayMsg``.
- a PAIR/inproc control socket on which a signal becomes TERMINATE (below).

Folding (on by default; ``--no-fold`` forwards everything untouched): the coordinator
sends ``FoldOpen{cycle, ranks}`` before the ranks' ``RequestParams``; the ranks'
``round`` frames of that cycle are kept and summed into ONE frame upstream
(``flodl_worker.fold``: f32 accumulation, weight = sum, ``contributing_ranks``), so the
coordinator's link carries one model per host instead of one per rank. ``FoldDrop``
removes a rank that died, and the rest flushes. A message is only parsed while a fold
still waits for the routing id that sent it; everything else is forwarded as it came
(zero-copy frames), so control latency pays one dict lookup.

Fan-out, the way down: the consensus of a cycle this relay folded comes ONCE, on the
relay's own route, with ``deliver_to`` naming its ranks; the relay sends the very same
frames (zero-copy) to each of their frontend ids (from that cycle's ``FoldOpen``). It is
read from the same backend pipe, in order, as the ranks' own frames, so each rank still
sees the coordinator's sequence numbers increase.

It used to be libzmq's ``zmq_proxy_steerable``; folding needs to look at frames, so it
is a Python loop now, kept lean and bounded:

- The frontend does NOT set ROUTER_MANDATORY: a send to a rank that has gone must not
  fail the relay (one dead rank would take its host down). libzmq drops the frame; the
  coordinator learns of the death from the agent (``agent.rank_exited``) or silence.
- Backpressure, never an unbounded queue: the loop reads the frontend only while the
  backend can take a message. A send that would block is parked in ``pending`` (at most
  ``PENDING_MAX`` messages) and the loop waits for the backend to drain; each rank's own
  bounded queue then pushes back on it. Frames for ranks never block (ROUTER drops at
  its high-water mark).

Signals. SIGTERM/SIGINT only become a TERMINATE written into the control socket; the
loop reads it and returns. Then what the ranks already queued (and the raw parts of a
fold in progress, still valid contributions on their own) is forwarded (bounded), the
backend flushes with a bounded linger, exit 0.

  Why not a Python signal handler: it runs only when the interpreter gets control back.
  A signal that lands while the loop is inside a C call that is not interrupted (a
  send, a large sum; not blocked in poll, so no EINTR) just sets a flag, and the loop
  can then block in poll forever with TERMINATE never sent (observed with the C proxy:
  about one SIGTERM in five lost). So the main thread *blocks* SIGTERM and SIGINT
  before any other thread exists, and a small thread collects them with
  ``signal.sigwait`` (race-free: a blocked signal stays pending until collected) and
  writes TERMINATE from its own PAIR socket, which it keeps open until the loop has
  returned (see ``_signal_to_terminate``).

On start, the bound endpoint (port 0 resolved) is printed on stdout as one line
``RELAY_READY <endpoint>``, so a parent can read it. Nothing else goes to stdout.
"""

from __future__ import annotations

import logging
import os
import secrets
import signal
import socket
import sys
import threading
import time
from collections import deque
from typing import TextIO

import zmq

from flodl.limits import DEFAULT_MAX_MESSAGE_BYTES, zmq_maxmsgsize  # numpy-free

# No numpy here, nor anything that imports it (flodl.wire, .fold): OpenBLAS starts its
# threads at import, and a thread that exists before ``run_relay`` blocks SIGTERM would
# take the signal with its default action (observed: the relay killed by -15 instead of
# a clean exit). ``run_relay`` imports the folder once the mask is in place.

__all__ = ["run_relay", "relay_identity", "routing_id", "READY_PREFIX"]

log = logging.getLogger("flodl.relay")

READY_PREFIX = "RELAY_READY"
CONTROL_ADDR = "inproc://flodl-relay-control"

# High-water marks, in messages (libzmq bounds counts, not bytes).
# - Rank -> coordinator (frontend RCVHWM, backend SNDHWM): timing frames are ~100 B, one
#   per step per rank; rounds are one per rank per cycle. 10k messages is minutes of
#   backlog. When the uplink stalls, the loop stops reading the frontend, and each
#   rank's own bounded queue pushes back: backpressure, never an unbounded relay queue
#   (reference hazard 5).
# - Coordinator -> rank (frontend SNDHWM): a ROUTER *drops* for a peer at its HWM. The
#   protocol sends a rank a handful of frames per cycle, so only a rank that has stopped
#   reading for a very long time can reach 10k, and then dropping is right.
HWM = 10_000
# On exit, the backend gets this long to hand the last frames (a rank's Exiting) to the
# coordinator; a vanished coordinator cannot hold the relay open longer.
LINGER_MS = 2_000
# After TERMINATE: forward frames the ranks already queued, until the frontend has been
# idle this long (ms), at most DRAIN_MAX_S in all.
DRAIN_IDLE_MS = 100
DRAIN_MAX_S = 1.0
# Messages one pass moves per socket before it looks at the others again (fairness).
BATCH = 256
# Upstream messages parked while the backend is at its HWM; past this the loop stops
# reading the coordinator too (only folds flushed by a FoldDrop can add to it then).
PENDING_MAX = 64


def routing_id(kind: str, host: str) -> str:
    """``<kind>-<host>-<pid>-<64 random bits>``: a relay's or an agent's routing id.

    ZeroMQ ids are 1..255 bytes and must not start with a zero byte; the host is cut to
    200 bytes (whole characters) so the random part is never cut. Random bits: the
    coordinator's ROUTER hands an id over to its newest connection, so an id must not be
    guessable by a remote peer (it is no secret on this host: argv, logs)."""
    return f"{kind}-{host.encode()[:200].decode(errors='ignore')}-{os.getpid()}-{secrets.token_hex(8)}"


def relay_identity(host: str) -> str:
    return routing_id("relay", host)


class _Loop:
    """The relay's poll loop; owns the three sockets from start to ``drain``."""

    def __init__(self, frontend: zmq.Socket, backend: zmq.Socket, control: zmq.Socket, folder):
        self.frontend, self.backend, self.control = frontend, backend, control
        self.folder = folder
        self.pending: deque = deque()
        self.forwarded_up = 0
        self._logged: set[str] = set()

    def run(self) -> None:
        """Serve until TERMINATE arrives on the control socket."""
        front, back, control = self.frontend, self.backend, self.control
        poller = zmq.Poller()
        poller.register(control, zmq.POLLIN)
        armed = None
        while True:
            parked, full = bool(self.pending), len(self.pending) >= PENDING_MAX
            if (parked, full) != armed:  # re-register only when the backpressure state changes
                armed = (parked, full)
                poller.register(back, (zmq.POLLOUT if parked else 0) | (0 if full else zmq.POLLIN))
                poller.register(front, 0 if parked else zmq.POLLIN)  # 0 = not now (backpressure)
            events = dict(poller.poll())
            if control in events:
                control.recv()
                return
            ev = events.get(back, 0)
            if ev & zmq.POLLOUT:
                self._flush_pending()
            if ev & zmq.POLLIN:
                self._from_coordinator()
            if events.get(front, 0) & zmq.POLLIN and not self.pending:
                self._from_ranks()

    def _from_ranks(self) -> None:
        folder = self.folder
        for _ in range(BATCH):
            try:
                msg = self.frontend.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            if folder is not None and folder.active:
                kept, up = folder.offer(msg)
                if not kept:
                    self._up(msg)
                for m in up:
                    self._up(m)
            else:
                self._up(msg)
            if self.pending:
                return  # the uplink is full: stop reading until it drains

    def _from_coordinator(self) -> None:
        for _ in range(BATCH):
            try:
                msg = self.backend.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            if len(msg) and len(msg[0]) == 0:  # [b"", envelope...]: for the relay itself
                self._for_me(msg[1:])
                if len(self.pending) >= PENDING_MAX:
                    return
                continue
            try:
                self.frontend.send_multipart(msg, zmq.NOBLOCK, copy=False)
            except zmq.ZMQError:
                pass  # no MANDATORY, so only a full queue for a stuck rank: dropped

    def _for_me(self, payload) -> None:
        if self.folder is None:
            return self._log_once("no-fold", "folding is off (--no-fold): the coordinator's fold messages are ignored",
                                  level=logging.INFO)
        up, deliver = self.folder.from_coordinator(payload)
        for ident in deliver:  # fan-out: the very frames (zero-copy) to each of these ranks
            try:
                self.frontend.send_multipart([ident, b"", *payload], zmq.NOBLOCK, copy=False)
            except zmq.ZMQError:
                pass  # as for any frame to a rank: a stuck or vanished one is dropped
        for m in up:
            self._up(m)

    def _up(self, msg) -> None:
        if self.pending:
            self.pending.append(msg)
            return
        try:
            self.backend.send_multipart(msg, zmq.NOBLOCK, copy=False)
            self.forwarded_up += 1
        except zmq.Again:
            self.pending.append(msg)

    def _flush_pending(self) -> None:
        while self.pending:
            try:
                self.backend.send_multipart(self.pending[0], zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self.pending.popleft()
            self.forwarded_up += 1

    def drain(self) -> int:
        """Forward what ranks queued before TERMINATE; bounded, never blocking on the uplink."""
        moved = 0
        end = time.monotonic() + DRAIN_MAX_S
        queue = deque(self.pending)
        self.pending.clear()
        if self.folder is not None:
            queue.extend(self.folder.release())
        while time.monotonic() < end:
            if not queue:
                if not self.frontend.poll(DRAIN_IDLE_MS, zmq.POLLIN):
                    break
                try:
                    queue.append(self.frontend.recv_multipart(zmq.NOBLOCK, copy=False))
                except zmq.Again:
                    break
            try:
                self.backend.send_multipart(queue[0], zmq.NOBLOCK, copy=False)
            except zmq.Again:
                if not self.backend.poll(DRAIN_IDLE_MS, zmq.POLLOUT):
                    break
                continue
            queue.popleft()
            moved += 1
        return moved

    def _log_once(self, key: str, fmt: str, *args, level: int = logging.WARNING) -> None:
        if key not in self._logged:
            self._logged.add(key)
            log.log(level, fmt, *args)


_STOP_SIGNALS = frozenset({signal.SIGTERM, signal.SIGINT})


def _signal_to_terminate(ctx: zmq.Context, heard: threading.Event, done: threading.Event) -> None:
    """Thread body: wait for SIGTERM/SIGINT (blocked everywhere), then say TERMINATE.

    The socket stays open until the loop has returned (``done``): closing an inproc
    PAIR right after a send can drop the still-unread message in libzmq 4.3.5, and the
    loop then never stops (observed with the proxy in about one run in three).
    """
    trigger = ctx.socket(zmq.PAIR)  # created, used and closed in this thread only
    trigger.connect(CONTROL_ADDR)
    try:
        sig = signal.sigwait(_STOP_SIGNALS)
        heard.set()
        if not done.is_set():
            log.info("%s: stopping", signal.Signals(sig).name)
            trigger.send(b"TERMINATE")
            done.wait()
    finally:
        trigger.close(linger=0)  # the loop is over: nothing left to deliver


def run_relay(
    coordinator: str, bind: str, host: str | None = None, *, fold: bool = True, out: TextIO = sys.stdout,
    curve=None, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, identity: str | None = None,
) -> int:
    """Serve until SIGTERM/SIGINT. Returns the exit code (0 clean, 1 cannot bind/connect).

    Call from the main thread (it changes the signal mask of this process's threads).
    ``curve`` (a ``flodl.curve.ClientKeys``) makes the backend a CURVE client; the
    frontend (ipc / loopback, this host's ranks) stays plaintext. ``max_message_bytes``:
    both sockets' ZeroMQ MAXMSGSIZE, per message part (``flodl.limits``; 0 = no limit).
    ``identity``: the backend's routing id (default ``relay_identity(host)``); an agent
    passes one that is fixed for its lifetime, so that the relay it restarts has the same
    route at the coordinator as the one that died (the ranks' routes stay valid).
    """
    host = host or socket.gethostname()
    # Before the context starts its I/O threads: every thread created later inherits it.
    old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
    ctx = zmq.Context()
    frontend = ctx.socket(zmq.ROUTER)
    backend = ctx.socket(zmq.DEALER)
    control = ctx.socket(zmq.PAIR)
    socks = (frontend, backend, control)
    waiter: threading.Thread | None = None
    heard, done = threading.Event(), threading.Event()
    try:
        for s in (frontend, backend):
            s.setsockopt(zmq.SNDHWM, HWM)
            s.setsockopt(zmq.RCVHWM, HWM)
            s.setsockopt(zmq.LINGER, LINGER_MS)
            s.setsockopt(zmq.MAXMSGSIZE, zmq_maxmsgsize(max_message_bytes))  # per part: one tensor
        frontend.setsockopt(zmq.LINGER, 0)  # frames for ranks are worthless once we stop
        identity = (identity or relay_identity(host)).encode()[:255]
        backend.setsockopt(zmq.IDENTITY, identity)  # before connect
        if curve is not None:  # flodl.curve.ClientKeys: the uplink is a CURVE client
            curve.apply(backend)
        try:
            frontend.bind(bind)
        except zmq.ZMQError as e:
            print(f"flodl relay: cannot bind {bind}: {e}", file=sys.stderr, flush=True)
            return 1
        try:
            backend.connect(coordinator)
        except zmq.ZMQError as e:
            print(f"flodl relay: cannot dial coordinator {coordinator}: {e}", file=sys.stderr, flush=True)
            return 1
        control.bind(CONTROL_ADDR)
        waiter = threading.Thread(
            target=_signal_to_terminate, args=(ctx, heard, done), name="relay-signals", daemon=True
        )
        waiter.start()
        endpoint = frontend.getsockopt_string(zmq.LAST_ENDPOINT)
        folder = None
        if fold:
            from .fold import Folder  # numpy: only now that SIGTERM/SIGINT are blocked

            folder = Folder(identity.decode(errors="replace"))
        loop = _Loop(frontend, backend, control, folder)
        print(f"{READY_PREFIX} {endpoint}", file=out, flush=True)
        log.info("relay for host %s: ranks at %s, coordinator at %s%s, folding %s",
                 host, endpoint, coordinator, " (CURVE)" if curve is not None else "", "on" if fold else "off")
        loop.run()
        done.set()
        moved = loop.drain()
        if folder is not None:
            log.info("relay stopped: %d fold(s) sent for %d rank round(s); forwarded %d queued frame(s) on the way out",
                     folder.folds_sent, folder.ranks_folded, moved)
        else:
            log.info("relay stopped (forwarded %d queued frame(s) on the way out)", moved)
        return 0
    finally:
        done.set()
        if waiter is not None and not heard.is_set():
            # If the loop ended without a signal (an error), the waiter still sits in
            # sigwait: wake it, so that its socket is closed before ctx.term().
            signal.pthread_kill(waiter.ident, signal.SIGTERM)
        if waiter is not None:
            waiter.join(5)
        for s in socks:
            s.close()
        ctx.term()  # bounded by LINGER_MS
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
