"""Commands: what the core asks the shell to do. Data, never callbacks.

The shell executes them in order. ``Send`` carries a protobuf ``Control`` (the core
numbers ``command_id``) -- ready, or as a recipe built when first read
(``Send.built``: a command to every rank of a large world); broadcasts are expanded
by the core into one ``Send`` per addressed rank, so "who got what" is visible in tests.
"""

from __future__ import annotations

from dataclasses import FrozenInstanceError, dataclass, field
from collections import deque
from functools import partial
from itertools import repeat
from typing import Any, Callable, Iterable

from flodl.wire import VARINT, pb, tag, varint

__all__ = [
    "Command",
    "Send",
    "LastWord",
    "Reply",
    "OpenRound",
    "ForgetRank",
    "SeedJoiner",
    "Notice",
    "StageCheckpoint",
    "RunFinished",
    "FINAL_SCHEDULE_ID",
    "CHECKPOINT_META",
    "Encoder",
    "command_id_field",
]

FINAL_SCHEDULE_ID = 2**64 - 1  # ExecuteEval.schedule_id of the run's closing eval (u64::MAX upstream)
CHECKPOINT_META = "checkpoint_meta"  # StageCheckpoint's kind, as the operator log has always named it


@dataclass(frozen=True, slots=True)
class Command:
    pass


_new = object.__new__
_set = object.__setattr__
_drain: Callable[[Iterable[Any]], Any] = partial(deque, maxlen=0)  # runs an iterator to its end, keeping nothing
_BULK = 32  # below this many Sends the maps cost more to set up than a plain loop


class Send(Command):
    """Deliver ``control`` to ``rank``. A failure comes back as a ``SendFailed`` event.

    ``Send(rank, control)`` carries a ready ``Control``. ``Send.built(rank, command_id,
    kind, build, args)`` carries the recipe instead: ``control`` is built on first read
    as ``build(pb.Control(command_id=command_id), *args)`` and kept. A dispatch, a round
    or a heartbeat addresses every rank: built eagerly, its N messages were most of the
    step's cost at thousands of ranks, and the shell builds each one once anyway, when
    it sends it. ``args`` must be values nothing changes later (numbers, tuples, a
    message nobody else holds), so a recipe read late builds what an eager one would.
    Frozen, compared by ``(rank, control)`` like the dataclass it replaces."""

    __slots__ = ("rank", "_body")  # _body: a Control, or (command_id, kind, build, args)
    __match_args__ = ("rank", "control")
    rank: int
    _body: Any

    def __init__(self, rank: int, control: pb.Control) -> None:
        _set(self, "rank", rank)
        _set(self, "_body", control)

    @classmethod
    def built(cls, rank: int, command_id: int, kind: str, build: Callable[..., None], args: tuple) -> "Send":
        s = _new(cls)
        _set(s, "rank", rank)
        _set(s, "_body", (command_id, kind, build, args, None))
        return s

    @classmethod
    def each(cls, ranks: Iterable[int], first_id: int, kind: str, build: Callable[..., None], args: tuple) -> list["Send"]:
        """``Send.built`` to each of ``ranks``, numbered from ``first_id`` in order. The
        same ``args`` for all: their message differs only in its ``command_id``, so its
        body is serialised once for all of them (``wire``)."""
        return cls.each_of(ranks, first_id, kind, build, repeat(args), _SharedBody(build))

    @classmethod
    def each_of(cls, ranks: Iterable[int], first_id: int, kind: str, build: Callable[..., None],
                args: Iterable[tuple], wire: "Encoder | None" = None) -> list["Send"]:  # fmt: skip
        """``Send.built`` to each of ``ranks`` with its own ``args`` (zipped), numbered in order.
        ``wire``: writes the message's bytes from ``(command_id, *args)`` without building
        it, the bytes ``build`` then ``SerializeToString`` give (``Send.wire``)."""
        ranks = ranks if type(ranks) is list else list(ranks)
        if len(ranks) < _BULK:  # (a heartbeat, a few ranks: a plain loop is cheaper)
            sends = []
            cid = first_id
            for rank, a in zip(ranks, args):
                s = _new(cls)
                _set(s, "rank", rank)
                _set(s, "_body", (cid, kind, build, a, wire))
                sends.append(s)
                cid += 1
            return sends
        # A dispatch makes thousands: the slots are filled by C-level maps, not a Python
        # loop (a third cheaper per Send); zip's truncation to the shorter is kept.
        bodies = list(zip(range(first_id, first_id + len(ranks)), repeat(kind), repeat(build), args, repeat(wire)))
        sends = list(map(_new, repeat(cls, len(bodies))))
        _drain(map(_set_rank, sends, ranks))
        _drain(map(_set_body, sends, bodies))
        return sends

    @property
    def control(self) -> pb.Control:
        body = self._body
        if type(body) is tuple:
            command_id, _, build, args, _ = body
            ctl = pb.Control(command_id=command_id)
            build(ctl, *args)
            _set(self, "_body", ctl)
            return ctl
        return body

    @property
    def wire(self) -> bytes:
        """``control`` serialised, as the shell sends it. A recipe with an encoder
        (``each_of``'s ``wire``; a broadcast's body, serialised once for all its Sends)
        writes the bytes without building the message: at a 4,096-rank epoch boundary,
        thousands of messages built and serialised one by one were most of the shell's
        work. The ``control`` is not built here (read it, and it is)."""
        body = self._body
        if type(body) is tuple and body[4] is not None:
            return body[4](body[0], *body[3])
        return self.control.SerializeToString()

    @property
    def recipe(self) -> "tuple[str, tuple] | None":
        """``(kind, args)`` of a recipe (``Send.built``), read without building its Control;
        None for a ready one (read ``control``)."""
        body = self._body
        return (body[1], body[3]) if type(body) is tuple else None

    @property
    def kind(self) -> str:
        body = self._body
        if type(body) is tuple:
            return body[1]
        return body.WhichOneof("cmd") or ""

    def __setattr__(self, name: str, value: Any) -> None:
        raise FrozenInstanceError(f"cannot assign to field {name!r}")

    def __delattr__(self, name: str) -> None:
        raise FrozenInstanceError(f"cannot delete field {name!r}")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Send) or other.__class__ is not self.__class__:
            return NotImplemented
        return self.rank == other.rank and self.control == other.control

    # A Control is unhashable: so was the dataclass.
    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"Send(rank={self.rank!r}, control={self.control!r})"

    def __reduce__(self) -> tuple:
        return (Send, (self.rank, self.control))


class LastWord(Send):
    """A ``Send`` to a rank that the same step forgets (a Shutdown that says why it is
    dropped). The shell resolves a Send's route after the step, when this rank has none
    any more: ``route`` is the one it had. Otherwise a Send like any other."""

    __slots__ = ("route",)
    route: tuple[bytes, ...]

    def __init__(self, rank: int, control: pb.Control, route: tuple[bytes, ...]) -> None:
        super().__init__(rank, control)
        _set(self, "route", tuple(route))

    def __eq__(self, other: object) -> bool:
        eq = super().__eq__(other)
        return eq if eq is NotImplemented or not eq else self.route == other.route  # type: ignore[attr-defined]

    def __repr__(self) -> str:
        return f"LastWord(rank={self.rank!r}, control={self.control!r}, route={self.route!r})"

    def __reduce__(self) -> tuple:
        return (LastWord, (self.rank, self.control, self.route))


Encoder = Callable[..., bytes]  # (command_id, *args) -> a Control's bytes


def command_id_field(command_id: int) -> bytes:
    """``Control.command_id`` (field 1) as protobuf writes it: first, none when 0."""
    return _ID_TAG + varint(command_id) if command_id else b""


class _SharedBody:
    """The body a broadcast's Sends share (``Send.each``: the same ``args`` for all):
    ``build(pb.Control(), *args)`` serialised on first use, for all of them, behind each
    one's own ``command_id`` -- field 1, which protobuf writes first, so these are
    ``control.SerializeToString()``'s bytes."""

    __slots__ = ("build", "_bytes")

    def __init__(self, build: Callable[..., None]) -> None:
        self.build = build
        self._bytes: bytes | None = None

    def __call__(self, command_id: int, *args: Any) -> bytes:
        data = self._bytes
        if data is None:
            ctl = pb.Control()
            self.build(ctl, *args)
            data = self._bytes = ctl.SerializeToString()
        return command_id_field(command_id) + data


_ID_TAG = tag(pb.Control.DESCRIPTOR.fields_by_name["command_id"].number, VARINT)

_set_rank = Send.__dict__["rank"].__set__  # the slots' own setters (frozen: __setattr__ refuses)
_set_body = Send.__dict__["_body"].__set__


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
