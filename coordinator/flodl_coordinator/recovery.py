"""Coordinator restart: rebuild the service from its journal, then meet the ranks again.

Theory of operation
-------------------
``serve --journal J`` journals every decoded event *before* stepping it (a ``_start``
record with the settings and the bound endpoint comes first), so when the process is
killed (``kill -9``, OOM, a host hiccup) and started again with the same command line --
what systemd's ``Restart=on-failure`` does -- the journal holds everything it decided:

1. ``recover(settings, checkpointing)`` reads J. No journal, or an empty one: a fresh
   run (None). Otherwise it must hold *this* run: every run setting must match the
   ``_start`` record's (only the service's own keys -- bind, journal, summary, http,
   tick, checkpoint_keep -- may differ), and a resumed run the same checkpoint; else a
   ``SettingsError`` names the key (``serve`` exits 2). A torn last line (the process died
   mid-write: that event was never stepped) is cut off. The events are replayed through
   ``flodl.core.step`` with their commands discarded (no I/O); service records (``_agent``
   and ``_rank_agent``: which ranks an agent announced and which of them vouched for it,
   so its exit reports are still believed, ``flodl_coordinator.agents``; ``_restart``)
   rebuild the shell's own state. A finished run is refused (nothing to recover), unless
   ``rotate_journal`` is set: then J is moved aside to ``J.<n>`` and a new run starts.
2. The service binds the journal's endpoint when its own ``bind`` says port 0 (the ranks
   dial the old one), writes a ``_restart`` record, and feeds the core
   ``CoordinatorRestarted`` (``flodl.core._resync``). Its ``Endpoint`` has a fresh random
   incarnation: that is how the ranks tell that it restarted.
3. The clock continues: if the host rebooted, monotonic time restarted below the
   journal's last ``now``; an offset keeps event times increasing (``continuing``).
4. ``HeldSends``: after the restart, a peer whose route was known but that has not
   reconnected yet would make ``ROUTER_MANDATORY`` fail every send, and the core would
   declare it dead. Frames for such a first hop wait (in order) until a frame arrives
   from it or a retry on a tick goes through; a peer that never comes back is declared
   dead by the core's liveness rule (``liveness_timeout_s``, a fresh grace from the
   restart), after which nothing more is sent to it.

Lost with the old process, by design: its reducer's open round (abandoned, see
``_resync``), frames in its queues both ways (the ranks' resync reports recover what
matters), the outer optimizer's state since the last checkpoint, and the checkpoint
store's bookkeeping of saves already committed (they are on disk; only the summary's
``checkpoints.committed`` list restarts). A save decided but not committed is staged
again from the replayed ``checkpoint_meta``, so its rank's answer can still commit it.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections import deque
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Optional

from flodl.core import (
    LocalViolation,
    StageCheckpoint,
    RankViolation,
    from_record,
    initial_state,
    resume_plan,
    step,
)
from flodl.core import FINISHED

from .settings import NO_BEFORE, Settings, SettingsError, journaled_settings

__all__ = ["Recovered", "recover", "HeldSends", "continuing", "bind_address", "agent_record", "SERVICE_KEYS"]

log = logging.getLogger("flodl.coordinator")

# Settings that may differ between the run's first process and a restarted one.
SERVICE_KEYS = frozenset(
    {"bind", "journal", "summary", "output", "http", "tick_interval_s", "allow_insecure", "checkpoint_keep",
     "rotate_journal", "curve_secret_key", "curve_allowed_keys", "max_message_bytes",  # keys may be rotated across a restart
     "metrics_rank_labels", "dashboard_out", "status_out", "status_linger_s"}
)
# Frames held for one peer that has not reconnected, at most (beacons, a few commands).
HELD_LIMIT = 10_000


@dataclass
class Recovered:
    """What the journal rebuilt: the core state and the shell's own bookkeeping."""

    path: str
    state: Any  # flodl.core.CoordinatorState
    agent_ranks: dict[tuple, set[int]] = field(default_factory=dict)
    agent_records: list[dict] = field(default_factory=list)  # _agent / _rank_agent, in order (agents.AgentBook)
    endpoint: str = ""
    last_now: float = 0.0
    events: int = 0
    restarts: int = 0  # earlier restarts recorded in the journal
    pending_metas: list[StageCheckpoint] = field(default_factory=list)

    def hops(self) -> set[bytes]:
        """First hops of every route the rebuilt service may send to."""
        routes = [rec.route for rec in self.state.ranks if rec.route]
        routes += list(self.agent_ranks)
        return {bytes(r[0]) for r in routes if r}

    def restart_record(self, endpoint: str, incarnation: int) -> dict:
        return {
            "type": "_restart",
            "endpoint": endpoint,
            "incarnation": incarnation,
            "replayed_events": self.events,
            "restart": self.restarts + 1,
        }


def agent_record(route: tuple, hello, *, ranks=None, token: str = "", key: str = "") -> dict:
    """The journal record of an agent's hello (not a core event: the shell's own state).

    ``ranks``: the ranks its claim holds (default: all it named); ``token``: the digest of
    its token, ``key``: its CURVE client key (``agents``), each only when set."""
    rec = {"type": "_agent", "route": [h.hex() for h in route], "ranks": sorted(hello.ranks if ranks is None else ranks),
           "host": hello.host}  # fmt: skip
    rec.update({k: v for k, v in (("token", token), ("key", key)) if v})
    return rec


def _lines(path: str) -> tuple[list[dict], int]:
    """The journal's records, and the byte length of its intact part."""
    with open(path, "rb") as fh:
        raw = fh.read()
    records: list[dict] = []
    pos = 0
    while pos < len(raw):
        nl = raw.find(b"\n", pos)
        end = len(raw) if nl < 0 else nl + 1
        line = raw[pos:end]
        try:
            if nl < 0:
                raise ValueError("no newline")
            if line.strip():
                records.append(json.loads(line))
        except ValueError as e:
            if end == len(raw):  # torn last write: the process died in it, never stepped it
                log.warning("journal %s: its last line is torn (%d bytes); cut off", path, len(line))
                return records, pos
            raise SettingsError(f"journal {path}: line {len(records) + 1} is not JSON ({e}): refusing to recover") from None
        pos = end
    return records, pos


def _compare(path: str, start: dict, settings: Settings) -> None:
    theirs = start.get("settings") or {}
    ran = journaled_settings(theirs, f"journal {path}")
    for f in fields(Settings):
        if f.name in SERVICE_KEYS:
            continue
        old, new = getattr(ran, f.name), getattr(settings, f.name)
        if old != new:
            why = ""
            if f.name not in theirs:  # (required keys are never absent: journaled_settings)
                why = (" (its journal predates the setting: it ran as that)" if f.metadata["setting"].before is not NO_BEFORE
                       else " (absent from its journal: read as the default)")  # fmt: skip
            raise SettingsError(
                f"journal {path} holds another run: {f.name} is {old!r} there{why} and {new!r} here "
                f"(restart with the same settings, or move the journal away to start a new run)"
            )


def _rotate(path: str) -> str:
    n = 1
    while os.path.exists(f"{path}.{n}"):
        n += 1
    os.replace(path, f"{path}.{n}")
    return f"{path}.{n}"


def recover(settings: Settings, checkpointing, observe=None) -> Optional[Recovered]:
    """Rebuild an unfinished run from ``settings.journal``; None to start a fresh run.
    ``observe(event, commands)``, if given, sees every replayed step (the dashboard's
    timeline: a restarted coordinator still shows the run from its start)."""
    path = settings.journal
    if not path or not os.path.exists(path) or os.path.getsize(path) == 0:
        return None
    records, intact = _lines(path)
    if not records:
        _truncate(path, intact)
        return None
    start = records[0]
    if start.get("type") != "_start":
        raise SettingsError(f"journal {path} does not start with a _start record: not a flodl journal")
    _compare(path, start, settings)
    meta = start.get("resume_meta")
    mine = checkpointing.resumed.meta if checkpointing.resumed is not None else None
    if json.loads(json.dumps(meta)) != json.loads(json.dumps(mine)):
        raise SettingsError(f"journal {path} was resumed from another checkpoint than resume = {settings.resume!r}")
    try:
        point = resume_plan(meta) if meta is not None else None
    except ValueError as e:
        raise SettingsError(f"journal {path}: its resume_meta is unreadable: {e}") from None
    rec = Recovered(path=path, state=initial_state(settings.core_config(), point), endpoint=start.get("endpoint", ""))
    metas: dict[int, list[StageCheckpoint]] = {}  # version -> one meta per epoch of that save
    for i, r in enumerate(records[1:], start=2):
        kind = r.get("type", "")
        if kind == "_agent":
            rec.agent_ranks[tuple(bytes.fromhex(h) for h in r["route"])] = set(r["ranks"])
        if kind in ("_agent", "_rank_agent"):  # which agent may report which rank (agents.AgentBook)
            rec.agent_records.append(r)
            continue
        if kind == "_restart":
            rec.restarts += 1
            continue
        if kind.startswith("_"):
            continue
        try:
            ev = from_record(r)
        except (TypeError, ValueError) as e:
            raise SettingsError(f"journal {path}: record {i} is not an event ({e}): refusing to recover") from None
        rec.events += 1
        rec.last_now = max(rec.last_now, ev.now)
        try:
            _, cmds = step(rec.state, ev)
        except RankViolation:
            continue  # refused when it happened too: it changed nothing
        except LocalViolation as e:
            raise SettingsError(f"journal {path}: replay failed at record {i}: {e.reason}") from None
        if observe is not None:
            observe(ev, cmds)
        for c in cmds:
            if isinstance(c, StageCheckpoint):
                metas.setdefault(c.version, []).append(c)
    if rec.state.run.phase is FINISHED:
        if getattr(settings, "rotate_journal", False):
            moved = _rotate(path)
            log.info("journal %s held a finished run: moved to %s; starting a new run", path, moved)
            return None
        run = rec.state.run
        raise SettingsError(
            f"journal {path} holds a finished run (ok={run.ok}, {run.reason}): nothing to recover; "
            f"move it away (or set rotate_journal) to start a new run"
        )
    _truncate(path, intact)
    rec.pending_metas = [m for v in sorted(rec.state.checkpoints.pending) for m in metas.get(v, [])]
    log.warning(
        "recovering from journal %s: %d events replayed (run %r, %d epoch(s) aggregated, round cycle %d)",
        path, rec.events, rec.state.run.phase, len(rec.state.metrics.history), rec.state.rounds.cycle,
    )  # fmt: skip
    return rec


def _truncate(path: str, intact: int) -> None:
    if os.path.getsize(path) > intact:
        with open(path, "r+b") as fh:
            fh.truncate(intact)


def continuing(clock: Callable[[], float], recovered: Optional[Recovered]) -> Callable[[], float]:
    """``clock``, shifted so that it never runs below the journal's last event time."""
    if recovered is None:
        return clock
    lag = recovered.last_now - clock()
    if lag <= 0:
        return clock
    return lambda: clock() + lag


_PORT_ANY = re.compile(r"^tcp://.*:0$")


def bind_address(settings: Settings, recovered: Optional[Recovered]) -> str:
    """The configured bind, or -- when it says port 0 -- the endpoint the run had."""
    if recovered is not None and recovered.endpoint and _PORT_ANY.match(settings.bind):
        return recovered.endpoint
    return settings.bind


class HeldSends:
    """Frames for first hops that have not reconnected since the restart (see module doc).

    ``send(frames) -> bool`` is the raw, non-blocking send; it returns False when the
    peer is still unroutable."""

    def __init__(self, hops: set[bytes]) -> None:
        self.unheard = set(hops)
        self.held: dict[bytes, deque] = {}
        self.overflow = 0
        self.paused: set[bytes] = set()  # hops known to be down: hold, never flush yet

    def expect(self, hop: bytes) -> None:
        """``hop`` went away and will come back (a relay being restarted): hold its
        frames, and do not try to deliver them until ``resume`` -- a frame left over
        from the dead connection must not flush them into it."""
        self.unheard.add(hop)
        self.paused.add(hop)

    def release(self, hop: bytes) -> int:
        """Stop holding for ``hop`` (it is not coming back): its frames are discarded."""
        self.unheard.discard(hop)
        self.paused.discard(hop)
        return len(self.held.pop(hop, ()))

    def hold(self, hop: bytes) -> None:
        """``hop`` is unreachable for now: hold its frames until it is heard (or retried)."""
        self.unheard.add(hop)

    def resume(self, hop: bytes) -> None:
        """``hop`` is back (its agent says so): deliver what waited once it is heard."""
        self.paused.discard(hop)

    def __bool__(self) -> bool:
        return bool(self.unheard)

    def intercept(self, frames) -> bool:
        """True if the frames were held (the caller must not send them now)."""
        if not self.unheard or not frames or not len(frames[0]):
            return False
        hop = bytes(frames[0])
        if hop not in self.unheard:
            return False
        q = self.held.setdefault(hop, deque())
        if len(q) >= HELD_LIMIT:
            q.popleft()
            self.overflow += 1
        q.append(frames)
        return True

    def heard(self, hop: bytes, send: Callable[[list], bool]) -> None:
        """A frame arrived from ``hop``: it is connected; deliver what waited for it."""
        if hop in self.unheard:
            self._flush(hop, send)
            if hop not in self.paused and hop not in self.held:
                self.unheard.discard(hop)  # heard, nothing waiting: send to it directly again

    def retry(self, send: Callable[[list], bool]) -> None:
        """Try every hop (a peer that reconnected but has said nothing yet, like an agent)."""
        for hop in list(self.unheard):
            self._flush(hop, send)

    def _flush(self, hop: bytes, send: Callable[[list], bool]) -> None:
        if hop in self.paused:
            return
        q = self.held.get(hop)
        while q:
            if not send(q[0]):
                return
            q.popleft()
        if q is not None:
            del self.held[hop]
            self.unheard.discard(hop)
            log.info("peer %s is back: its held frames were delivered", hop[:24])
