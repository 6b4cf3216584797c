"""Typed wire errors: every refusal names its cause.

A ``WireError`` is always the *peer's* fault (bad bytes, wrong session, replay):
the receiver drops the frame, counts it under ``reason`` and keeps serving.
"""

__all__ = [
    "WireError",
    "MalformedFrame",
    "VersionMismatch",
    "WrongSession",
    "OutOfSequence",
    "RouteMismatch",
    "BadTensor",
    "Oversized",
]


class WireError(Exception):
    """A frame was refused. ``reason`` is a short stable token for counters."""

    reason = "wire_error"

    def __init__(self, detail: str):
        super().__init__(f"{self.reason}: {detail}")
        self.detail = detail


class MalformedFrame(WireError):
    reason = "malformed"


class VersionMismatch(WireError):
    reason = "version_mismatch"


class WrongSession(WireError):
    reason = "wrong_session"


class OutOfSequence(WireError):
    reason = "out_of_sequence"


class RouteMismatch(WireError):
    reason = "route_mismatch"


class BadTensor(WireError):
    reason = "bad_tensor"


class Oversized(WireError):
    """A frame, or a field the receiver would keep (journal, logs), exceeds its limit."""

    reason = "oversized"
