"""The launcher's live view of a run: one line per epoch, and a progress bar on a terminal.

A thread polls the coordinator's ``/status`` (``recent_epochs``, ``progress``) and prints
each epoch once, in order; on a terminal it also redraws one progress line in place
(phase, bar, ETA, each rank's rate). The launcher's other output (its children's log
lines) goes through ``emit`` so the bar never tears a line. Epochs the poll missed at the
very end (the coordinator exits right after its last one) are printed from the run
summary by ``finish``. A /status that cannot be read (not up yet, gone) is skipped: the
view is a display, the run never depends on it.
"""

from __future__ import annotations

import sys
import threading
from typing import Optional, TextIO

from . import statusfetch, statustable

__all__ = ["LiveView", "POLL_S"]

# Often enough that the bar moves smoothly; /status is rebuilt at most once per tick.
POLL_S = 0.25


class LiveView:
    def __init__(self, hostport: str, *, out: TextIO = sys.stdout, tty: Optional[bool] = None,
                 poll_s: float = POLL_S) -> None:  # fmt: skip
        self.hostport = hostport
        self.out = out
        self.tty = out.isatty() if tty is None else tty
        self.poll_s = poll_s
        self._printed = -1  # the last epoch printed
        self._num_epochs = 0
        self._bar = ""  # the progress line on screen (tty only)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="flodl-liveview", daemon=True)

    def start(self) -> "LiveView":
        self._thread.start()
        return self

    def emit(self, line: str) -> None:
        """Print ``line`` above the progress bar."""
        with self._lock:
            self._clear()
            print(line, file=self.out, flush=True)
            self._draw()

    def finish(self, summary: Optional[dict], num_epochs: int = 0) -> None:
        """Stop polling; print the epochs not shown yet from the run summary."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        with self._lock:
            self._clear()
            self._bar = ""
            if summary:
                n = self._num_epochs or num_epochs or len(summary.get("epochs", []))
                for row in summary.get("epochs", []):
                    if row.get("epoch", -1) > self._printed:
                        print(statustable.epoch_line(row, n), file=self.out, flush=True)
                        self._printed = row["epoch"]

    # -- the poller --------------------------------------------------------------------

    def _loop(self) -> None:
        while not self._stop.wait(self.poll_s):
            doc = self._fetch()
            if doc is not None:
                self._show(doc)

    def _fetch(self) -> Optional[dict]:
        try:
            doc = statusfetch.fetch(self.hostport, timeout=2)
        except statusfetch.StatusUnreachable:
            return None  # not serving yet, already gone, or gone mid-reply: nothing to show this time
        return doc if isinstance(doc, dict) and doc.get("schema_version") == statustable.SCHEMA_VERSION else None

    def _show(self, doc: dict) -> None:
        self._num_epochs = doc["progress"]["num_epochs"]
        with self._lock:
            self._clear()
            for e in doc.get("recent_epochs", []):
                if e["epoch"] > self._printed:
                    print(statustable.epoch_line(e, self._num_epochs, doc), file=self.out, flush=True)
                    self._printed = e["epoch"]
            if self.tty:
                self._bar = statustable.progress_line(doc)
            self._draw()

    def _clear(self) -> None:
        if self.tty and self._bar:
            self.out.write("\r\x1b[K")

    def _draw(self) -> None:
        if self.tty and self._bar:
            self.out.write(self._bar[:200])
            self.out.flush()
