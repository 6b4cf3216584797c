"""flodl_worker.agent: the per-host agent. Starts the relay and the ranks, reports exits.

    flodl-worker agent --coordinator tcp://HEAD:5555 --ranks 2 -- python train.py --lr 0.1

Theory of operation
-------------------
One process, one thread, one loop (STYLE "Examples to follow" 8). The loop polls, with
one ``zmq.Poller``: the agent's DEALER to the coordinator, a self-pipe that the signal
handlers wake (``signal.set_wakeup_fd``: SIGCHLD and SIGTERM/SIGINT), and the stdout and
stderr pipes of every child, which it copies to its own with a ``[rank N]`` / ``[relay]``
prefix. Every pass then reaps children (``Popen.poll``) and runs the termination timers.

1. Start the relay (``python -m flodl_worker relay``, frontend on ipc:// in a private
   temporary directory by default) and read its ``RELAY_READY <endpoint>`` line.
   ``--no-relay``: ranks dial the coordinator directly.
2. Start N ranks with the torchrun-style environment (FLODL_RANK = offset + i with
   ``--rank-offset``; without it no rank is pinned: FLODL_RANK is unset and the
   coordinator numbers the processes in admission order, the lowest free slots,
   FLODL_LOCAL_RANK = i, FLODL_WORLD_SIZE, FLODL_CONNECT, FLODL_SESSION, FLODL_HOST,
   FLODL_SLOWDOWN, FLODL_BASE_MS, FLODL_TRACE_DIR, and FLODL_AGENT_TOKEN: this agent's
   random token). Send ``agent.hello{host, ranks, token}``. When the command is this
   interpreter running a module or a script, the ranks are forked from the prefork
   server (``flodl_worker.prefork``, started first: it imports torch once while the
   relay starts); ``flodl_worker.forked`` gives each the ``Popen`` subset used here, and
   the loop polls the server's socket for their exits as SIGCHLD wakes it for its own
   children. ``--no-prefork``, another command, or an environment that differs in more
   than ``FLODL_*``: a plain ``Popen``.
3. The moment a rank ends, send ``agent.rank_exited{rank, code, token, restarting,
   last_lines}`` (Popen semantics: negative = killed by that signal; ``restarting``: it is
   started again, ``--max-restarts``; its last stderr lines; an unpinned rank is named by
   ``unpinned_slot``, its local rank). Restart nothing else. The coordinator believes the
   report only because the rank's own hello named the same token
   (``flodl_coordinator.agents``): nobody else can report this agent's ranks dead.
   A failed rank's exit is logged with its last stderr lines (``TAIL_LINES``: a
   traceback's end), and with ``--exit-log`` every exit is appended there as one JSON
   line, for a launcher to say why its ranks ended (``flodl run``).
4. When every rank has ended: stop the relay (SIGTERM, bounded wait, then SIGKILL), flush
   the socket with a bounded linger, exit 0 if every rank exited 0, else 1.

SIGTERM/SIGINT: forward SIGTERM to the ranks, wait up to ``--term-timeout`` (still
reporting each exit), SIGKILL the rest, then as in 4; ranks that died of the forwarded
SIGTERM count as a clean stop. ``agent.abort`` from the coordinator does the same.
Children run in their own session (a terminal's Ctrl-C reaches only the agent, which
then stops them in order) and, on Linux, get SIGTERM if the agent itself dies.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import zmq

from flodl.wire import Endpoint, SeqTracker, WireError, decode, pb, split_routing

from flodl import sdnotify
from flodl.procutil import death_signal_hook

from flodl.curve import CurveError, client_keys
from flodl.limits import MAX_ENVELOPE_BYTES

from .agent_config import AgentConfig, rank_env, ranks_prefork, slowdown_for
from .forked import Prefork
from .peerlink import PeerLink
from .relay import READY_PREFIX, relay_identity, routing_id

__all__ = ["AgentConfig", "Agent", "run_agent", "rank_env", "slowdown_for"]

log = logging.getLogger("flodl.agent")

LINGER_MS = 2_000  # the last rank_exited frames get this long to leave on exit
# ... unless every rank exited 0: the coordinator ended the run and holds their Exiting
# frames, and has often exited itself, so the reports would only wait out LINGER_MS for
# a peer that is gone (2 s of every run's teardown). A live one takes them in well
# under this.
CLEAN_LINGER_MS = 200
RELAY_READY_TIMEOUT_S = 15.0  # python + pyzmq import, bind: seconds, not minutes
RELAY_STOP_TIMEOUT_S = 5.0
POLL_MS = 200  # safety net only: SIGCHLD wakes the loop the moment a child ends
PIPE_DRAIN_S = 1.0  # after the last rank ended, wait this long at most for pipe EOFs
# A relay that dies is restarted (same bind, same uplink identity: the ranks' DEALERs
# reconnect to it and the coordinator's routes to them stay valid), after these delays;
# one more death within RELAY_RESTART_WINDOW_S of the first of them, and the agent gives
# up on its host: it tells the coordinator why and stops its ranks. Before a restart the
# agent tells the coordinator (``relay_restarting``): it holds the relay's frames while it
# is down and, once it is back, resynchronises the run as after its own restart -- the
# frames that were inside the dead relay (a consensus, a SyncAck, a fold) are lost, and
# the resync is what recovers them.
RELAY_RESTART_DELAYS_S: tuple[float, ...] = (0.1, 1.0, 3.0)
RELAY_RESTART_WINDOW_S = 60.0
# The agent's hello is sent again this often until the coordinator answers it, and the
# agent says so after HELLO_WARN_S (then every HELLO_REWARN_S) while it keeps trying: a
# wrong address or a coordinator that is not running is named in seconds, not after the
# ranks' hello timeout.
HELLO_RESEND_S = 2.0
HELLO_WARN_S = 5.0
HELLO_REWARN_S = 30.0
RESTART_BACKOFF_S = 1.0  # a failed rank's first restart; doubles per restart, at most 30 s
# Once the coordinator says the run ended (``run_ended``, as it exits), no rank is started
# again, and ranks still running this much later are stopped: the ones the run held had
# their Shutdown and leave on their own; what is left is a restarted rank waiting for a
# hello nobody will answer (it would time out, fail, and be restarted again).
RUN_ENDED_GRACE_S = 5.0
TAIL_LINES = 12  # a failed rank's last stderr lines, repeated with its exit (a traceback's end)
EXIT_LINE_CHARS = 300  # ... each cut to this in the exit report (what the coordinator keeps)


@dataclass
class _Child:
    name: str  # log prefix: "rank 3" / "relay"
    proc: subprocess.Popen
    rank: int | None = None  # None for the relay, and for an unpinned rank (the coordinator knows it)
    local: int | None = None  # its index among this agent's ranks (FLODL_LOCAL_RANK); None: the relay
    buffers: dict = field(default_factory=dict)  # fd -> partial line
    reported: bool = False
    restarts: int = 0  # how many times this rank's process was started again
    tail: deque = field(default_factory=lambda: deque(maxlen=TAIL_LINES))  # its last stderr lines


class Agent:
    def __init__(self, cfg: AgentConfig, prefork: Prefork | None = None):
        self.cfg = cfg
        curve = client_keys(cfg.curve_server_key, cfg.curve_secret_key)  # CurveError: one line, exit 2
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, routing_id("agent", cfg.host_name).encode())  # unguessable: relay.routing_id
        self.sock.setsockopt(zmq.LINGER, LINGER_MS)
        self.sock.setsockopt(zmq.MAXMSGSIZE, MAX_ENVELOPE_BYTES)  # it only ever gets control frames
        if curve is not None:
            curve.apply(self.sock)
        self.link = PeerLink(self.sock)  # is the coordinator there when we close (the linger)
        self.sock.connect(cfg.coordinator)
        self.ep = Endpoint(cfg.session, pb.Sender.KIND_AGENT, host=cfg.host_name, incarnation=secrets.randbits(63))
        self.token = secrets.token_bytes(16)  # handed to our ranks only (FLODL_AGENT_TOKEN)
        self.seq = SeqTracker()
        self.drops: dict[str, int] = {}
        self.poller = zmq.Poller()
        self.poller.register(self.sock, zmq.POLLIN)
        self.wake_r, self.wake_w = socket.socketpair()
        for s in (self.wake_r, self.wake_w):
            s.setblocking(False)
        self.poller.register(self.wake_r.fileno(), zmq.POLLIN)
        self.pipes: dict[int, _Child] = {}  # fd -> owner
        self.relay: _Child | None = None
        self.ranks: list[_Child] = []
        self.tmpdir: str | None = None
        self.stop_reason: str | None = None  # set: SIGTERM forwarded / abort
        self.kill_at: float | None = None
        self.relay_failed = False
        # Fixed for the agent's life: a restarted relay keeps the route (flodl_worker.relay).
        self.relay_identity = relay_identity(cfg.host_name)
        self.relay_endpoint: str | None = None  # the frontend, as first bound (port 0 resolved)
        self.relay_deaths: list[float] = []  # monotonic times, within the restart window
        self.relay_restart_at: float | None = None
        self._old_handlers: dict = {}
        self._preexec = death_signal_hook()  # flodl.procutil: children die with the agent
        self.acked: bool | None = None  # the coordinator answered our hello (False: refused)
        self.hello_msg: pb.AgentMsg.AgentHello | None = None
        self.hello_sent_at = 0.0
        self.started_at = time.monotonic()
        self.warned_at: float | None = None
        self.restart_at: dict[int, tuple[float, _Child]] = {}  # rank -> (when, the child that failed)
        self.run_ended_at: float | None = None  # the coordinator said the run is over
        self.connect = ""  # what the ranks dial (the relay's frontend, or the coordinator)
        self.refused = ""
        # The ranks' prefork server (run_agent's, started before this module was imported).
        self.prefork: Prefork | None = prefork

    # -- children -----------------------------------------------------------------------

    def _spawn(self, name: str, argv: list[str], env: dict[str, str], rank: int | None = None,
               local: int | None = None) -> _Child:  # fmt: skip
        if local is not None and self.prefork is not None and self.prefork.serves(argv, env):
            proc = self.prefork.spawn(argv, env)
        else:
            proc = subprocess.Popen(
                argv,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
                preexec_fn=self._preexec,
            )
        child = _Child(name, proc, rank, local)
        for f in (proc.stdout, proc.stderr):
            os.set_blocking(f.fileno(), False)
            child.buffers[f.fileno()] = b""
            self.pipes[f.fileno()] = child
            self.poller.register(f.fileno(), zmq.POLLIN)
        return child

    def _pipe_readable(self, fd: int) -> bool:
        """Pass what ``fd`` holds through with the child's prefix; False once nothing is left."""
        child = self.pipes[fd]
        try:
            data = os.read(fd, 65536)
        except BlockingIOError:
            return False
        except OSError:
            data = b""
        is_err = fd != child.proc.stdout.fileno()
        out = sys.stderr.buffer if is_err else sys.stdout.buffer
        if not data:  # EOF: flush the partial line, stop watching
            if child.buffers[fd]:
                out.write(b"[%s] %s\n" % (child.name.encode(), child.buffers[fd]))
                out.flush()
                if is_err:
                    child.tail.append(child.buffers[fd].decode(errors="replace"))
            self.poller.unregister(fd)
            del self.pipes[fd]
            return False
        *lines, rest = (child.buffers[fd] + data).split(b"\n")
        child.buffers[fd] = rest
        if lines:
            out.write(b"".join(b"[%s] %s\n" % (child.name.encode(), line) for line in lines))
            out.flush()
            if is_err:
                child.tail.extend(line.decode(errors="replace") for line in lines)
        return True

    def _drain_child(self, child: _Child) -> None:
        """Read what an ended child left in its pipes (its last lines; bounded: a grandchild
        may hold a pipe open)."""
        for fd in [fd for fd, c in self.pipes.items() if c is child]:
            for _ in range(64):
                if fd not in self.pipes or not self._pipe_readable(fd):
                    break

    def _first_relay(self) -> str:
        """Start the relay; one that dies before it is ready is tried again like a relay
        that dies later (RELAY_RESTART_DELAYS_S), then the agent gives up (exit 1)."""
        for delay in (*RELAY_RESTART_DELAYS_S, None):
            try:
                return self._start_relay()
            except RuntimeError as e:
                if self.relay is not None and self.relay.proc.poll() is None:
                    _signal(self.relay.proc, signal.SIGKILL)  # one that never said READY in time
                    self.relay.proc.wait()
                if delay is None or self.stop_reason is not None:
                    raise
                log.error("%s: starting it again in %gs", e, delay)
                time.sleep(delay)  # nothing else runs yet: no ranks, no coordinator traffic
        raise AssertionError("unreachable")

    def _start_relay(self) -> str:
        bind = self.relay_endpoint or self.cfg.relay_bind  # a restart binds what the ranks dial
        if bind is None:
            if self.tmpdir is None:  # (a relay started again binds the same path)
                self.tmpdir = tempfile.mkdtemp(prefix="flodl-")  # 0700: only this user can dial it
            bind = f"ipc://{self.tmpdir}/relay.sock"
        argv = [sys.executable, "-m", "flodl_worker", "relay", "--coordinator", self.cfg.coordinator,
                "--bind", bind, "--host", self.cfg.host_name, "--identity", self.relay_identity,
                "--max-message-bytes", str(self.cfg.max_message_bytes)] + ([] if self.cfg.fold else ["--no-fold"])
        if self.cfg.curve_server_key and self.cfg.curve_secret_key:
            argv += ["--curve-server-key", os.path.abspath(self.cfg.curve_server_key),
                     "--curve-secret-key", os.path.abspath(self.cfg.curve_secret_key)]
        self.relay = child = self._spawn("relay", argv, dict(os.environ, PYTHONUNBUFFERED="1"), None)
        fd = child.proc.stdout.fileno()
        deadline = time.monotonic() + RELAY_READY_TIMEOUT_S
        while True:  # only the relay exists yet; a plain select on its pipes is enough
            *complete, partial = child.buffers[fd].split(b"\n")
            for i, line in enumerate(complete):  # complete lines only: never a cut endpoint
                if line.startswith(READY_PREFIX.encode() + b" "):
                    child.buffers[fd] = b"\n".join(complete[i + 1 :] + [partial])
                    return line.split(b" ", 1)[1].strip().decode()
            left = deadline - time.monotonic()
            if left <= 0 or child.proc.poll() is not None or fd not in self.pipes:
                raise RuntimeError(
                    f"relay did not report {READY_PREFIX} (exit code {child.proc.poll()}, "
                    f"waited {RELAY_READY_TIMEOUT_S:g}s); see its stderr above"
                )
            ready, _, _ = select.select(list(self.pipes), [], [], left)
            for rfd in ready:
                if rfd == fd:  # keep the READY line in the buffer, pass the rest through
                    try:
                        data = os.read(fd, 65536)
                    except BlockingIOError:
                        continue
                    if not data:
                        self.poller.unregister(fd)
                        del self.pipes[fd]
                    child.buffers[fd] += data
                else:
                    self._pipe_readable(rfd)

    # -- signals ------------------------------------------------------------------------

    def _install_signals(self) -> None:
        def stop(signum, _frame):
            if self.stop_reason is None:
                self.stop_reason = signal.Signals(signum).name

        self._old_handlers = {
            signal.SIGTERM: signal.signal(signal.SIGTERM, stop),
            signal.SIGINT: signal.signal(signal.SIGINT, stop),
            # A no-op handler (not SIG_IGN, which would auto-reap): its only job is to
            # wake the poll through the wakeup fd the moment a child ends.
            signal.SIGCHLD: signal.signal(signal.SIGCHLD, lambda *_: None),
        }
        signal.set_wakeup_fd(self.wake_w.fileno(), warn_on_full_buffer=False)

    def _restore_signals(self) -> None:
        signal.set_wakeup_fd(-1)
        for sig, h in self._old_handlers.items():
            signal.signal(sig, h)

    def _drain_wakeups(self) -> None:
        try:
            while self.wake_r.recv(4096):
                pass
        except (BlockingIOError, InterruptedError):
            pass

    # -- coordinator --------------------------------------------------------------------

    def _send_agent(self, **msg) -> None:
        try:
            self.sock.send_multipart(self.ep.frames("agent", pb.AgentMsg(**msg)), zmq.NOBLOCK)
        except zmq.Again:
            log.error("could not queue %s for the coordinator (queue full); dropped", list(msg))

    def _on_coordinator(self) -> None:
        while True:
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                _route, payload = split_routing(frames)
                d = decode(payload, session=self.cfg.session)
                self.seq.check(d.envelope)
            except WireError as e:
                n = self.drops[e.reason] = self.drops.get(e.reason, 0) + 1
                if n == 1:
                    log.warning("dropped a frame from the coordinator (%s): %s", e.reason, e.detail)
                continue
            env = d.envelope
            which = env.agent.WhichOneof("msg") if env.WhichOneof("body") == "agent" else None
            if which == "abort":
                log.warning("coordinator asks to abort: %s", env.agent.abort.reason)
                if self.stop_reason is None:
                    self.stop_reason = "abort"
            elif which == "hello_ack":
                self._on_hello_ack(env.agent.hello_ack)
            elif which == "run_ended":
                self._on_run_ended(env.agent.run_ended, time.monotonic())

    def _on_run_ended(self, m: pb.AgentMsg.RunEnded, now: float) -> None:
        if self.run_ended_at is not None:
            return
        self.run_ended_at = now
        pending = sorted(self.restart_at)
        self.restart_at.clear()
        log.info("the coordinator ended the run (ok=%s: %s)%s", m.ok, m.reason or "no reason given",
                 f"; rank(s) {pending} not restarted" if pending else "")

    def _run_over(self, now: float) -> None:
        """After the grace, stop the ranks a finished run no longer holds (RUN_ENDED_GRACE_S)."""
        if self.run_ended_at is None or self.stop_reason is not None or now < self.run_ended_at + RUN_ENDED_GRACE_S:
            return
        alive = [c.rank for c in self._alive()]
        if alive:
            log.warning("rank(s) %s still running %gs after the run ended: stopping them", alive, RUN_ENDED_GRACE_S)
            self.stop_reason = "run_ended"

    def _on_hello_ack(self, ack: pb.AgentMsg.HelloAck) -> None:
        if ack.accepted:
            if not self.acked:
                took = time.monotonic() - self.started_at
                (log.warning if self.warned_at is not None else log.info)(
                    "coordinator at %s answered (after %.1fs)", self.cfg.coordinator, took)
                # Type=notify units: the agent is up once its coordinator took it (no-op elsewhere).
                sdnotify.notify("READY=1", f"STATUS={self._names(self.ranks)} in the run of "
                                f"{self.cfg.coordinator}")
            self.acked = True
            return
        if self.acked is False:
            return
        self.acked = False
        log.error("the coordinator at %s refused this agent: %s", self.cfg.coordinator, ack.reason)
        sdnotify.notify(f"STATUS=refused by the coordinator: {ack.reason}"[:400])
        if self.stop_reason is None:
            self.stop_reason = "refused"
            self.refused = ack.reason

    def _hello_due(self, now: float) -> None:
        """Resend the hello until answered; say what is probably wrong while waiting."""
        if self.acked is not None or self.hello_msg is None:
            return
        if now - self.hello_sent_at >= HELLO_RESEND_S:
            self._send_agent(hello=self.hello_msg)
            self.hello_sent_at = now
        waited = now - self.started_at
        if waited >= HELLO_WARN_S and (self.warned_at is None or now - self.warned_at >= HELLO_REWARN_S):
            self.warned_at = now
            log.warning(
                "no answer from the coordinator at %s after %.0fs: is it running and listening there "
                "(--coordinator), and is %r its session (--session)? still trying",
                self.cfg.coordinator, waited, self.cfg.session,
            )

    # -- the loop -----------------------------------------------------------------------

    def _reap(self) -> None:
        for child in self.ranks:
            code = child.proc.poll()
            if code is not None and not child.reported:
                child.reported = True
                self._drain_child(child)  # its last lines travel with the report
                self._said_exit(child, code)
                restarting = self._maybe_restart(child, code)
                self._send_agent(rank_exited=self._exit_report(child, code, restarting))
        now = time.monotonic()
        for rank, (at, old) in list(self.restart_at.items()):
            if now >= at and self.stop_reason is None:
                del self.restart_at[rank]
                self._restart_rank(old)
        if self.relay is not None and self.relay.proc.poll() is not None and not self.relay.reported:
            self.relay.reported = True
            if self.stop_reason is None:
                self._relay_died(time.monotonic())
        if self.relay_restart_at is not None and time.monotonic() >= self.relay_restart_at and self.stop_reason is None:
            self.relay_restart_at = None
            self._restart_relay()

    def _said_exit(self, child: _Child, code: int) -> None:
        """Log a rank's exit (a failure with its last stderr lines) and append it to the exit log."""
        if code == 0 or self.stop_reason is not None:
            (log.info if code == 0 else log.warning)("%s exited with code %d", child.name, code)
        else:
            last = "".join(f"\n    {line}" for line in child.tail)
            log.warning("%s exited with code %d%s", child.name, code, f"; its last lines:{last}" if last else "")
        if self.cfg.exit_log:
            record = {"rank": child.rank, "local_rank": child.local, "code": code, "restarts": child.restarts,
                      "last_lines": list(child.tail)}  # fmt: skip
            try:
                with open(self.cfg.exit_log, "a", encoding="utf-8") as fh:
                    fh.write(json.dumps(record) + "\n")
            except OSError as e:
                log.error("cannot append to the exit log %s: %s", self.cfg.exit_log, e)

    def _exit_report(self, child: _Child, code: int, restarting: bool) -> pb.AgentMsg.RankExited:
        """``rank_exited``: the exit, whether it comes again, and its last stderr lines (the
        coordinator names them when the world can no longer form without the rank)."""
        lines = [line[:EXIT_LINE_CHARS] for line in list(child.tail)[-TAIL_LINES:]]
        # Unpinned: the coordinator knows which slot (if any) the process took by its local rank.
        who = {"rank": child.rank} if child.rank is not None else {"unpinned_slot": child.local}
        return pb.AgentMsg.RankExited(code=code, token=self.token, restart_count=child.restarts,
                                      restarting=restarting, last_lines=lines, **who)  # fmt: skip

    def _maybe_restart(self, child: _Child, code: int) -> bool:
        """A failed rank process is started again (bounded, with backoff): see max_restarts.
        True when it will be (the exit report says so)."""
        if code == 0 or code == 2 or self.stop_reason is not None or self.run_ended_at is not None \
                or child.restarts >= self.cfg.max_restarts:
            if code not in (0, 2) and self.cfg.max_restarts and child.restarts >= self.cfg.max_restarts:
                log.error("%s failed %d time(s): no restarts left (--max-restarts %d)",
                          child.name, child.restarts + 1, self.cfg.max_restarts)
            return False
        delay = min(30.0, RESTART_BACKOFF_S * 2**child.restarts)
        log.warning("%s failed (%s): restarting it in %gs (restart %d of %d)",
                    child.name, _exit_str(code), delay, child.restarts + 1, self.cfg.max_restarts)
        self.restart_at[child.local] = (time.monotonic() + delay, child)
        return True

    def _restart_rank(self, old: _Child) -> None:
        env = rank_env(self.cfg, old.local, self.connect, dict(os.environ), self.token)
        env["FLODL_RESTART_COUNT"] = str(old.restarts + 1)
        child = self._spawn(old.name, list(self.cfg.command), env, old.rank, old.local)
        child.restarts = old.restarts + 1
        self.ranks[self.ranks.index(old)] = child

    def _relay_died(self, now: float) -> None:
        """The relay ended on its own: restart it (bounded), or give the host up."""
        code = self.relay.proc.returncode
        self.relay_deaths = [t for t in self.relay_deaths if now - t < RELAY_RESTART_WINDOW_S] + [now]
        n = len(self.relay_deaths)
        if n <= len(RELAY_RESTART_DELAYS_S):
            delay = RELAY_RESTART_DELAYS_S[n - 1]
            why = f"relay exited unexpectedly ({_exit_str(code)})"
            log.error("%s: restarting it in %gs (restart %d of %d within %gs)",
                      why, delay, n, len(RELAY_RESTART_DELAYS_S), RELAY_RESTART_WINDOW_S)
            self._send_agent(relay_restarting=pb.AgentMsg.RelayRestarting(
                identity=self.relay_identity.encode(), reason=why, token=self.token))  # fmt: skip
            self.relay_restart_at = now + delay
            return
        times = f", {n} times within {RELAY_RESTART_WINDOW_S:g}s" if RELAY_RESTART_DELAYS_S else ""
        self._give_up_relay(f"relay exited unexpectedly ({_exit_str(code)}){times}")

    def _restart_relay(self) -> None:
        try:
            endpoint = self._start_relay()
        except RuntimeError as e:
            log.error("relay restart failed: %s", e)
            _signal(self.relay.proc, signal.SIGKILL)  # one that never said READY in time
            self.relay.proc.wait()
            self.relay.reported = True
            self._relay_died(time.monotonic())
            return
        log.warning("relay restarted at %s (same identity %s): the ranks reconnect to it",
                    endpoint, self.relay_identity)
        self._send_agent(relay_restarting=pb.AgentMsg.RelayRestarting(
            identity=self.relay_identity.encode(), reason="restarted", token=self.token, ready=True))  # fmt: skip

    def _give_up_relay(self, why: str) -> None:
        reason = f"agent on {self.cfg.host_name}: {why}; giving up: stopping {self._names(self._alive())}"
        log.error("%s", reason)
        # Agent -> coordinator ``abort``: the host is lost, and why (the coordinator logs it
        # before the ranks' exits arrive, which alone would only say "killed by signal 15").
        self._send_agent(abort=pb.AgentMsg.Abort(reason=reason))
        self.stop_reason = "relay_died"
        self.relay_failed = True

    def _names(self, children: list[_Child]) -> str:
        pinned = [c.rank for c in children if c.rank is not None]
        return f"ranks {pinned}" if len(pinned) == len(children) else f"{len(children)} unpinned rank(s)"

    def _alive(self) -> list[_Child]:
        return [c for c in self.ranks if not c.reported]

    def _handle_stop(self, now: float) -> None:
        if self.stop_reason is not None and self.kill_at is None:
            log.info("stopping (%s): SIGTERM to %d rank(s)", self.stop_reason, len(self._alive()))
            for c in self._alive():
                _signal(c.proc, signal.SIGTERM)
            self.kill_at = now + self.cfg.term_timeout_s
        if self.kill_at is not None and now >= self.kill_at:
            for c in self._alive():
                log.warning("%s ignored SIGTERM for %gs: SIGKILL", c.name, self.cfg.term_timeout_s)
                _signal(c.proc, signal.SIGKILL)
            self.kill_at = float("inf")

    def _pass(self, timeout_ms: int) -> None:
        for fd, _ev in self.poller.poll(timeout_ms):
            if fd is self.sock:
                self._on_coordinator()
            elif fd == self.wake_r.fileno():
                self._drain_wakeups()
            elif self.prefork is not None and fd == self.prefork.fileno():
                self.prefork.pump(0.0)  # rank exits: _reap reports them
                if self.prefork.dead:
                    self.poller.unregister(fd)
            elif fd in self.pipes:
                self._pipe_readable(fd)

    def run(self) -> int:
        cfg = self.cfg
        self._install_signals()
        try:
            # The ranks take longest to start (torch): when the relay's address is known
            # before it binds, they start first and dial it while it comes up (ZeroMQ
            # connects to an ipc path that does not exist yet, and retries).
            self._watch_prefork()
            early = None if cfg.no_relay else self._known_relay_bind()
            if early is not None:
                self._spawn_ranks(early)
            connect = cfg.coordinator if cfg.no_relay else self._first_relay()
            self.relay_endpoint = None if cfg.no_relay else connect
            if self.stop_reason is not None and not self.ranks:
                log.info("stopped (%s) before any rank started", self.stop_reason)
                return 0
            if early is None:
                self._spawn_ranks(connect)
            ranks = [c.rank for c in self.ranks if c.rank is not None]  # unpinned: claims none
            self.hello_msg = pb.AgentMsg.AgentHello(host=cfg.host_name, ranks=ranks, token=self.token)
            self._send_agent(hello=self.hello_msg)
            self.hello_sent_at = time.monotonic()
            log.info("agent on %s: %d rank(s) %s via %s", cfg.host_name, cfg.ranks, self._names(self.ranks), connect)
            while self._alive() or self.restart_at:
                now = time.monotonic()
                self._reap()
                self._hello_due(now)
                self._run_over(now)
                self._handle_stop(now)
                if not self._alive() and not self.restart_at:
                    break
                timeout = POLL_MS
                if self.kill_at is not None and self.kill_at != float("inf"):
                    timeout = max(1, min(timeout, int((self.kill_at - now) * 1000) + 1))
                if self.relay_restart_at is not None:
                    timeout = max(1, min(timeout, int((self.relay_restart_at - now) * 1000) + 1))
                self._pass(timeout)
            end = time.monotonic() + PIPE_DRAIN_S  # let the ranks' last lines through
            while any(c.local is not None for c in self.pipes.values()) and time.monotonic() < end:
                self._pass(50)
            return self._exit_code()
        except (RuntimeError, OSError) as e:  # relay never ready, command not startable
            print(f"flodl agent: {e}", file=sys.stderr, flush=True)
            for c in self._alive():
                _signal(c.proc, signal.SIGKILL)
                c.proc.wait()
            return 1
        finally:
            self._stop_relay()
            if self.prefork is not None:
                self.prefork.close()
            self._restore_signals()
            clean = self.ranks and all(c.proc.returncode == 0 for c in self.ranks) and not self.relay_failed
            self.close(self._linger_ms(bool(clean)))  # bounds the flush of the last rank_exited
            if self.tmpdir:
                shutil.rmtree(self.tmpdir, ignore_errors=True)

    def close(self, linger_ms: int = 0) -> None:
        """Close the agent's sockets: the coordinator's, after ``linger_ms`` for what it
        still holds (the monitor first: the context waits for every socket)."""
        self.link.close()
        self.sock.close(linger_ms)
        self.ctx.term()
        self.wake_r.close()
        self.wake_w.close()

    def _linger_ms(self, clean: bool) -> int:
        """How long the last frames may wait for the coordinator: a failure's reports
        ``LINGER_MS`` (a coordinator that crashed may be coming back for them); after a
        clean run ``CLEAN_LINGER_MS``, or none at all once the coordinator hung up (it
        ended the run and exited: nobody would take them)."""
        if not clean:
            return LINGER_MS
        return CLEAN_LINGER_MS if self.link.connected() else 0

    def _known_relay_bind(self) -> str | None:
        """The address the ranks will dial, if it is known before the relay binds: an ipc
        path (the default's, or a given one). A TCP bind is dialled at the address the
        relay reports once bound (port 0, a wildcard host)."""
        bind = self.cfg.relay_bind
        if bind is None:
            if self.tmpdir is None:
                self.tmpdir = tempfile.mkdtemp(prefix="flodl-")  # 0700: only this user can dial it
            return f"ipc://{self.tmpdir}/relay.sock"
        return bind if bind.startswith("ipc://") else None

    def _watch_prefork(self) -> None:
        """Watch the prefork server ``run_agent`` handed over, if any: it imports torch
        while the relay starts, once for every rank of this host."""
        if self.prefork is None:
            return
        self.poller.register(self.prefork.fileno(), zmq.POLLIN)
        log.info("ranks fork from a preloaded interpreter (prefork server pid %d)", self.prefork.proc.pid)

    def _spawn_ranks(self, connect: str) -> None:
        base = dict(os.environ)
        self.connect = connect
        for i in range(self.cfg.ranks):
            rank = self.cfg.rank_of(i)
            env = rank_env(self.cfg, i, connect, base, self.token)
            name = f"rank {rank}" if rank is not None else f"local {i}"  # unpinned: its rank says which it got
            self.ranks.append(self._spawn(name, list(self.cfg.command), env, rank, i))

    def _exit_code(self) -> int:
        if self.acked is False:
            return 2  # refused by the coordinator: a configuration error (session, ranks)
        codes = [c.proc.returncode for c in self.ranks]
        clean = {0, -signal.SIGTERM} if self.stop_reason in ("SIGTERM", "SIGINT", "run_ended") else {0}
        return 0 if all(code in clean for code in codes) and not self.relay_failed else 1

    def _stop_relay(self) -> None:
        r = self.relay
        if r is None:
            return
        if r.proc.poll() is None:
            _signal(r.proc, signal.SIGTERM)
            try:
                r.proc.wait(RELAY_STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                log.warning("relay ignored SIGTERM for %gs: SIGKILL", RELAY_STOP_TIMEOUT_S)
                _signal(r.proc, signal.SIGKILL)
                r.proc.wait()
        for fd in [fd for fd, c in self.pipes.items() if c is r]:
            for _ in range(64):  # pass its last lines through (bounded: a grandchild
                if fd not in self.pipes:  # could hold the pipe open)
                    break
                self._pipe_readable(fd)
        if r.proc.returncode not in (0, None):
            log.warning("relay exited with code %d", r.proc.returncode)


def _exit_str(code: int | None) -> str:
    return f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"


def _signal(proc: subprocess.Popen, sig: int) -> None:
    try:
        proc.send_signal(sig)
    except ProcessLookupError:
        pass


_START = object()  # run_agent's default: start the ranks' prefork server here


def run_agent(cfg: AgentConfig, prefork: Any = _START) -> int:
    """Run the agent to the end; returns its exit code (0 all ranks 0, 1 otherwise, 2 setup).
    ``prefork``: the ranks' server (``ranks_prefork``), which the command line starts
    before it imports this module, or None; closed here whatever happens."""
    if prefork is _START:
        prefork = ranks_prefork(cfg)
    try:
        agent = Agent(cfg, prefork)
    except CurveError as e:
        print(f"flodl agent: {e}", file=sys.stderr, flush=True)
    except zmq.ZMQError as e:
        print(f"flodl agent: cannot dial the coordinator at {cfg.coordinator}: {e}", file=sys.stderr, flush=True)
    else:
        return agent.run()
    if prefork is not None:
        prefork.close()
    return 2
