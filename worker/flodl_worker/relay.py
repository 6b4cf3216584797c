"""flodl_worker.relay: the per-host relay, a steerable ZeroMQ proxy.

    flodl-worker relay --coordinator tcp://HEAD:5555 --bind ipc:///run/flodl/relay.sock

Theory of operation
-------------------
The relay decides nothing yet, so it is libzmq's ``zmq_proxy_steerable`` (STYLE §3.10,
"Examples to follow" 11): forwarding happens in C, on one thread.

- frontend ROUTER (bind, loopback or ipc) for this host's ranks. A rank's
  ``[b"", envelope, blobs...]`` arrives as ``[rank_id, b"", ...]``;
- backend DEALER (connect, identity ``relay-<host>-<pid>``) to the coordinator, whose
  ROUTER therefore sees ``[relay_id, rank_id, b"", ...]``, and whose reply
  ``[relay_id, rank_id, b"", ...]`` comes back here as ``[rank_id, b"", ...]`` and is
  routed to that rank.
- The frontend does NOT set ROUTER_MANDATORY: inside ``zmq_proxy`` a send to a rank that
  has gone would make the whole proxy fail, and one dead rank would take its host down.
  Without it libzmq drops the frame; the coordinator learns of the death from the agent
  (``agent.rank_exited``) or from silence.
- A PAIR/inproc control socket steers the proxy. SIGTERM/SIGINT only become a
  TERMINATE written into it; the proxy reads the command and returns. Then whatever
  ranks already queued in the frontend is forwarded (bounded), the backend flushes with
  a bounded linger, exit 0.

  Why not a Python signal handler: it runs only when the interpreter gets control back.
  A signal that lands while the C proxy is busy forwarding (not blocked in poll, so no
  EINTR) just sets a flag, and the proxy then blocks forever with TERMINATE never sent
  (observed: about one SIGTERM in five lost). So the main thread *blocks* SIGTERM and
  SIGINT before any other thread exists, and a small thread collects them with
  ``signal.sigwait`` (race-free: a blocked signal stays pending until collected) and
  writes TERMINATE from its own PAIR socket, which it keeps open until the proxy has
  returned (see ``_signal_to_terminate``).

On start, the bound endpoint (port 0 resolved) is printed on stdout as one line
``RELAY_READY <endpoint>``, so a parent can read it. Nothing else goes to stdout.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import threading
import time
from typing import TextIO

import zmq

__all__ = ["run_relay", "relay_identity", "READY_PREFIX"]

log = logging.getLogger("flodl.relay")

READY_PREFIX = "RELAY_READY"
CONTROL_ADDR = "inproc://flodl-relay-control"

# High-water marks, in messages (libzmq bounds counts, not bytes).
# - Rank -> coordinator (frontend RCVHWM, backend SNDHWM): timing frames are ~100 B, one
#   per step per rank; rounds are one per rank per cycle. 10k messages is minutes of
#   backlog. When the uplink stalls, the backend blocks the proxy, the frontend stops
#   reading, and each rank's own bounded queue pushes back: backpressure, never an
#   unbounded relay queue (reference hazard 5).
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


def relay_identity(host: str) -> bytes:
    # ZeroMQ identities are 1..255 bytes and must not start with a zero byte.
    return f"relay-{host}-{os.getpid()}".encode()[:255]


def _drain(frontend: zmq.Socket, backend: zmq.Socket) -> int:
    """Forward what ranks queued before TERMINATE; bounded, never blocking on the uplink."""
    moved = 0
    end = time.monotonic() + DRAIN_MAX_S
    while time.monotonic() < end and frontend.poll(DRAIN_IDLE_MS, zmq.POLLIN):
        try:
            msg = frontend.recv_multipart(zmq.NOBLOCK, copy=False)
            backend.send_multipart(msg, zmq.NOBLOCK, copy=False)
            moved += 1
        except zmq.Again:
            break
    return moved


_STOP_SIGNALS = frozenset({signal.SIGTERM, signal.SIGINT})


def _signal_to_terminate(ctx: zmq.Context, heard: threading.Event, done: threading.Event) -> None:
    """Thread body: wait for SIGTERM/SIGINT (blocked everywhere), then say TERMINATE.

    The socket stays open until the proxy has returned (``done``): closing an inproc
    PAIR right after a send can drop the still-unread message in libzmq 4.3.5, and the
    proxy then never stops (observed in about one run in three).
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
        trigger.close(linger=0)  # the proxy is over: nothing left to deliver


def run_relay(coordinator: str, bind: str, host: str | None = None, *, out: TextIO = sys.stdout) -> int:
    """Serve until SIGTERM/SIGINT. Returns the exit code (0 clean, 1 cannot bind/connect).

    Call from the main thread (it changes the signal mask of this process's threads).
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
        frontend.setsockopt(zmq.LINGER, 0)  # frames for ranks are worthless once we stop
        backend.setsockopt(zmq.IDENTITY, relay_identity(host))  # before connect
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
        print(f"{READY_PREFIX} {endpoint}", file=out, flush=True)
        log.info("relay for host %s: ranks at %s, coordinator at %s", host, endpoint, coordinator)
        zmq.proxy_steerable(frontend, backend, None, control)
        done.set()
        moved = _drain(frontend, backend)
        log.info("relay stopped (forwarded %d queued frame(s) on the way out)", moved)
        return 0
    finally:
        done.set()
        if waiter is not None and not heard.is_set():
            # If the proxy ended without a signal (an error), the waiter still sits in
            # sigwait: wake it, so that its socket is closed before ctx.term().
            signal.pthread_kill(waiter.ident, signal.SIGTERM)
        if waiter is not None:
            waiter.join(5)
        for s in socks:
            s.close()
        ctx.term()  # bounded by LINGER_MS
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
