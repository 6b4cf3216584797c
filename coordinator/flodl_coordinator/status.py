"""Operator view: ``/status`` (JSON, docs/status.md), ``/metrics`` (Prometheus), the dashboard
page (``/``) and its ``/timeline`` (JSON, ``flodl_coordinator.timeline``) over HTTP.

The loop thread publishes an immutable snapshot once per tick (``update``); the HTTP
thread only reads the latest one (a reference swap), never the core's state or a
socket. ``/status`` is a versioned document (``SCHEMA_VERSION``; its JSON Schema is
docs/status.schema.json, which a test validates live output against); ``/metrics`` is
``prometheus_client``'s exposition of ``flodl_coordinator.metrics``.

Bump ``SCHEMA_VERSION`` when a field changes meaning or goes away; adding a field
does not bump it (readers ignore what they do not know).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Optional
from urllib.parse import parse_qs

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from flodl import strictjson
from flodl.core import status_view

from . import dashboard
from .metrics import CAUSES, GOODPUT_CAUSES, RunBook, new_registry
from .timeline import POLL_SPANS

__all__ = ["StatusBoard", "SCHEMA_VERSION", "status_document"]

SCHEMA_VERSION = 1
# An ACTIVE rank not heard from for this share of liveness_timeout_s is shown as an alert:
# halfway to the core declaring it dead.
SILENT_SHARE = 0.5
# A journal not durable for this long is an alert (fsyncs normally happen every pass).
JOURNAL_LAG_ALERT_S = 5.0
# Epochs kept in ``recent_epochs``: a reader polling every few seconds misses none.
RECENT_EPOCHS = 32


class StatusBoard:
    def __init__(self, book: RunBook | None = None) -> None:
        self.book = book if book is not None else RunBook("flodl", 64)
        self.registry = new_registry(self.book)
        self._snap: dict = {"schema_version": SCHEMA_VERSION, "run": {"phase": "starting"}}
        self._last_epoch: dict = {}
        self._recent: deque[dict] = deque(maxlen=RECENT_EPOCHS)
        self._events = 0
        self.http_address: tuple | None = None
        self.timeline = None  # a Timeline (flodl_coordinator.timeline), read by /timeline

    def notice(self, cmd) -> None:
        if cmd.kind == "epoch":
            self._last_epoch = dict(cmd.data)
            self._recent.append(_last_epoch(self._last_epoch))
        self.book.noticed(cmd.kind, cmd.data)

    def update(self, state, dropped, reducer, checkpoints: dict | None = None, events: int | None = None,
               journal: dict | None = None, loop: dict | None = None) -> None:  # fmt: skip
        """Publish a fresh snapshot; ``events``: how many the core has stepped (default:
        one more per call); ``journal``: ``metrics.journal_stats`` (empty: no journal);
        ``loop``: ``LoopMeter.stats`` (empty: not measured)."""
        self._events = self._events + 1 if events is None else events
        core = status_view(state)
        self.book.publish(state, core, reducer=reducer, dropped=dict(dropped), journal=journal or {},
                          events=self._events, loop=loop or {})  # fmt: skip
        self._snap = status_document(
            core, self.book, session=self.book.run, events=self._events, dropped=dict(dropped), reducer=reducer,
            checkpoints=checkpoints or {}, last_epoch=self._last_epoch, journal=journal or {},
            silent_s=SILENT_SHARE * state.config.liveness_timeout_s, recent_epochs=list(self._recent),
        )  # fmt: skip

    def snapshot(self) -> dict:
        return self._snap

    def prometheus(self) -> bytes:
        return generate_latest(self.registry)

    def serve(self, hostport: str) -> ThreadingHTTPServer:
        host, _, port = hostport.rpartition(":")
        board = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - http.server API
                path, _, query = self.path.partition("?")
                if path in ("/", "/index.html"):
                    body, ctype = dashboard.page().encode(), "text/html; charset=utf-8"
                elif path == "/timeline":
                    try:
                        limit = int(parse_qs(query).get("max_spans", [POLL_SPANS])[0])
                    except ValueError:
                        self.send_error(400, "max_spans must be an integer (0: every span)")
                        return
                    data = board.timeline.snapshot(max(0, limit)) if board.timeline is not None else {}
                    body, ctype = dashboard.to_json(data).encode(), "application/json"
                elif self.path.startswith("/metrics"):
                    body, ctype = board.prometheus(), CONTENT_TYPE_LATEST
                elif self.path.startswith("/status"):
                    body, ctype = strictjson.dumps(board.snapshot(), default=str).encode(), "application/json"
                else:
                    self.send_error(404, "try /, /status, /timeline or /metrics")
                    return
                self.send_response(200)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        server = ThreadingHTTPServer((host or "127.0.0.1", int(port)), Handler)
        self.http_address = server.server_address[:2]  # the bound (host, port): port 0 picks one
        threading.Thread(target=server.serve_forever, name="flodl-http", daemon=True).start()
        return server


def status_document(core: dict, book: RunBook, *, session: str, events: int, dropped: dict, reducer,
                    checkpoints: dict, last_epoch: dict, journal: dict, silent_s: float,
                    recent_epochs: list | None = None) -> dict:  # fmt: skip
    """The ``/status`` document (docs/status.md) from the core's view and the service's books."""
    run, ep, prog = core["run"], core["epoch"], core["progress"]
    now = core["now"] or 0.0
    total_samples = sum(r["samples"] for r in core["ranks"]) or 0
    membership = []
    for r in core["ranks"]:
        t = book.time_of(r["rank"])
        membership.append({
            "rank": r["rank"], "phase": r["phase"], "host": r["host"], "pid": r["pid"],
            "incarnation": r["incarnation"], "epoch": r["epoch"], "samples": r["samples"], "batches": r["batches"],
            "rate": book.rate_of(r["rank"]),
            "share": (r["samples"] / total_samples) if total_samples else None,
            "window": r["window"],
            "last_seen_s": (now - r["last_seen"]) if r["last_seen"] else None,
            "reason": r["reason"],
            "goodput_s": sum(t[c] for c in GOODPUT_CAUSES),
            "badput_s": sum(t[c] for c in CAUSES if c not in GOODPUT_CAUSES),
            "time_s": {c: t[c] for c in (*CAUSES, "wall")},
        })  # fmt: skip
    rnd = core["round"]
    sample = book.sample
    doc: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "updated_unix": time.time(),
        "run": {
            "session": session, "phase": run["phase"], "ok": run["ok"], "reason": run["reason"],
            "stop_reason": run["stop_reason"], "policy": core["policy"], "plane": core["plane"],
            "world_size": core["world_size"], "report_interval_ms": core["report_interval_ms"],
            "formed_at": run["formed_at"],
            "coordinator_restarts": book.coordinator_restarts, "events": events,
        },
        "progress": {
            "epoch": ep["dispatched"], "num_epochs": ep["num_epochs"],
            "epochs_completed": (ep["aggregated"] + 1) if ep["aggregated"] is not None else 0,
            "samples_committed": prog["samples_committed"], "samples_total": prog["samples_total"],
            "fraction": prog["fraction"], "samples_discarded": prog["samples_discarded"],
            "samples_per_s": sample.committed_per_s, "eta_s": sample.eta_s,
        },
        "membership": membership,
        "last_epoch": _last_epoch(last_epoch),
        "recent_epochs": list(recent_epochs or []),
        "round": {
            "open": rnd["open"], "cycle": rnd["cycle"], "phase": rnd["phase"], "version": rnd["version"],
            "ranks": rnd["ranks"], "waiting_for": rnd["waiting_for"],
            "open_s": (now - rnd["opened_at"]) if rnd["open"] and rnd["opened_at"] is not None else None,
            "refused": rnd["refused"],
        },
        # The gate's answer, the epoch rule's ("aggregate"), then every other rule's why-not.
        "waiting": {"round": core["reasons"].get("round"), "epoch": core["reasons"].get("aggregate"),
                    **{k: v for k, v in core["reasons"].items() if k not in ("round", "aggregate")}},
        "alerts": alerts(core, dropped, checkpoints, journal, silent_s),
        "bus": {"rounds": reducer.rounds_completed, "bytes_in": reducer.bytes_in, "bytes_out": reducer.bytes_out},
        "dropped_frames": dropped,
        "checkpoints": checkpoints,
        "core": core,
    }  # fmt: skip
    return doc


def _last_epoch(d: dict) -> Optional[dict]:
    if not d:
        return None
    cov = d.get("coverage") or {}
    return {
        "epoch": d.get("epoch"), "avg_loss": d.get("avg_loss"), "wall_s": d.get("wall_s"),
        "samples_per_s": list(d.get("samples_per_s") or []), "coverage": dict(cov),
    }  # fmt: skip


def alerts(core: dict, dropped: dict, checkpoints: dict, journal: dict, silent_s: float) -> list[dict]:
    """What an operator should look at now, worst first; empty in a healthy run."""
    out: list[dict] = []
    run = core["run"]
    if run["phase"] == "FINISHED" and run["ok"] is False:
        out.append(_alert("error", "run_failed", f"the run failed: {run['reason']}"))
    missing = checkpoints.get("missing") or []
    if missing:
        out.append(_alert("error", "checkpoint_missing", f"checkpoints asked and not made: {missing}"))
    now = core["now"] or 0.0
    for r in core["ranks"]:
        if r["phase"] == "DEAD":
            out.append(_alert("warning", "rank_lost", f"rank {r['rank']} lost: {r['reason']}"))
        elif r["phase"] == "ACTIVE" and r["last_seen"] and now - r["last_seen"] > silent_s:
            out.append(_alert("warning", "rank_silent", f"rank {r['rank']} silent for {now - r['last_seen']:.1f}s"))
    for rank, why in run["not_admitted"].items():
        out.append(_alert("warning", "not_admitted", f"rank {rank} not admitted: {why}"))
    for reason, n in sorted(dropped.items()):
        if n:  # (a deferred hello is admission waiting for the world to form, not a loss)
            level = "info" if reason == "hello_deferred" else "warning"
            out.append(_alert(level, "dropped_frames", f"{n} frame(s) dropped: {reason}"))
    lag = journal.get("lag_s") or 0.0
    if lag > JOURNAL_LAG_ALERT_S:
        out.append(_alert("warning", "journal_lag", f"journal not durable for {lag:.1f}s"))
    return sorted(out, key=lambda a: _LEVELS.index(a["level"]))  # stable: worst first, then as found


_LEVELS = ("error", "warning", "info")


def _alert(level: str, kind: str, message: str) -> dict:
    return {"level": level, "kind": kind, "message": message}
