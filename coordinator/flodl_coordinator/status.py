"""Operator view: ``/status`` (JSON), ``/metrics`` (Prometheus text), the dashboard page
(``/``) and its ``/timeline`` (JSON, ``flodl_coordinator.timeline``) over HTTP.

The loop thread publishes a small immutable snapshot after every event; the HTTP
thread only reads the latest snapshot (one reference swap), never the core's state
or a socket.
"""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs

from flodl import strictjson
from flodl.core import status_view

from . import dashboard
from .timeline import POLL_SPANS

__all__ = ["StatusBoard"]


class StatusBoard:
    def __init__(self) -> None:
        self._snap: dict = {"phase": "starting"}
        self._last_epoch: dict = {}
        self._events = 0
        self.http_address: tuple | None = None
        self.timeline = None  # a Timeline (flodl_coordinator.timeline), read by /timeline

    def notice(self, cmd) -> None:
        if cmd.kind == "epoch":
            self._last_epoch = dict(cmd.data)

    def update(self, state, dropped, reducer, checkpoints: dict | None = None, events: int | None = None) -> None:
        """Publish a fresh snapshot; ``events``: how many the core has stepped (default:
        one more per call)."""
        self._events = self._events + 1 if events is None else events
        core = status_view(state)
        self._snap = {
            "phase": core["run"]["phase"],
            "events": self._events,
            "dropped_frames": dict(dropped),
            "rounds_completed": reducer.rounds_completed,
            "bus_bytes_in": reducer.bytes_in,
            "bus_bytes_out": reducer.bytes_out,
            "last_epoch": self._last_epoch,
            "checkpoints": checkpoints or {},  # asked / committed / missing (flodl_coordinator.checkpointing)
            "core": core,
        }

    def snapshot(self) -> dict:
        return self._snap

    def prometheus(self) -> str:
        s = self._snap
        lines = [
            "# TYPE flodl_events_total counter",
            f"flodl_events_total {s.get('events', 0)}",
            "# TYPE flodl_rounds_completed_total counter",
            f"flodl_rounds_completed_total {s.get('rounds_completed', 0)}",
            "# TYPE flodl_bus_bytes_total counter",
            f'flodl_bus_bytes_total{{direction="in"}} {s.get("bus_bytes_in", 0)}',
            f'flodl_bus_bytes_total{{direction="out"}} {s.get("bus_bytes_out", 0)}',
            "# TYPE flodl_dropped_frames_total counter",
        ]
        for reason, n in sorted(s.get("dropped_frames", {}).items()):
            lines.append(f'flodl_dropped_frames_total{{reason="{reason}"}} {n}')
        return "\n".join(lines) + "\n"

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
                    body, ctype = board.prometheus().encode(), "text/plain; version=0.0.4"
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
