"""The coordinator service: one ROUTER socket, one loop, the core in the middle.

Theory of operation
-------------------
One thread owns every socket. Each pass polls the ROUTER and a signal wake-up fd with
a timeout equal to the time left until the next tick, then:

1. drains what arrived: split route | envelope | blobs, decode (version, session,
   sequence), check the route owns the rank it claims, and translate into one core
   event — or drop the frame, count it under its reason and log the first of each
   reason, then at most a summary line a minute per reason (``droplog``);
2. journals the event (JSON lines) and runs ``step(state, event)``;
3. executes the commands in order: ``Send`` encodes a Control for the rank's route
   (ROUTER_MANDATORY: an unroutable peer raises, and the core hears ``SendFailed``),
   ``OpenRound``/``ForgetRank`` drive the bus reducer, ``RunFinished`` ends the loop;
4. feeds a ``Tick`` whenever one is due, whether or not traffic arrived (timers that
   only run on traffic stop exactly when they are needed).

Data-plane ``round`` frames go to the reducer, not the core: tensors are never
journaled. The reducer's completed consensus is sent straight back to contributors.

Restart (``recovery``): started on a journal that holds an unfinished run, the service
rebuilds the core state by replay, binds the run's endpoint, and feeds
``CoordinatorRestarted``; its random ``Endpoint`` incarnation tells every rank that it
restarted (each answers ``timing.resync``). Until a peer reconnects, frames for it wait
in ``HeldSends`` instead of failing as unroutable.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import secrets
import signal
import socket
import threading
import time
from collections import Counter, deque
from contextlib import contextmanager
from typing import Callable

import zmq

from flodl.core import (
    LEFT,
    MAX_EXIT_LINE_CHARS,
    MAX_EXIT_LINES,
    UNPLACED,
    hello_event,
    hello_oversized,
    chunk_events,
    timing_event,
    ContributionRefused,
    CoordinatorRestarted,
    ForgetRank,
    LastWord,
    Notice,
    StageCheckpoint,
    OpenRound,
    RankExitReported,
    RankViolation,
    Reply,
    RunFinished,
    SeedJoiner,
    Send,
    RankRefused,
    SendFailed,
    StopRequested,
    Tick,
    initial_state,
    step,
    to_record,
)
from flodl.fsutil import describe_write_error
from flodl.procutil import process_age_s
from flodl.limits import zmq_maxmsgsize
from flodl.wire import (
    MIN_RANK_MINOR,
    PROTOCOL_MAJOR,
    PROTOCOL_MINOR,
    Endpoint,
    MalformedFrame,
    Oversized,
    RouteMismatch,
    SeqTracker,
    VersionMismatch,
    WireError,
    WrongSession,
    decode,
    pb,
    split_routing,
)

from flodl import sdnotify, strictjson

from . import dashboard, recovery
from .agents import MAX_TOKEN_BYTES, AgentBook, token_digest
from .checkpointing import Checkpointing
from .curve import CurveServer, load_server_keys
from .droplog import DropLog
from .inbound import recv_frames as _recv_frames, recv_routed
from .journal import Journal, JournalError
from .gcsettle import CollectorSettle
from .loopmeter import LoopMeter
from .noticelog import log_notice
from .metrics import RunBook, journal_stats
from .output import ModelOutput
from .reducer import BusReducer, RoundRefused
from .runmarks import RunMarks
from .settings import Settings, SettingsError
from .status import StatusBoard
from .timeline import FINAL_PAGE_SPANS, Timeline

__all__ = ["CoordinatorService"]

_KIND_RANK = pb.Sender.KIND_RANK

log = logging.getLogger("flodl.coordinator")
decisions = logging.getLogger("flodl.decisions")

# High-water marks, in messages. Control frames are small and a rank sends one per
# step: 10k messages is minutes of backlog for a stuck peer before we refuse to queue
# more (EAGAIN -> SendFailed), instead of growing without bound.
SNDHWM = 10_000
RCVHWM = 10_000
# On close, give queued Shutdown/consensus frames this long to leave (ms).
LINGER_MS = 2_000
# A relay whose link drops is waited for this long before its ranks are unroutable, unless
# its agent says it is restarting it (then until it says "ready"): long enough for the
# agent's notice, short enough that a host that is gone costs little more than before.
RELAY_GRACE_S = 3.0
# /status and /metrics are rebuilt at most this often, and at most 1/PUBLISH_COST_SHARE of
# the loop's time goes to them (_publish_status).
PUBLISH_MIN_S = 0.25
PUBLISH_COST_SHARE = 20
# What a frame that stepped no core event carried, as the loop meter names it (a round's
# tensors, a relay's or an agent's message, a dropped frame).
NO_EVENT = "no core event"
# How many frames one pass drains before it runs timers again (fairness bound).
DRAIN_BATCH = 256


def _too_old(env) -> str:
    """Why a rank of ``env``'s protocol minor is refused, and the fix."""
    return (f"rank speaks protocol {env.protocol_major}.{env.protocol_minor}; this coordinator "
            f"({PROTOCOL_MAJOR}.{PROTOCOL_MINOR}) needs {PROTOCOL_MAJOR}.{MIN_RANK_MINOR} or later (a round's "
            "RequestParams carries the rank's next window): install the same flodl release on every host")  # fmt: skip


class CoordinatorService:
    def __init__(
        self,
        settings: Settings,
        *,
        clock: Callable[[], float] = time.monotonic,
        ready: Callable[[str], None] | None = None,
    ) -> None:
        # First: a bad --resume or checkpoint_dir is refused before anything starts.
        self.checkpointing = Checkpointing(settings)
        settings = self.checkpointing.pinned(settings)
        self.output = ModelOutput(settings)  # an unwritable output dir: SettingsError, now
        self.settings = settings
        self.clock = clock
        self._ready = ready or self._announce
        self.config = settings.core_config()
        self.curve_keys = load_server_keys(settings)  # None: no CURVE; a bad key file: SettingsError
        # An unfinished run in the journal is rebuilt by replay (``recovery``); else a fresh one.
        self.timeline = Timeline(self.config.world_size, self.config.num_epochs)  # the dashboard's lanes
        self.recovered = recovery.recover(settings, self.checkpointing, observe=self.timeline.observe)
        if self.recovered is None:  # (a finished run's journal moved aside: its timeline goes with it)
            self.timeline = Timeline(self.config.world_size, self.config.num_epochs)
        self.state = self.recovered.state if self.recovered else initial_state(self.config, self.checkpointing.point)
        self.clock = recovery.continuing(clock, self.recovered)
        self.held = recovery.HeldSends(self.recovered.hops()) if self.recovered else None
        # A random incarnation per process: the ranks tell a restarted coordinator by it.
        self.endpoint = self._new_endpoint()
        self.reducer = BusReducer(
            bf16_wire=settings.bf16_wire,
            outer=self.checkpointing.outer,
            gamma=self.config.gamma,  # weights are the coordinator's: n**gamma of the steps it saw
            steps_seen=lambda r: self.state.unfolded(r) if 0 <= r < len(self.state.ranks) else 0,
            max_contribution_ratio=settings.max_contribution_ratio,
        )
        self.seq = SeqTracker()
        self.dropped: Counter[str] = Counter()
        self._drop_log = DropLog(log)  # first of each reason, then a summary a minute
        self._pending: deque = deque()  # internal events produced while executing commands
        # Which agent may report which rank's exit: only the one the rank itself named (agents).
        self.agents = AgentBook(self.config.world_size)
        self.agent_errors: list[str] = []  # agents that gave their host up, and why (summary)
        self.relay_restarts: list[dict] = []  # relays restarted by their agent (summary)
        self._links_down: dict[bytes, dict] = {}  # relay hop -> its relay_restarts row, while down
        self._send_errno = 0  # of the last failed send (EHOSTUNREACH: the peer is gone)
        for record in self.recovered.agent_records if self.recovered else ():
            self.agents.restore(record)
        self._peer_key = ""  # the CURVE client key (ZAP User-Id) of the frame being handled
        self.finished: RunFinished | None = None
        self.exit_code: int | None = None  # what ``run`` returned, once it has (``start_thread``)
        self._pending_seeds: list[int] = []  # joiners waiting for a consensus this process has not seen yet
        self._hello_logs = {  # refused / deferred hellos, rate-limited per kind of reason
            "refused": DropLog(log, first="hello refused (from %s)", more="%d more hellos refused for %r in the last %.0fs (last from %s)"),
            "deferred": DropLog(log, level=logging.INFO, first="hello deferred (from %s)",
                                more="%d more hellos deferred for %r in the last %.0fs (last from %s)"),
        }  # fmt: skip
        # When the run's first batch came and when it finished, in seconds since this
        # process started (the launcher's start-up and teardown times, in the summary).
        self._born = time.monotonic() - process_age_s()
        self.marks = RunMarks(self._born)  # the summary's timeline_s (runmarks.py)
        self._finished_at: float | None = None
        # /metrics' own book (flodl_coordinator.metrics); this process is restart N+1 of a recovered run.
        restarts = self.recovered.restarts + 1 if self.recovered else 0
        book = RunBook(settings.session, settings.metrics_rank_labels, coordinator_restarts=restarts)
        self.status = StatusBoard(book)
        if self.recovered:
            book.members_known(self.state)
        self.status.timeline = self.timeline
        self._stop_event = threading.Event()  # ends the status linger after the run (request_stop)
        self._status_stale = True
        self._next_publish = 0.0  # time.monotonic() before which /status is not rebuilt (_publish_status)
        self._events_stepped = 0
        self._journal = _open_journal(settings.journal) if settings.journal else None
        self._journal_error: str | None = None  # set once the journal cannot be written: the run stops
        self._outbox: list | None = None  # frames held until the journal is durable (``_pass``)
        self.loop_meter = LoopMeter()  # per-frame handling time and the loop's busy share (/metrics, summary)
        # Collections at moments the loop picks (gcsettle): only as the process's own service
        # (the main thread) -- gc.freeze is process-wide, not a guest's to call for its host.
        self.gc = CollectorSettle()
        self._gc_settling = False
        self._last_event = NO_EVENT  # the kind of the event this frame stepped last (LoopMeter.slowest)
        self._opened_round = False  # this frame's step opened an averaging round (LoopMeter: a round's trigger)
        self._stop_signals = 0
        # Wakes the loop from outside it (signal handler, tests) without touching a socket.
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._publish_status(force=True)  # /status is a whole document from its first request on

    # -- lifecycle ---------------------------------------------------------------

    def _announce(self, ep: str) -> None:
        """The ready line on stdout; with ``http``, the bound status address as a third token."""
        h = self.status.http_address
        print(f"COORDINATOR_READY {ep}" + (f" http={h[0]}:{h[1]}" if h else ""), flush=True)

    def request_stop(self) -> None:
        """Ask the loop to stop gracefully (safe from a signal handler or another thread)."""
        self._stop_signals += 1
        self._stop_event.set()
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass

    def start_thread(self, *, ready_timeout_s: float = 10.0):
        """Run the loop in a daemon thread (no signal handlers); return (endpoint, thread).

        For embedding and tests: the thread owns the sockets; stop it with ``request_stop``.
        Once the thread has ended, ``exit_code`` is what ``run`` returned.
        """
        ready = threading.Event()
        box: dict = {}

        def on_ready(ep: str) -> None:
            box["ep"] = ep
            ready.set()

        self._ready = on_ready
        def serve() -> None:
            self.exit_code = self.run(install_signals=False)

        t = threading.Thread(target=serve, name="flodl-coordinator", daemon=True)
        t.start()
        if not ready.wait(ready_timeout_s):
            raise RuntimeError(f"coordinator did not bind within {ready_timeout_s:g}s")
        return box["ep"], t

    def run(self, *, install_signals: bool = True) -> int:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        # A restarted relay reconnects with its old routing id. Without handover, libzmq
        # ignores a connection whose id is still held by a pipe it has not torn down yet
        # -- for good: the new relay was never heard again, and its ranks starved, when
        # this thread was stalled across the old relay's death and the new one's connect.
        # Handover gives the id to the newest connection. What keeps a remote peer from
        # taking a route over is that it cannot name it: relay, agent and rank ids carry
        # 64 random bits (``flodl_worker.relay.relay_identity``, the agent's, the rank's);
        # an agent's reports are also bound to its CURVE key (``route_mismatch``).
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        sock.setsockopt(zmq.SNDHWM, SNDHWM)
        sock.setsockopt(zmq.RCVHWM, RCVHWM)
        sock.setsockopt(zmq.LINGER, LINGER_MS)
        # Per message part (one tensor): a bigger one disconnects its peer (flodl.limits).
        sock.setsockopt(zmq.MAXMSGSIZE, zmq_maxmsgsize(self.settings.max_message_bytes))
        # CURVE: the ZAP handler runs in its own thread with its own socket (flodl_coordinator.curve).
        curve = CurveServer(ctx, self.curve_keys) if self.curve_keys is not None else None
        if curve is not None:
            curve.secure(sock)
        else:
            self._warn_if_insecure()
        http = self._bind(ctx, sock, curve)  # a busy or bad address: BindError (one line, exit 2)
        self.sock = sock
        ep = sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        wake_r = self._wake_r
        sigs = (signal.SIGTERM, signal.SIGINT) if install_signals else ()
        old = {s: signal.signal(s, self._on_signal()) for s in sigs}
        start = {"type": "_start", "settings": _settings_record(self.settings), "endpoint": ep}
        if self.checkpointing.resumed is not None:  # replay must resume from the same point
            start["resume_meta"] = self.checkpointing.resumed.meta
        if self.recovered is not None:
            start = self.recovered.restart_record(ep, self.endpoint.sender.incarnation)
        self._journal_write(start)
        if self._journal_error is not None:  # e.g. a full disk at start: stop before deciding anything
            self.finished = RunFinished(False, self._journal_error, {})
        self._ready(ep)
        sdnotify.notify("READY=1", f"STATUS=serving {ep}")  # Type=notify units (no-op elsewhere)
        if threading.current_thread() is threading.main_thread():
            self.gc.install()
            self._gc_settling = True
        if self.recovered is not None and self.finished is None:  # the ranks resync when they hear the new incarnation
            for meta in self.recovered.pending_metas:
                self.checkpointing.stage(meta)
            self._feed(CoordinatorRestarted(now=self.clock(), incarnation=self.endpoint.sender.incarnation))
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(wake_r.fileno(), zmq.POLLIN)
        next_tick = self.clock()
        try:
            return self._loop(poller, sock, wake_r, next_tick, http, curve, ctx)
        finally:
            self.gc.uninstall()
            sdnotify.notify("STOPPING=1")
            for s, h in old.items():
                signal.signal(s, h)
            if http is not None:  # served until here: through the status linger (_linger)
                http.shutdown()
                http.server_close()

    def _loop(self, poller, sock, wake_r, next_tick, http, curve, ctx) -> int:
        try:
            # A second stop request does not wait for the ranks (as a second SIGTERM ends the
            # process): the run ends unfinished, exit 1.
            while (self.finished is None or self.checkpointing.lingering(self.clock())) and self._stop_signals < 2:
                timeout_ms = max(0.0, (next_tick - self.clock()) * 1000.0)
                events = dict(poller.poll(timeout_ms))
                if wake_r.fileno() in events:
                    self._drain_wake(wake_r)
                if sock in events:
                    t0 = time.perf_counter()
                    self._drain_socket()
                    self.loop_meter.busy(time.perf_counter() - t0)
                if self.clock() >= next_tick:
                    t0 = time.perf_counter()
                    if self.held:
                        self.held.retry(self._send_held)
                        self._links_back(self.clock())
                    if self._links_down:
                        self._links_expired(self.clock())
                    self._feed(Tick(now=self.clock()))
                    self.marks.watch_commits(self.state, time.monotonic())
                    self._publish_status()
                    for dl in (self._drop_log, *self._hello_logs.values()):
                        dl.flush(self.clock())
                    next_tick = self.clock() + self.settings.tick_interval_s
                    self.loop_meter.busy(time.perf_counter() - t0)
            self._tell_agents_run_ended()
        finally:
            for dl in (self._drop_log, *self._hello_logs.values()):
                dl.close(self.clock())
            sock.close(linger=LINGER_MS)
            if curve is not None:
                curve.stop()  # closes the ZAP socket before the context terminates
            ctx.term()
            wake_r.close()
            self._wake_w.close()
            if self._journal:
                self._journal.close()
        rc = self._finish()
        self._linger(http)
        return rc

    def _linger(self, http) -> None:
        """The run is over; its final status and dashboard stay served ``status_linger_s``
        (an operator or a script reads how it ended) unless a stop signal comes first."""
        wait = self.settings.status_linger_s
        if http is None or wait <= 0 or self._stop_event.is_set():
            return
        sdnotify.notify(f"STATUS=run finished; serving its final status for {wait:g}s")
        log.info("run over: serving the final /status and dashboard on %s:%s for %gs (SIGTERM ends it)",
                 *self.status.http_address, wait)
        self._stop_event.wait(wait)

    def _bind(self, ctx, sock, curve):
        """Bind the ROUTER, then the HTTP status port (returned, or None). Either failing
        (a port another process holds, an address this host lacks) is a ``BindError``
        naming the address and the fix, with everything opened so far closed again."""
        addr = recovery.bind_address(self.settings, self.recovered)
        try:
            try:
                sock.bind(addr)
            except zmq.ZMQError as e:
                raise BindError(_bind_problem(f"bind {addr}", e, "bind")) from None
            if not self.settings.http:
                return None
            try:
                return self.status.serve(self.settings.http)
            except (OSError, ValueError, OverflowError) as e:
                raise BindError(_bind_problem(f"serve http on {self.settings.http}", e, "http")) from None
        except BindError:
            sock.close(linger=0)
            if curve is not None:
                curve.stop()
            ctx.term()
            self._wake_r.close()
            self._wake_w.close()
            if self._journal:
                self._journal.close()
            raise

    def _on_signal(self):
        def handler(signum, _frame):
            # Only note it and wake the loop; the loop owns the sockets.
            self.request_stop()
            if self._stop_signals >= 2:
                raise SystemExit(130)

        return handler

    def _drain_wake(self, wake_r) -> None:
        try:
            while wake_r.recv(64):
                pass
        except (BlockingIOError, OSError):
            pass
        if self._stop_signals >= 2:
            log.warning("stop requested again: stopping now, without waiting for the ranks to acknowledge")
        elif self._stop_signals:
            log.warning("stop requested by signal; asking ranks to shut down")
            self._feed(StopRequested(now=self.clock(), reason="signal"))

    def _warn_if_insecure(self) -> None:
        b = self.settings.bind
        loopback = b.startswith(("ipc://", "inproc://")) or any(
            h in b for h in ("127.0.0.1", "localhost", "[::1]")
        )
        if not loopback:
            log.warning(
                "SECURITY: binding %s without CURVE keys: any host that can reach this port can "
                "join or disturb the run. Bind to loopback or a private network, or turn CURVE on "
                "(curve_secret_key + curve_allowed_keys; see flodl-coordinator keygen).",
                b,
            )

    def _write_final_view(self) -> None:
        """The last /status and the dashboard with its data, beside the summary (or where
        asked): the run stays readable after the process is gone. A file that cannot be
        written is named in the log; the run's outcome stands."""
        status_path, page_path = dashboard.final_paths(self.settings)
        status = self.status.snapshot()
        for path, text in ((status_path, lambda: strictjson.dumps(status, indent=2, sort_keys=True, default=str)),
                           (page_path, lambda: dashboard.page({"status": status, "timeline": self.timeline.snapshot(FINAL_PAGE_SPANS)}))):
            if not path:
                continue
            try:
                dashboard.write_final(path, text())
            except OSError as e:
                log.error("%s", describe_write_error(e, path, "dashboard_out" if path == page_path else "status_out"))
            except Exception as e:  # a view that cannot be built must not cost the summary written after it
                log.error("cannot build %s: %s: %s", path, type(e).__name__, e)
            else:
                log.info("wrote %s", path)

    def _finish(self) -> int:
        self._publish_status(force=True)  # the end of the run is visible too
        f = self.finished
        if f is None:
            return 1
        summary = dict(f.summary)
        ok, reason = f.ok, f.reason
        if self._journal_error is not None and self._journal_error not in reason:
            ok, reason = False, f"{reason}; {self._journal_error}" if reason else self._journal_error
        missing = self.checkpointing.missing(self.state)
        if missing:  # an asked checkpoint that was not made is a failed run, never a quiet one
            ok, why = False, self.checkpointing.missing_reason(missing)
            reason = why if not f.ok or reason == "completed" else f"{reason}; {why}"
            log.error("%s", why)
        summary["model"], why = self.output.finish(summary, ok)
        if why:  # a completed run that lost its output model is not ok, and says why
            ok, reason = False, f"{reason}; {why}"
            log.error("%s", why)
        summary.update(ok=ok, reason=reason, dropped_frames=dict(self.dropped))
        summary["checkpoints"] = self.checkpointing.summary(self.state)
        if self.agent_errors:
            summary["agent_errors"] = list(self.agent_errors)
        if self.relay_restarts:
            summary["relay_restarts"] = list(self.relay_restarts)
        if self._finished_at is not None:
            self.marks.mark("run_finished", self._finished_at)
        summary["timeline_s"] = self.marks.timeline()
        summary["coordinator_loop"] = self.loop_meter.summary()
        if self._gc_settling:
            summary["coordinator_loop"].update(self.gc.stats())
        log.info("%s", self.marks.describe())
        summary.setdefault("bus", {})
        summary["bus"].update(
            rounds=self.reducer.rounds_completed, bytes_in=self.reducer.bytes_in, bytes_out=self.reducer.bytes_out
        )
        if self.reducer.seeds_sent:  # joiners seeded with the latest consensus
            summary["bus"].update(seeds_sent=self.reducer.seeds_sent, seed_bytes=self.reducer.seed_bytes)
        # The final status and page go first: whoever waits for the summary (the run's
        # last word) finds them already there.
        self._write_final_view()
        if self.settings.summary:
            tmp = self.settings.summary + ".tmp"
            try:
                with open(tmp, "w", encoding="utf-8") as fh:
                    fh.write(strictjson.dumps(summary, indent=2, sort_keys=True))  # never bare NaN
                os.replace(tmp, self.settings.summary)
            except OSError as e:  # e.g. on the same full disk as the journal: say so, still exit
                log.error("cannot write the summary: %s", describe_write_error(e, self.settings.summary, "summary"))
        log.info("run finished: ok=%s reason=%s", ok, reason)
        sdnotify.notify(f"STATUS=run finished: ok={ok} reason={reason}"[:400])
        if self._journal_error is not None:
            return 2  # not restarted by systemd: a restart could not recover what was not journaled
        return 0 if ok else 1

    # -- inbound -----------------------------------------------------------------

    def _drain_socket(self) -> None:
        # CURVE: the ZAP User-Id is read off a received Frame, so every part stays one.
        curve = self.curve_keys is not None
        sock, on_routed, clock, meter = self.sock, self._on_routed, time.perf_counter, self.loop_meter
        with self._pass():  # one fsync for what this batch of frames decided (journal.py)
            for _ in range(DRAIN_BATCH):
                try:
                    if curve:
                        frames = _recv_frames(sock)
                    else:  # split as it is received; a split it is unsure of comes back whole
                        route, payload = recv_routed(sock)
                except zmq.Again:
                    return
                t0 = clock()
                self._last_event = NO_EVENT  # (until the core steps one for this frame)
                self._opened_round = False  # (until its step opens a round)
                if curve or route is None:
                    self._on_frames(payload if not curve else frames)
                else:
                    on_routed(route, payload)
                if self._opened_round:  # a round's RequestParams leave now, not behind the pass's other frames
                    self._send_decided()
                dt = clock() - t0  # (other frames' commands go out at the pass's end, together)
                if dt > meter.frame_max_s:  # the operator's first question about a slow frame: what was it
                    meter.slowest = self._last_event
                meter.frame(dt, opened_round=self._opened_round)
                if self.finished is not None:
                    return

    def _on_frames(self, frames) -> None:
        try:
            route, payload = split_routing(frames)
        except WireError as e:
            return self._drop((), e)
        self._peer_key = _user_id(frames[-1]) if self.curve_keys is not None else ""
        self._on_routed(route, payload)

    def _on_routed(self, route: tuple, payload: list) -> None:
        """One message, split at its delimiter (``route``: a tuple of bytes)."""
        now = self.clock()
        if self.held and route:
            self.held.heard(route[0], self._send_held)  # a peer back after a restart (not while paused)
            self._links_back(now)
        try:
            d = decode(payload, session=self.settings.session)
        except VersionMismatch as e:
            return self._refuse_version(route, payload, e)
        except WrongSession as e:
            return self._refuse_session(route, payload, e)
        except WireError as e:
            return self._drop(route, e)
        env = d.envelope
        try:
            # Checked per (route, sender) and recorded only once the frame has passed the
            # route checks: a foreign route claiming a rank's incarnation with seq 2**63
            # must not make the real rank's next frames "out of sequence".
            key = self.seq.verify(env, route)
            self._dispatch(now, route, d)
        except WireError as e:
            return self._drop(route, e)
        sender = env.sender
        if sender.kind != _KIND_RANK or tuple(self.state.route_of(sender.rank) or ()) == route:
            self.seq.accept(env, route, key=key)  # (a refused hello or a gone rank's frame records nothing)

    def _dispatch(self, now: float, route: tuple, d) -> None:
        env = d.envelope
        kind = env.WhichOneof("body")  # (decode refused a frame without one)
        if env.protocol_minor < MIN_RANK_MINOR and kind != "hello" and env.sender.kind == _KIND_RANK:
            raise self._refuse_old_rank(now, route, env, kind)
        if kind == "timing":  # the hot path: every batch a rank trains (order of the checks below kept)
            t = env.timing
            rank = self._owned_rank(route, env, kind, t.rank)
            if t.HasField("time_account"):  # goodput / badput by cause (/metrics)
                self.status.book.time_account(rank, env.sender.incarnation, t.time_account)
            event = t.WhichOneof("event")
            if event == "batch" or event == "batches":  # (one batch, or several to a frame)
                self.marks.batch(time.monotonic())
            elif event == "checkpoint_result":
                self.checkpointing.on_result(rank, t.checkpoint_result)
            elif event == "eval_result":
                self.output.on_eval_result(rank, t.eval_result)
            return self._feed(timing_event(now, t))
        if kind == "hello":
            if env.sender.kind != pb.Sender.KIND_RANK or env.sender.rank != env.hello.rank:
                raise RouteMismatch("hello's sender is not the rank it names")
            if env.protocol_minor < MIN_RANK_MINOR:  # (the major was checked by decode)
                why = _too_old(env)
                self._send_frames(self.endpoint.frames("hello_ack", pb.HelloAck(accepted=False, reason=why), route=route))
                if tuple(self.state.route_of(env.hello.rank) or ()) == route:  # a member's hello again (after a restart)
                    self._refuse_member(now, env.hello.rank, why)
                raise VersionMismatch(why)
            why = hello_oversized(env.hello)
            if why:  # never journaled: refused with the reason, then dropped and counted
                ack = pb.HelloAck(accepted=False, reason=why)
                self._send_frames(self.endpoint.frames("hello_ack", ack, route=route))
                raise Oversized(why)
            unpinned = env.hello.HasField("unpinned_slot")  # the core picks its slot
            agent = token_digest(bytes(env.hello.agent_token[:MAX_TOKEN_BYTES])) if unpinned else ""
            self._feed(hello_event(now, route, env, agent=agent))
            rank = self.state.admitted_on(route, env.sender.incarnation) if unpinned else env.hello.rank
            if rank is not None and tuple(self.state.route_of(rank) or ()) == route:  # admitted: whom it vouches for
                record = self.agents.rank_admitted(rank, env.hello.agent_token)
                if record is not None:
                    self._journal_write(record)  # a restart still knows (recovery)
            return
        if kind == "agent":
            return self._on_agent(now, route, env)
        if kind == "relay":
            log.info("relay %s says %s", env.sender.host, env.relay.WhichOneof("msg"))
            return
        if kind == "round" and env.sender.kind == pb.Sender.KIND_RELAY:
            # A relay's folded round: the relay is a route of one hop (its own DEALER).
            if len(route) != 1:
                raise RouteMismatch("a folded round must come from a relay's own route")
            if env.round.HasField("relay_stats"):  # the relay's fold / fan-out counters (/metrics)
                self.status.book.relay_stats(env.sender.host, env.sender.incarnation, env.round.relay_stats)
            return self._on_round(None, env.round, d.blobs, relay=route)
        if kind == "metrics":
            rank = self._owned_rank(route, env, kind)
            m = env.metrics
            if m.HasField("time_account"):  # (a Metrics that carries batches may be the heartbeat)
                self.status.book.time_account(rank, env.sender.incarnation, m.time_account)
            if m.batches:  # its chunk's last batches ride in it (protocol 1.3)
                self.marks.batch(time.monotonic())
            for ev in chunk_events(now, m):
                self._feed(ev)
            return
        if kind == "round":
            return self._on_round(self._owned_rank(route, env, kind), env.round, d.blobs)
        raise MalformedFrame(f"a coordinator does not accept {kind!r} frames")

    def _refuse_old_rank(self, now: float, route: tuple, env, kind: str) -> VersionMismatch:
        """A member's frame in a protocol minor this coordinator no longer admits: a
        coordinator restarted from its journal as a newer release finds ranks of the old
        one (its hello was checked by the process before). Such a rank would drop what it
        cannot read (a window riding in a RequestParams) and its samples with it: the core
        tells it to stop and hands its work to the others; the frame is dropped (counted
        ``version_mismatch``) and the run ends not ok, naming it. Returns the error to raise."""
        why = _too_old(env)
        # Its route must own it (a forged frame cannot get a real rank refused); once the
        # core has forgotten it, its next frames are refused there (route_mismatch).
        self._refuse_member(now, self._owned_rank(route, env, kind), why)
        return VersionMismatch(why)

    def _refuse_member(self, now: float, rank: int, why: str) -> None:
        log.error("rank %d refused: %s", rank, why)
        self._feed(RankRefused(now=now, rank=rank, reason=why))  # (the core tells it: a LastWord)

    def _owned_rank(self, route: tuple, env, kind: str, body_rank: int | None = None) -> int:
        """The rank a timing/metrics/round frame speaks for, if its route owns it (else
        RouteMismatch). ``body_rank``: the body's own rank field, when the caller read it."""
        sender = env.sender
        if sender.kind != _KIND_RANK:
            raise RouteMismatch(f"{kind} frame from a non-rank sender")
        rank = sender.rank
        if body_rank is None:
            body_rank = getattr(getattr(env, kind), "rank", rank)
        if body_rank != rank:
            raise RouteMismatch(f"sender is rank {rank} but the body claims rank {body_rank}")
        owner = self.state.route_of(rank)
        if owner is None:
            raise RouteMismatch(f"rank {rank} is not admitted")
        if tuple(owner) != route:
            raise RouteMismatch(f"rank {rank} is admitted on another route")
        return rank

    def _on_agent(self, now: float, route: tuple, env) -> None:
        if env.sender.kind != pb.Sender.KIND_AGENT:
            raise RouteMismatch("agent frame from a non-agent sender")
        msg = env.agent
        which = msg.WhichOneof("msg")
        if which == "hello":
            # A rank the run no longer holds (dead, left) may be claimed by a new host.
            record, note = self.agents.hello(route, msg.hello, self._peer_key, set(self.state.addressable_ranks()))
            if record is None:
                self._answer_agent(route, False, note)
                raise RouteMismatch(note)
            self._answer_agent(route, True, note)
            self._journal_write(record)  # a restart needs it
            if note:
                log.warning("%s", note)
            log.info("agent on %s supervises ranks %s", msg.hello.host, record["ranks"])
        elif which == "rank_exited":
            event = self._exit_report(now, route, msg.rank_exited)
            if event is not None:
                self._feed(event)
        elif which == "relay_restarting":
            self._on_relay_restarting(now, route, msg.relay_restarting)
        elif which == "abort":  # the agent gives its host up (its relay died), before its ranks' exits
            if route not in self.agents.agent_ranks:
                raise RouteMismatch("abort from an agent that never said hello")
            reason = msg.abort.reason[:500]
            if len(self.agent_errors) < 64:
                self.agent_errors.append(reason)
            log.error("%s", reason)

    def _exit_report(self, now: float, route: tuple, r) -> RankExitReported | None:
        """The core event for an agent's believed ``rank_exited`` (RouteMismatch if not
        believed: a forged or misrouted report; the rank lives on, its own frames decide).
        None: the agent's own report of a rank that never said hello, not believed (another
        agent claims it too): logged, nothing to forget."""
        lines = tuple(line[:MAX_EXIT_LINE_CHARS] for line in r.last_lines[-MAX_EXIT_LINES:])
        kw = dict(now=now, code=r.code, restart_count=r.restart_count, restarting=r.restarting, last_lines=lines)
        if r.HasField("unpinned_slot"):  # the agent names its process; the core knows its slot
            why = self.agents.agent_refusal(route, r.token, self._peer_key, "exit report of an unpinned process")
            if why:
                raise RouteMismatch(why)
            # The slot whose hello carried this agent's token and local rank: the rank vouched.
            digest = self.agents.claims[route].digest
            rank = self.state.unpinned_slot_of(digest, r.unpinned_slot)
            if rank is None:  # it never held a slot
                return RankExitReported(rank=UNPLACED, agent=digest, local_rank=r.unpinned_slot, **kw)
            return RankExitReported(rank=rank, **kw)
        why = self.agents.report_refusal(route, r.rank, r.token, self._peer_key, self.state.route_of(r.rank) is not None)
        if why and self.agents.before_hello(route, r.rank, r.token, self._peer_key):
            log.info("agent on %s: rank %d ended (code %d) before it said hello (%s)",
                     self.agents.claims[route].host, r.rank, r.code, why)
            return None
        if why:
            raise RouteMismatch(why)
        return RankExitReported(rank=r.rank, **kw)

    def _tell_agents_run_ended(self) -> None:
        """Every agent hears that the run is over (the socket's linger carries it out): one
        with a rank in restart backoff must not start it again for a run that is gone, where
        it would wait for a hello nobody answers (and fail, and be restarted, ...)."""
        f = self.finished
        msg = pb.AgentMsg(run_ended=pb.AgentMsg.RunEnded(ok=bool(f and f.ok), reason=f.reason if f else ""))
        for route in self.agents.claims:
            self._send_now(self.endpoint.frames("agent", msg, route=route), quiet=True)

    def _answer_agent(self, route: tuple, accepted: bool, reason: str) -> None:
        """The agent learns in one round trip that it reached the right coordinator."""
        ack = pb.AgentMsg(hello_ack=pb.AgentMsg.HelloAck(accepted=accepted, reason=reason))
        self._send_frames(self.endpoint.frames("agent", ack, route=route))

    def _on_relay_restarting(self, now: float, route: tuple, m) -> None:
        """A relay died and its agent restarts it (same bind, same uplink identity).

        While it is down its frames are held (``HeldSends.expect``), not failed: its ranks
        are alive and will be reachable again. Once the agent says it is back (``ready``)
        the run is resynchronised exactly as after a coordinator restart -- the frames
        that were inside the dead relay (a consensus, an ack, a fold) are lost, and the
        resync recovers them: a new incarnation, the open round abandoned and redone,
        every rank's Resync report reconciled by the core (``CoordinatorRestarted``,
        ``cause="relay"``, journaled like any event)."""
        hop = bytes(m.identity)
        ranks = self._ranks_behind(hop)
        if not ranks:  # (it died before any rank said hello through it: nothing to hold)
            log.info("relay %s restarting before any rank was admitted through it", hop.decode(errors="replace"))
            return
        for r in ranks:  # only the agent its ranks vouched for may say so
            why = self.agents.report_refusal(route, r, m.token, self._peer_key)
            if why:
                raise RouteMismatch(f"relay_restarting refused: {why}")
        if not m.ready:
            self._link_down(hop, m.reason[:200] or "relay restarting", now, paused=True)
            log.warning("relay %s of ranks %s is being restarted by its agent (%s): holding its frames",
                        hop.decode(errors="replace"), ranks, m.reason[:200])
            return
        row = self._links_down.get(hop)
        if row is None:
            return  # (a repeated "ready")
        row["ready_at"] = now
        self.held.resume(hop)  # delivered, and the run resynchronised, once it is heard (_links_back)
        self.held.retry(self._send_held)
        self._links_back(now)

    def _link_down(self, hop: bytes, reason: str, now: float, *, paused: bool) -> None:
        """The relay ``hop`` is gone for now (its agent restarts it, or its link dropped):
        hold its frames instead of failing them -- its ranks live and will be reachable
        again through it. ``paused``: not even a frame heard from the hop flushes them
        until the agent says the new relay is up (a frame left over from the dead
        connection must not). A relay that never comes back costs its ranks their
        liveness (``liveness_timeout_s``), as any silence does."""
        if self.held is None:
            self.held = recovery.HeldSends(set())
        if paused:
            self.held.expect(hop)
        else:
            self.held.hold(hop)
        if hop in self._links_down and paused:
            self._links_down[hop]["reason"] = reason  # the agent knows why better than a dropped link
            self._links_down[hop].pop("grace_until", None)  # its agent restarts it: wait for "ready"
        if hop not in self._links_down:
            ranks = self._ranks_behind(hop)
            row = {"relay": hop.decode(errors="replace"), "reason": reason, "ranks": ranks, "down_at": now}
            if not paused:  # no agent said it restarts the relay (yet): a bounded wait
                row["grace_until"] = now + RELAY_GRACE_S
            self._links_down[hop] = row
            self.relay_restarts.append(row)
            if not paused:
                log.warning("the link to relay %s of ranks %s dropped: holding its frames until it is back",
                            row["relay"], ranks)

    def _links_expired(self, now: float) -> None:
        """A relay whose link dropped and that no agent announced as restarting within
        RELAY_GRACE_S is gone (its host, or its agent with it): its ranks are unroutable,
        as before holding existed -- their frames are discarded and each is failed."""
        for hop, row in list(self._links_down.items()):
            if "grace_until" in row and now >= row["grace_until"]:
                del self._links_down[hop]
                self.held.release(hop)
                row["gone_at"] = now
                log.warning("relay %s did not come back within %gs and no agent restarts it: its ranks %s are unroutable",
                            row["relay"], RELAY_GRACE_S, row["ranks"])
                for r in row["ranks"]:
                    if self.state.route_of(r) is not None:
                        self._feed(SendFailed(now=now, rank=r, what="relay link lost"))

    def _links_back(self, now: float) -> None:
        """A relay that was down is heard from again and its held frames are delivered:
        resynchronise the run exactly as after a coordinator restart -- the frames that
        were inside the dead relay or the broken link (a consensus, an ack, a fold) are
        lost, and the resync recovers them: a new incarnation, the open round abandoned
        and redone, every rank's Resync report reconciled by the core
        (``CoordinatorRestarted``, ``cause="relay"``, journaled like any event)."""
        if not self._links_down or self.held is None:
            return
        back = [hop for hop in self._links_down if hop not in self.held.unheard]
        for hop in back:
            row = self._links_down.pop(hop)
            row["back_at"] = now
            log.warning("relay %s is back: resynchronising the run (frames inside it were lost)", row["relay"])
        if back:
            self.reducer.abandon()
            self.endpoint = self._new_endpoint()
            self._feed(CoordinatorRestarted(now=now, incarnation=self.endpoint.sender.incarnation, cause="relay"))

    def _new_endpoint(self) -> Endpoint:
        # A random incarnation per process (and per resync): the ranks tell a restart by it.
        return Endpoint(
            self.settings.session, pb.Sender.KIND_COORDINATOR, host=socket.gethostname(), incarnation=secrets.randbits(63) | 1
        )

    def _on_round(self, rank: int | None, header: pb.RoundHeader, blobs, *, relay: tuple = ()) -> None:
        try:
            if relay:
                result = self.reducer.contribute_folded(relay, header, blobs)
            else:
                result = self.reducer.contribute(rank, header, blobs)
        except RoundRefused as e:
            if not e.ranks:  # late, duplicate, foreign: not this round's business
                self.dropped["round_refused"] += 1
                log.warning("round contribution refused: %s", e.reason)
                return
            # It belonged to the round: its ranks left it (refused, counted when the round
            # completes) and the round may be complete without them.
            log.warning(
                "contribution of rank(s) %s refused (%s): %s; their window is discarded",
                list(e.ranks), e.code, e.reason,
            )
            result = self.reducer.settle()
        self._send_round(result, queued=False)

    def _refuse_version(self, route, payload, err: VersionMismatch) -> None:
        """Tell a peer of another major *why* before dropping it (its hello gets an answer)."""
        self._drop(route, err)
        env = _unverified_envelope(payload)
        if env is not None and env.WhichOneof("body") == "hello" and route:
            ack = pb.HelloAck(accepted=False, reason=f"protocol version mismatch: {err.detail}")
            self._send_frames(self.endpoint.frames("hello_ack", ack, route=route))

    def _refuse_session(self, route, payload, err: WrongSession) -> None:
        """A hello (rank or agent) that names another session is answered -- in *its*
        session, so that it can read the answer, and without ours (no leak) -- so that a
        mistyped --session fails in seconds, by name, instead of timing out."""
        self._drop(route, err)
        env = _unverified_envelope(payload)
        if env is None:
            return
        body = env.WhichOneof("body")
        agent_hello = body == "agent" and env.agent.WhichOneof("msg") == "hello"
        if not route or not (body == "hello" or agent_hello) or len(env.session) > 255:
            return
        why = (f"session {env.session!r} is not this coordinator's run: give the agent and ranks the "
               "coordinator's session (--session / FLODL_SESSION)")
        ep = Endpoint(env.session, pb.Sender.KIND_COORDINATOR, incarnation=self.endpoint.sender.incarnation)
        if agent_hello:
            frames = ep.frames("agent", pb.AgentMsg(hello_ack=pb.AgentMsg.HelloAck(accepted=False, reason=why)), route=route)
        else:
            frames = ep.frames("hello_ack", pb.HelloAck(accepted=False, reason=why), route=route)
        self._send_frames(frames)

    def _drop(self, route: tuple, err: WireError) -> None:
        self.dropped[err.reason] += 1  # every frame counts; the log is rate-limited per reason
        self._drop_log.drop(err.reason, f"{_route_str(route)}: {err}", self.clock())

    # -- core --------------------------------------------------------------------

    def _feed(self, event) -> None:
        if self._outbox is None:  # a tick, a signal, the restart: a pass of its own
            with self._pass():
                return self._feed(event)
        self._pending.append(event)
        self._step_pending()

    def _step_pending(self) -> None:
        pending, book, observe, execute = self._pending, self.status.book, self.timeline.observe, self._execute
        while pending:
            ev = pending.popleft()
            self._events_stepped += 1
            self._last_event = type(ev).__name__
            if self._journal is not None:  # building the record costs: only when it is kept
                self._journal_write(to_record(ev))
            try:
                self.state, commands = step(self.state, ev)
                book.stepped(self.state)  # times a round that just finished
            except RankViolation as e:
                # A peer's illegal frame: the core validated before changing anything, so
                # the state is intact (replay skips the same record). Drop it and go on.
                self.dropped["rank_violation"] += 1
                log.warning("refused %s: %s", type(ev).__name__, e.reason)
                continue
            observe(ev, commands)
            for cmd in commands:
                execute(cmd)
        self._status_stale = True  # republished once per tick (_publish_status), not per event

    def _publish_status(self, *, force: bool = False) -> None:
        """The status view walks every rank: build it at most once per tick when something
        changed (an operator polls in seconds), not after every event on the hot path, and
        no more often than keeps its cost under 1/PUBLISH_COST_SHARE of the loop's time (a
        world of thousands of ranks costs tens of ms per build)."""
        now = time.monotonic()
        if self._status_stale and (force or now >= self._next_publish):
            self._status_stale = False
            self.status.update(self.state, self.dropped, self.reducer, checkpoints=self.checkpointing.status(self.state),
                               events=self._events_stepped, journal=journal_stats(self._journal, time.monotonic),
                               loop=self.loop_meter.stats())  # fmt: skip
            cost = time.monotonic() - now
            self._next_publish = now + max(PUBLISH_MIN_S, cost * PUBLISH_COST_SHARE)

    def _execute(self, cmd) -> None:
        run = _EXECUTORS.get(type(cmd))
        if run is None:  # a subclass: the first executor whose command type it is, in table order
            run = next((f for t, f in _EXECUTORS.items() if isinstance(cmd, t)), None)
            if run is None:
                return
        run(self, cmd)

    def _execute_send(self, cmd: Send) -> None:
        # A LastWord's rank was forgotten by the step that sent it: its slot may even be
        # another process's by now (a cohort eviction admits the newcomer at once).
        route = cmd.route if type(cmd) is LastWord else self.state.route_of(cmd.rank)
        if not route:
            self._pending.append(SendFailed(now=self.clock(), rank=cmd.rank, what=cmd.kind))
            return
        if cmd.kind in _STAMPED:  # a checkpoint (its directory), the final eval (the model's path)
            body = self.output.stamp(cmd.rank, self.checkpointing.stamp(cmd.rank, cmd.control))
        else:
            body = cmd.wire  # (a broadcast's body serialised once for all its Sends)
        frames = self.endpoint.frames("control", body, route=tuple(route))
        if not self._send_frames(frames, failed=(cmd.rank, cmd.kind)):
            self._pending.append(SendFailed(now=self.clock(), rank=cmd.rank, what=cmd.kind))

    def _execute_reply(self, cmd: Reply) -> None:
        ack = self.checkpointing.stamp_ack(cmd.ack)
        if not ack.accepted:
            self._log_refusal(cmd.route, ack)
        self._send_frames(self.endpoint.frames("hello_ack", ack, route=cmd.route))

    def _execute_open_round(self, cmd: OpenRound) -> None:
        self._opened_round = True  # (the loop meter times this frame as a round's trigger)
        if self.config.plane == "collective":
            return  # the ranks all-reduce among themselves (flodl_worker.collective): no reducer round
        # FoldOpen goes out before the ranks' RequestParams (later commands of this
        # step) on the same FIFO pipe: a relay knows its fold before any round.
        for relay, msg in self.reducer.folds.open(cmd.cycle, cmd.ranks, self.state.route_of):
            self._send_frames(self.endpoint.frames("relay", msg, route=relay))
        self._send_round(self.reducer.open(cmd.cycle, cmd.ranks, cmd.steps))

    def _execute_forget(self, cmd: ForgetRank) -> None:
        # A clean leave at the end of a run is news, not a warning (a healthy run has none).
        left = self.state.ranks[cmd.rank].phase is LEFT
        log.log(logging.INFO if left else logging.WARNING, "rank %d forgotten: %s", cmd.rank, cmd.reason)
        fold_drop = self.reducer.folds.drop(self.reducer.open_cycle, cmd.rank)
        if fold_drop is not None:  # its relay stops waiting for it; the rest flush
            self._send_frames(self.endpoint.frames("relay", fold_drop[1], route=fold_drop[0]))
        self._send_round(self.reducer.drop(cmd.rank))

    def _execute_seed(self, cmd: SeedJoiner) -> None:
        self._seed_joiner(cmd.rank)

    def _execute_stage(self, cmd: StageCheckpoint) -> None:  # an order to stage a meta, before the notices
        self.checkpointing.stage(cmd)

    def _execute_finished(self, cmd: RunFinished) -> None:
        self.finished = cmd
        self._finished_at = time.monotonic()
        if not cmd.ok and self.state.run.formed_at is None and not self.state.run.stop_reason:
            self._abort_agents(f"the world did not form: {cmd.reason}")  # (a stop: run_ended says it)

    def _abort_agents(self, reason: str) -> None:
        """A world that failed to form: ranks still starting (torch imports) have not said
        hello and get no Shutdown; their agents stop them now (``run_ended``, as the service
        exits, would leave them a grace of seconds first)."""
        msg = pb.AgentMsg(abort=pb.AgentMsg.Abort(reason=reason[:2000]))
        for route in self.agents.claims:
            self._send_frames(self.endpoint.frames("agent", msg, route=route))

    def _seed_joiner(self, rank: int) -> None:
        """A rank admitted into the running world gets the latest consensus (the seed); a
        service that has sent none yet (it restarted since) seeds it with the next one."""
        frame = self.reducer.seed_frame()
        route = self.state.route_of(rank)
        if route is None:
            return  # gone meanwhile (the core heard)
        if frame is None:
            log.info("rank %d joins at the next consensus (this coordinator has not sent one yet)", rank)
            if rank not in self._pending_seeds:
                self._pending_seeds.append(rank)
            return
        header, blobs = frame
        log.info("rank %d seeded with the consensus of cycle %d (%d bytes)", rank, header.cycle,
                 sum(len(b) for b in blobs))  # fmt: skip
        self._send_frames(self.endpoint.frames("round", header, blobs, route=tuple(route)))

    def _flush_seeds(self) -> None:
        pending, self._pending_seeds = self._pending_seeds, []
        for rank in pending:
            self._seed_joiner(rank)

    def _log_refusal(self, route: tuple, ack: pb.HelloAck) -> None:
        """Every refused (or deferred) hello is counted and said, with its reason; a peer
        that repeats one is summarised per kind of reason (digits aside), as drops are."""
        what = "deferred" if ack.deferred else "refused"
        self.dropped[f"hello_{what}"] += 1
        kind = re.sub(r"\d+", "N", ack.reason)[:80]
        self._hello_logs[what].drop(kind, f"{_route_str(route)}: {ack.reason}", self.clock())

    def _send_round(self, result, *, queued: bool = True) -> None:
        if result is None:
            return
        # The core hears of each refused rank before the consensus it resets to goes out
        # (its ack then discards the window): queued after the commands being executed,
        # or at once outside ``_feed`` (``queued=False``).
        for rank, code, why in result.refused:
            self.dropped[f"contribution_{code}"] += 1
            ev = ContributionRefused(now=self.clock(), rank=rank, cycle=result.cycle, reason=f"{code}: {why}")
            if queued:
                self._pending.append(ev)
            else:
                self._feed(ev)
        if result.nonfinite:
            self.dropped["consensus_non_finite"] += 1
        # Fan-out: one copy per folding relay, which forwards the same frames to each of
        # ``ranks`` (deliver_to). It rides the same FIFO pipe as those ranks' control
        # frames, so each rank still sees the coordinator's frames in order.
        for relay, ranks in result.fanout:
            self._send_frames(self.endpoint.frames("round", result.relay_header(ranks), result.blobs, route=relay))
        for rank in result.direct:
            route = self.state.route_of(rank)
            if route is None:
                continue
            self._send_frames(self.endpoint.frames("round", result.wire_for(rank), result.blobs, route=tuple(route)))
        if self._pending_seeds and self.reducer.seed is not None:
            self._flush_seeds()

    def _send_frames(self, frames, failed: tuple | None = None) -> bool:
        """Send ``frames`` once the journal that decided them is durable (write-ahead,
        journal.py): inside a pass they wait in the outbox (True; a failure comes back
        later as ``SendFailed(*failed)``), outside one the journal is fsynced first."""
        if self._outbox is not None:
            self._outbox.append((frames, failed))
            return True
        self._sync_journal()
        return self._send_direct(frames)

    def _send_direct(self, frames) -> bool:
        if self.held and self.held.intercept(frames):
            return True  # a peer not reconnected since the restart: delivered when it is
        if self._send_now(frames):
            return True
        if self._send_errno == zmq.EHOSTUNREACH and frames and bytes(frames[0]) in self._relay_hops():
            # A relay's link dropped (it died, or the network): hold, do not fail its ranks.
            self._link_down(bytes(frames[0]), "the link to the relay dropped", self.clock(), paused=False)
            return self.held.intercept(frames)
        return False

    def _relayed_routes(self):
        """(rank, route) of the admitted ranks that reach us through a relay ([relay, rank])."""
        for r in range(len(self.state.ranks)):
            route = self.state.route_of(r)
            if route is not None and len(route) >= 2:
                yield r, route

    def _relay_hops(self) -> set[bytes]:
        return {bytes(route[0]) for _, route in self._relayed_routes()}

    def _ranks_behind(self, hop: bytes) -> list[int]:
        return [r for r, route in self._relayed_routes() if bytes(route[0]) == hop]

    @contextmanager
    def _pass(self):
        """Hold every frame produced inside until its end; then one fsync, then send (a
        round's trigger sends what is held so far at once: ``_send_decided``)."""
        if self._outbox is not None:  # nested: the outer pass flushes
            yield
            return
        self._outbox = []
        deferred = False
        try:
            deferred = self._gc_settling and self.gc.defer()  # (the collector waits for the sends: gcsettle)
            yield
        finally:
            try:
                self._flush_outbox()
                if self._gc_settling:
                    self.gc.settle()  # (its commands are out: a world formed, an epoch aggregated)
            finally:
                self.gc.resume(deferred)  # (after a settle's collection: none is due then)

    def _send_decided(self) -> None:
        """Mid-pass: what the pass decided so far goes out now (the journal that decided
        it synced first, as at a pass's end), and the pass goes on holding what follows.
        For a round's trigger: its N ``RequestParams`` would otherwise wait for every
        frame after it in the pass (up to ``DRAIN_BATCH``, a median of 6 ms at 256 ranks
        paced), and the ranks sit idle for them."""
        self._flush_outbox()
        self._outbox = []

    def _flush_outbox(self) -> None:
        while True:
            out, self._outbox = self._outbox or [], None
            if out:
                self._sync_journal()  # write-ahead: what decided these frames is on disk first
                for frames, failed in out:
                    if not self._send_direct(frames) and failed is not None:
                        self._pending.append(SendFailed(now=self.clock(), rank=failed[0], what=failed[1]))
            if not self._pending:
                return
            self._outbox = []  # the SendFailed events (or a journal stop) are stepped in a pass too
            self._step_pending()

    def _send_now(self, frames, quiet: bool = False) -> bool:
        try:
            _send_parts(self.sock, frames)
            return True
        except zmq.ZMQError as e:
            # EHOSTUNREACH: ROUTER_MANDATORY says the peer is gone; EAGAIN: its queue is full.
            self._send_errno = e.errno
            if not quiet:  # (a held frame's retry: the peer is simply not back yet)
                self.dropped[f"send_{zmq.strerror(e.errno).replace(' ', '_').lower()}"] += 1
            return False

    def _send_held(self, frames) -> bool:
        return self._send_now(frames, quiet=True)

    def _notice(self, cmd: Notice) -> None:
        log_notice(cmd, self.config.num_epochs, log, decisions)
        self.status.notice(cmd)
        self.gc.notice(cmd.kind)
        if cmd.kind == "shutdown" or (cmd.kind == "epoch" and cmd.data.get("epoch") == self.config.num_epochs - 1):
            t = time.monotonic()
            self.marks.watch_commits(self.state, t)  # (a last round that committed over 1 % at once)
            self.marks.mark("shutdown" if cmd.kind == "shutdown" else "epochs_done", t)
        if cmd.kind == "checkpoint_abandoned":
            self.checkpointing.on_abandoned(cmd)

    def _journal_write(self, record: dict) -> None:
        if self._journal is not None:
            try:
                self._journal.write(record)
            except JournalError as e:
                self._journal_lost(e)

    def _sync_journal(self) -> None:
        if self._journal is not None:
            try:
                self._journal.sync()
            except JournalError as e:
                self._journal_lost(e)

    def _journal_lost(self, e: JournalError) -> None:
        """The journal cannot be written (a full disk...): a crash from here on could not
        be recovered, so the run is stopped cleanly, with the cause, and the service exits
        2 -- which systemd does not restart (RestartPreventExitStatus)."""
        if self._journal_error is not None:
            return
        self._journal_error = f"{e}: the coordinator can no longer guarantee recovery, run stopped"
        log.error("%s", self._journal_error)
        j, self._journal = self._journal, None
        j.close()
        self._pending.append(StopRequested(now=self.clock(), reason=self._journal_error))



# What each core command does here, by its exact type (one look-up per command, not a
# chain of isinstance). Order matters for a subclass only: StageCheckpoint is a Notice,
# and is staged, not noticed.
_EXECUTORS = {
    Send: CoordinatorService._execute_send,
    Reply: CoordinatorService._execute_reply,
    OpenRound: CoordinatorService._execute_open_round,
    ForgetRank: CoordinatorService._execute_forget,
    SeedJoiner: CoordinatorService._execute_seed,
    StageCheckpoint: CoordinatorService._execute_stage,
    Notice: CoordinatorService._notice,
    RunFinished: CoordinatorService._execute_finished,
}


_STAMPED = frozenset((Checkpointing.STAMPS, ModelOutput.STAMPS))  # the kinds of Control the shell adds to

_SEND_MORE = int(zmq.SNDMORE | zmq.NOBLOCK)  # plain ints: or-ing zmq's flag enums per part costs
_SEND_LAST = int(zmq.NOBLOCK)


def _send_parts(sock, frames) -> None:
    """``sock.send_multipart(frames, NOBLOCK, copy=False)``: a message of bytes parts (a
    control frame, every ack) goes part by part without send_multipart's per-part flag
    arithmetic and checks (~2 us of 7 per message); one with blobs (tensors: Frames,
    buffers) goes through send_multipart, which checks every part is a buffer before any
    leaves. With ROUTER_MANDATORY an unroutable peer or a full queue fails on the first
    part, before anything is queued, either way."""
    for part in frames:
        if type(part) is not bytes:
            sock.send_multipart(frames, _SEND_LAST, copy=False)
            return
    send, last = sock.send, len(frames) - 1
    for i, part in enumerate(frames):
        send(part, _SEND_MORE if i < last else _SEND_LAST)

def _open_journal(path: str) -> Journal:
    """Open the journal for appending (a new one owner-only, 0600: journal.py); a journal
    that cannot even be opened stops the service at start (exit 2)."""
    try:
        return Journal(path)
    except JournalError as e:
        raise SettingsError(f"journal error: {e}") from None


class BindError(SettingsError):
    """The service cannot bind its endpoint or HTTP port: one line, exit 2 (not restarted)."""


def _bind_problem(what: str, err: Exception, key: str) -> str:
    flag = f"--{key}, FLODL_{key.upper()} or key {key}"
    reason = zmq.strerror(err.errno) if isinstance(err, zmq.ZMQError) else getattr(err, "strerror", None) or str(err)
    busy = getattr(err, "errno", None) == errno.EADDRINUSE
    if busy:
        return (f"cannot {what}: {reason}: another process holds that port (a coordinator of an "
                f"earlier run still running?); stop it, or choose another port ({flag})")
    return f"cannot {what}: {reason}; fix the address ({flag})"


def _user_id(frame) -> str:
    """The ZAP User-Id of a received frame (with CURVE: the client's z85 public key), or ''."""
    try:
        return frame.get("User-Id") or ""
    except (AttributeError, zmq.ZMQError):  # a bytes copy, or no ZAP handler
        return ""


def _unverified_envelope(payload) -> pb.Envelope | None:
    """The envelope of a frame ``decode`` refused, to answer its hello; None if unparseable."""
    env = pb.Envelope()
    try:
        env.ParseFromString(bytes(payload[0]))
    except Exception:  # noqa: BLE001 - unparseable: nothing to answer
        return None
    return env


def _route_str(route: tuple) -> str:
    return "/".join(r.hex()[:12] for r in route) or "<no route>"


def _settings_record(s: Settings) -> dict:
    from dataclasses import asdict

    return asdict(s)
