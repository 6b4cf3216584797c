"""Commands: what the core asks the shell to do. Data, never callbacks.

The shell executes them in order. ``Send`` carries a ready protobuf ``Control`` (the
core numbers ``command_id``); broadcasts are expanded by the core into one ``Send``
per addressed rank, so "who got what" is visible in tests.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from flodl.wire import pb

__all__ = ["Command", "Send", "Reply", "OpenRound", "ForgetRank", "Notice", "RunFinished"]


@dataclass(frozen=True, slots=True)
class Command:
    pass


@dataclass(frozen=True, slots=True)
class Send(Command):
    """Deliver ``control`` to ``rank``. A failure comes back as a ``SendFailed`` event."""

    rank: int
    control: pb.Control

    @property
    def kind(self) -> str:
        return self.control.WhichOneof("cmd") or ""


@dataclass(frozen=True, slots=True)
class Reply(Command):
    """Answer a hello on the route it came from (a refused peer has no rank slot)."""

    route: tuple[bytes, ...]
    ack: pb.HelloAck


@dataclass(frozen=True, slots=True)
class OpenRound(Command):
    """Bus plane: the reducer should expect parameter contributions for ``cycle`` from ``ranks``."""

    cycle: int
    ranks: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class ForgetRank(Command):
    """The rank is gone (dead or exited): drop its route, drop it from any open round."""

    rank: int
    reason: str


@dataclass(frozen=True, slots=True)
class Notice(Command):
    """A decision worth telling the operator: logged as a structured record."""

    kind: str
    data: dict = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class RunFinished(Command):
    """The run is over (after the final Shutdown). ``summary`` is JSON-safe."""

    ok: bool
    reason: str
    summary: dict[str, Any] = field(default_factory=dict)
