"""Warnings about dropped frames, rate-limited per *reason* (the counters count every frame).

A peer that opens a new connection for every bad frame has a new route each time: a log
line per (route, reason) would be one line per frame. So the first frame dropped for a
reason is logged in full (with its route); later ones for that reason are only counted,
and at most once per ``interval_s`` a summary line says how many more there were::

    dropped frame from 72656c61792d/72616e6b2d31: route_mismatch: rank 1 is admitted on another route
    41873 more frames dropped for route_mismatch in the last 60s (last from 61676...: ...)

``flush(now)`` runs on every tick, so a burst that stops is still summarised; ``close``
logs what is left when the service stops.
"""

from __future__ import annotations

import logging
from collections import Counter

__all__ = ["DropLog", "SUMMARY_INTERVAL_S"]

SUMMARY_INTERVAL_S = 60.0


class DropLog:
    """``first`` formats the first line of a reason (with ``what``), ``more`` a summary
    (count, reason, seconds, the last ``what``); the service also rate-limits refused
    and deferred hellos with it, at their own level."""

    def __init__(
        self,
        log: logging.Logger,
        interval_s: float = SUMMARY_INTERVAL_S,
        *,
        level: int = logging.WARNING,
        first: str = "dropped frame from %s",
        more: str = "%d more frames dropped for %s in the last %.0fs (last from %s)",
    ) -> None:
        self.log = log
        self.interval_s = interval_s
        self.level, self.first, self.more = level, first, more
        self._window_start: dict[str, float] = {}  # reason -> start of its current summary window
        self._quiet: Counter[str] = Counter()  # frames not logged in the current window
        self._last: dict[str, str] = {}  # reason -> the latest unlogged frame's description

    def drop(self, reason: str, what: str, now: float) -> None:
        """One frame dropped for ``reason``; ``what`` says from where and why (one line)."""
        if reason not in self._window_start:
            self._window_start[reason] = now
            self.log.log(self.level, self.first, what)
            return
        self._quiet[reason] += 1
        self._last[reason] = what
        self.flush(now)

    def flush(self, now: float, *, force: bool = False) -> None:
        """Log one summary per reason whose window is over (every one, with ``force``)."""
        for reason in [r for r, n in self._quiet.items() if n]:
            start = self._window_start[reason]
            if force or now - start >= self.interval_s:
                self.log.log(
                    self.level, self.more,
                    self._quiet.pop(reason), reason, max(0.0, now - start), self._last.pop(reason),
                )
                self._window_start[reason] = now

    def close(self, now: float) -> None:
        self.flush(now, force=True)
