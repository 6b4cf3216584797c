"""``TimeAccount``: where a rank's wall time went, by cause (goodput and badput).

Theory of operation
-------------------
A stopwatch with one hand per cause and exactly one hand running at a time. The shell
says what the rank is doing now (``enter(cause, now)``, or ``during(cause, now)`` /
``leave(now)`` around a nested activity); the time since the last switch goes to the
cause that was running. No span is timed on its own, so there are no gaps: the causes
add up to the time since ``start`` by construction, and ``wall_s`` (measured apart, as
``now - start``) is what a reader checks them against.

Causes (``CAUSES``): ``training`` and ``calibration`` (training in the first window,
before any consensus, on the policies that calibrate) are goodput; ``barrier`` (waiting
for a plan or throttled), ``averaging`` (exposed on the training thread), ``recovery``
(waiting after a death or a coordinator/relay restart, until the next consensus),
``checkpoint``, ``eval`` and ``startup`` (before the first plan) are badput.

Nothing here reads a clock: ``now`` is the shell's, in seconds.
"""

from __future__ import annotations

from flodl.wire import pb

__all__ = ["TimeAccount", "CAUSES", "GOODPUT_CAUSES"]

CAUSES = ("training", "calibration", "barrier", "averaging", "recovery", "checkpoint", "eval", "startup")
GOODPUT_CAUSES = frozenset({"training", "calibration"})


class TimeAccount:
    def __init__(self, now: float, cause: str = "startup") -> None:
        self._check(cause)
        self.start = now
        self.seconds = dict.fromkeys(CAUSES, 0.0)
        self.cause = cause
        self._since = now
        self._stack: list[str] = []  # causes interrupted by ``during``

    @staticmethod
    def _check(cause: str) -> None:
        if cause not in CAUSES:
            raise ValueError(f"unknown time cause {cause!r}; one of {', '.join(CAUSES)}")

    def _charge(self, now: float) -> None:
        # A clock that stepped back charges nothing (never a negative span).
        if now > self._since:
            self.seconds[self.cause] += now - self._since
            self._since = now

    def enter(self, cause: str, now: float) -> None:
        """From ``now`` on the rank is doing ``cause``."""
        self._check(cause)
        self._charge(now)
        self.cause = cause

    def during(self, cause: str, now: float) -> None:
        """A nested activity starts (checkpoint, eval, averaging): ``leave`` goes back."""
        self._stack.append(self.cause)
        self.enter(cause, now)

    def leave(self, now: float) -> None:
        self.enter(self._stack.pop() if self._stack else "training", now)

    def totals(self, now: float) -> dict[str, float]:
        """Seconds per cause up to ``now`` (the running one included)."""
        self._charge(now)
        return dict(self.seconds)

    def to_pb(self, now: float) -> pb.TimeAccount:
        t = self.totals(now)
        return pb.TimeAccount(wall_s=max(0.0, now - self.start), **{f"{c}_s": s for c, s in t.items()})
