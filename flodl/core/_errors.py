"""Typed errors: whose fault it was, and what the shell should do about it.

Theory of operation
-------------------
``step`` validates an event *before* it changes anything, so when it raises, the state
is exactly as it was (a test checks this). Two kinds of fault exist:

* ``RankViolation`` -- a peer sent something illegal (a batch outside its assignment,
  a rank id out of range). ``hint`` tells the shell what to do: ``"drop"`` the frame
  (and log once per peer), or ``"evict"`` the peer. Late or duplicate frames are *not*
  violations: they are normal races and are ignored silently (and counted).
* ``LocalViolation`` -- our own bug or a misuse of the core (a missing transition,
  a command addressed to a rank that is gone, an unsupported policy). The shell should
  crash loudly: continuing would break the journal's replay guarantee.

``ProtocolViolation`` is abstract, like h11's ``ProtocolError``.
"""

from __future__ import annotations

__all__ = ["ProtocolViolation", "RankViolation", "LocalViolation"]


class ProtocolViolation(Exception):
    """Base of the core's errors; never raised itself."""

    reason: str
    hint: str

    def __init__(self, reason: str, hint: str = "drop") -> None:
        if type(self) is ProtocolViolation:
            raise TypeError("ProtocolViolation is abstract: raise RankViolation or LocalViolation")
        super().__init__(reason)
        self.reason = reason
        self.hint = hint

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.reason!r}, hint={self.hint!r})"


class RankViolation(ProtocolViolation):
    """A rank (or its agent) sent something illegal. The state did not change."""


class LocalViolation(ProtocolViolation):
    """The core or its caller broke an internal rule. Not recoverable."""

    def __init__(self, reason: str, hint: str = "crash") -> None:
        super().__init__(reason, hint)
