"""Commands: what the core asks the shell to do. Data, never callbacks.

The shell executes them in order. ``Send`` carries a ready protobuf ``Control`` (the
core numbers ``command_id``); broadcasts are expanded by the core into one ``Send``
per addressed rank, so "who got what" is visible in tests.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from flodl.wire import pb

__all__ = [
    "Command",
    "Send",
    "Reply",
    "OpenRound",
    "ForgetRank",
    "SeedJoiner",
    "Notice",
    "StageCheckpoint",
    "RunFinished",
    "FINAL_SCHEDULE_ID",
    "CHECKPOINT_META",
]

FINAL_SCHEDULE_ID = 2**64 - 1  # ExecuteEval.schedule_id of the run's closing eval (u64::MAX upstream)
CHECKPOINT_META = "checkpoint_meta"  # StageCheckpoint's kind, as the operator log has always named it


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
    """Bus plane: the reducer should expect parameter contributions for ``cycle`` from ``ranks``.

    ``steps[i]``: the steps of ``ranks[i]`` that no consensus had folded when the round
    opened -- a floor on the ``n`` its snapshot counts (it snapshots after the trigger),
    so its weight ``n**gamma`` is at least ``steps[i]**gamma``; the reducer checks a
    contribution's claimed weight against it (``flodl_coordinator.reducer``). Not part
    of equality: it is derived from the state, like the ranks' order."""

    cycle: int
    ranks: tuple[int, ...]
    steps: tuple[int, ...] = field(default=(), compare=False)


@dataclass(frozen=True, slots=True)
class SeedJoiner(Command):
    """Bus plane: send ``rank`` (admitted into a running world) the latest consensus the
    reducer sent -- a ``RoundHeader{seed}`` frame; with none yet (the service restarted
    since), the next one. The rank answers ``Timing.seeded`` (``JoinerSeeded``)."""

    rank: int


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
class StageCheckpoint(Notice):
    """The shell must stage ``meta`` for checkpoint ``version`` (the ``Checkpoint``
    command to the saving rank goes out with it): an order, not a notice.

    Built with ``StageCheckpoint.of(version, meta)``. It is a ``Notice`` of kind
    ``"checkpoint_meta"`` only so the decision log keeps its record (``data`` is
    ``{"version", "meta"}``); the shell matches it by type (``isinstance``), never by
    kind, before it logs notices."""

    @classmethod
    def of(cls, version: int, meta: dict) -> "StageCheckpoint":
        return cls(CHECKPOINT_META, {"version": int(version), "meta": meta})

    @property
    def version(self) -> int:
        return int(self.data["version"])

    @property
    def meta(self) -> dict:
        return self.data["meta"]


@dataclass(frozen=True, slots=True)
class RunFinished(Command):
    """The run is over (after the final Shutdown). ``summary`` is JSON-safe."""

    ok: bool
    reason: str
    summary: dict[str, Any] = field(default_factory=dict)
