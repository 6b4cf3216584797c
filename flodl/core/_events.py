"""Events: everything that can happen to the coordinator, as small immutable values.

Theory of operation
-------------------
The service shell decodes a wire frame (or notices time passing, a failed send, an
agent's report) and turns it into exactly one of these events; ``step(state, event)``
is the only thing that consumes them. Every event carries ``now`` (seconds, float,
monotonic in the service): the core never reads a clock, so a journal of events
replays to the same state bit for bit.

Events hold only plain values (ints, floats, str, bytes, tuples) so that
``to_record``/``from_record`` can journal them as JSON and ``repr`` is valid Python
(a failing hypothesis run prints a paste-able regression).

Don't subclass these.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any, Optional

__all__ = [
    "Event",
    "Tick",
    "RankHello",
    "BatchDone",
    "BatchesDone",
    "SyncAcked",
    "ChunkDone",
    "RankExiting",
    "HeartbeatSeen",
    "EvalDone",
    "CheckpointDone",
    "EpochFnElapsed",
    "IntentRaised",
    "RankExitReported",
    "SendFailed",
    "RankRefused",
    "StopRequested",
    "StoreReady",
    "CollectiveFailed",
    "ContributionRefused",
    "CoordinatorRestarted",
    "RankResynced",
    "JoinerSeeded",
    "PartitionTrimmed",
    "EVENT_TYPES",
    "UNPINNED",
    "UNPLACED",
    "to_record",
    "from_record",
]


# ``RankHello.rank`` of a hello whose agent did not pin it: the core picks the slot.
UNPINNED = -1
# ``RankExitReported.rank`` of an unpinned process that ended before it held a slot.
UNPLACED = -1


@dataclass(frozen=True, slots=True, kw_only=True)
class Event:
    now: float


@dataclass(frozen=True, slots=True, kw_only=True)
class Tick(Event):
    """Time passed. The shell feeds one at least every ``tick_interval_s``."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RankHello(Event):
    """A rank asks to join. ``route`` is the ZeroMQ identity stack it arrived on."""

    route: tuple[bytes, ...]
    rank: int
    world_size: int
    model_sig: bytes
    dataset_len: int
    host: str = ""
    pid: int = 0
    incarnation: int = 0
    restart_count: int = 0  # FLODL_RESTART_COUNT: the agent started this rank again this many times
    # Unpinned (issue 12): ``rank`` is ``UNPINNED`` (-1) and the core gives the lowest free
    # slot; ``agent`` (its agent's token digest) and ``local_rank`` (FLODL_LOCAL_RANK) name
    # the process slot of its agent, so a restarted process gets its old slot back and
    # the agent's exit report finds it.
    local_rank: int = -1
    agent: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class BatchDone(Event):
    """One optimizer step on a rank, trained on positions [offset, offset+samples) of epoch."""

    rank: int
    batch_ms: float
    data_ms: float
    step_count: int
    loss: float
    samples: int
    epoch: int
    offset: int
    lr: float = 0.0
    sync_divergence: Optional[float] = None
    wait_ms: float = 0.0  # idle waiting for a plan before this batch (``Timing.Batch.wait_ms``)


@dataclass(frozen=True, slots=True, kw_only=True)
class BatchesDone(Event):
    """Consecutive optimizer steps of one rank in one frame (``Timing.batches``), in step
    order: each is the ``BatchDone`` a frame of its own would have been (same ``now`` and
    rank). One event, so the rules settle once for the frame, not once per batch."""

    rank: int
    batches: tuple[BatchDone, ...] = ()

    def __post_init__(self) -> None:  # a journal record holds a list of dicts
        if not all(type(b) is BatchDone for b in self.batches):
            object.__setattr__(self, "batches", tuple(_batch_done(b) for b in self.batches))


@dataclass(frozen=True, slots=True, kw_only=True)
class SyncAcked(Event):
    """A rank applied the consensus of ``cycle``; its steps up to ``step_count`` are folded in."""

    rank: int
    cycle: int
    step_count: int
    divergence: Optional[float] = None
    pre_norm: Optional[float] = None
    post_norm: Optional[float] = None


@dataclass(frozen=True, slots=True, kw_only=True)
class ChunkDone(Event):
    """A rank finished one plan (a whole partition under Sync, one chunk when progressive)."""

    rank: int
    epoch: int
    chunk_seq: int
    batches: int
    samples: int
    avg_loss: float
    epoch_ms: float
    share_complete_ms: float = 0.0
    compute_only_ms: float = 0.0
    data_starve_ms: float = 0.0
    scalars: tuple[tuple[str, float, int], ...] = ()  # (name, sum, count)


@dataclass(frozen=True, slots=True, kw_only=True)
class RankExiting(Event):
    """Clean completion: the rank leaves after Shutdown. Not a death."""

    rank: int
    param_digest: str = ""  # hex sha256 of its final parameters
    steps: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class HeartbeatSeen(Event):
    rank: int
    step_count: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class EvalDone(Event):
    rank: int
    schedule_id: int
    epoch: int
    metric: float
    elapsed_ms: float = 0.0
    error: Optional[str] = None
    final: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckpointDone(Event):
    rank: int
    version: int
    elapsed_ms: float = 0.0
    error: Optional[str] = None


@dataclass(frozen=True, slots=True, kw_only=True)
class EpochFnElapsed(Event):
    """The epoch role ran the user's epoch function for ``epoch``; it took ``elapsed_ms``
    of the rank's wall time (smoothed into the callback slack, ``_slack``)."""

    rank: int
    epoch: int
    elapsed_ms: float


@dataclass(frozen=True, slots=True, kw_only=True)
class IntentRaised(Event):
    rank: int
    kind: str  # "eval" | "checkpoint"


@dataclass(frozen=True, slots=True, kw_only=True)
class RankExitReported(Event):
    """The host agent saw the rank's process end (``code`` < 0: killed by that signal).
    ``restart_count``: which process of the rank (its ``FLODL_RESTART_COUNT``);
    ``restarting``: the agent starts it again (``--max-restarts`` left); ``last_lines``: its
    last stderr lines (a traceback's end). ``rank`` is ``UNPLACED`` (-1) for a process its
    agent did not pin that ended before any slot was its own: ``agent`` (the agent's
    token digest) and ``local_rank`` name it instead (``_formation``)."""

    rank: int
    code: int
    restart_count: int = 0
    restarting: bool = False
    last_lines: tuple[str, ...] = ()
    local_rank: int = -1
    agent: str = ""

    def __post_init__(self) -> None:  # a journal record holds a list
        object.__setattr__(self, "last_lines", tuple(self.last_lines))


@dataclass(frozen=True, slots=True, kw_only=True)
class SendFailed(Event):
    """The shell could not deliver a command to ``rank`` (ROUTER_MANDATORY: peer unroutable)."""

    rank: int
    what: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class RankRefused(Event):
    """The shell refuses a member's frames from now on (``reason`` says why and how to fix
    it): a coordinator restarted as a newer release finds a rank too old to follow it. The
    core tells the rank why (a ``LastWord``) and loses it, handing its work to the others."""

    rank: int
    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class StopRequested(Event):
    """The operator asked the service to stop (SIGTERM)."""

    reason: str = "stop requested"


@dataclass(frozen=True, slots=True, kw_only=True)
class JoinerSeeded(Event):
    """A rank admitted into a running world holds the seed consensus of ``cycle``
    (``Timing.seeded``): it becomes a member and gets work (``_membership.on_seeded``)."""

    rank: int
    cycle: int


@dataclass(frozen=True, slots=True, kw_only=True)
class StoreReady(Event):
    """Collective plane: the store host of ``generation`` serves its TCPStore at ``addr``."""

    rank: int
    generation: int
    addr: str


@dataclass(frozen=True, slots=True, kw_only=True)
class CollectiveFailed(Event):
    """Collective plane: the process group of ``generation`` failed on ``rank`` (while
    forming, ``cycle`` 0, or in the all-reduce of ``cycle``); it must be re-formed.
    ``seeding``: it was the generation's seed broadcast to its joiners that failed."""

    rank: int
    generation: int
    cycle: int = 0
    reason: str = ""
    seeding: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class ContributionRefused(Event):
    """Bus plane: the reducer refused ``rank``'s contribution to the open round ``cycle``
    (non-finite or malformed tensors, a weight its steps do not explain, too far from the
    last consensus: ``reason``). The round completes without it and the rank is sent the
    consensus to reset to; the window its ack names is discarded, not committed: its
    positions go back to be trained again (``_averaging.on_ack``). The rank stays in."""

    rank: int
    cycle: int
    reason: str = ""


def _slot_setter(cls: type, name: str) -> Any:
    return next(k.__dict__[name] for k in cls.__mro__ if name in k.__dict__).__set__


# Each BatchDone field's slot setter, by name: what ``_translate`` builds a frame's
# batches with (``object.__new__`` then one C-level set per field: 1.7 us a batch, where
# the frozen dataclass's ``__init__``, which sets each field through ``object.__setattr__``
# in Python, took 3.5). Whoever builds so sets every field (tests/unit/core/test_translate_batches.py).
BATCH_DONE_SETTERS = {name: _slot_setter(BatchDone, name) for name in BatchDone.__dataclass_fields__}


def _batch_done(b: "BatchDone | dict") -> BatchDone:
    return b if isinstance(b, BatchDone) else BatchDone(**b)


def _tuples(v):
    return tuple(_tuples(x) for x in v) if isinstance(v, (list, tuple)) else v


@dataclass(frozen=True, slots=True, kw_only=True)
class CoordinatorRestarted(Event):
    """The service restarted on its journal (after replaying it), or a relay restarted
    and the frames inside it are lost (``cause="relay"``: the same resynchronisation).
    ``incarnation`` is the coordinator's new one (informational)."""

    incarnation: int = 0
    cause: str = "coordinator"  # "coordinator" | "relay" (summary rows say which)


@dataclass(frozen=True, slots=True, kw_only=True)
class RankResynced(Event):
    """A rank's ``Timing.Resync``: what a restarted coordinator may have lost.

    ``batches``: ``(step_count, epoch, offset, samples, batch_ms, data_ms, loss, lr)``
    for every step after ``folded_step``; ``held``: ``(epoch, offset, size)`` not trained
    yet, in order; ``chunks``: finished chunks ``(epoch, chunk_seq, batches, samples,
    avg_loss, epoch_ms, share_complete_ms, compute_only_ms, data_starve_ms)``.
    """

    rank: int
    last_command_id: int = 0
    local_step: int = 0
    folded_step: int = 0
    throttled: bool = False
    idle: bool = False
    batches: tuple[tuple, ...] = ()
    held: tuple[tuple[int, int, int], ...] = ()
    chunks: tuple[tuple, ...] = ()

    def __post_init__(self) -> None:  # a journal record holds lists: make them tuples
        for name in ("batches", "held", "chunks"):
            object.__setattr__(self, name, _tuples(getattr(self, name)))


@dataclass(frozen=True, slots=True, kw_only=True)
class PartitionTrimmed(Event):
    """A rank's answer to ``TrimPartition`` (command ``command_id``): ``released``,
    ``(offset, size)`` positions of ``epoch`` it held untrained and gave back (it will
    never train them); ``kept``: the samples of ``epoch`` it still holds
    (``_repartition``)."""

    rank: int
    command_id: int
    epoch: int
    kept: int = 0
    released: tuple[tuple[int, int], ...] = ()

    def __post_init__(self) -> None:  # a journal record holds lists: make them tuples
        object.__setattr__(self, "released", _tuples(self.released))


EVENT_TYPES = {
    cls.__name__: cls
    for cls in (
        Tick,
        RankHello,
        BatchDone,
        BatchesDone,
        SyncAcked,
        ChunkDone,
        RankExiting,
        HeartbeatSeen,
        EvalDone,
        CheckpointDone,
        EpochFnElapsed,
        IntentRaised,
        RankExitReported,
        SendFailed,
        RankRefused,
        StopRequested,
        StoreReady,
        CollectiveFailed,
        ContributionRefused,
        CoordinatorRestarted,
        RankResynced,
        JoinerSeeded,
        PartitionTrimmed,
    )
}


# Journal record types that report trained batches (readers of journals: tests, benches).
BATCH_RECORDS = ("BatchDone", "BatchesDone")


def batches_in(rec: dict) -> int:
    """How many trained batches a journal record reports (0: not a batch report)."""
    kind = rec.get("type")
    return 1 if kind == "BatchDone" else len(rec.get("batches", ())) if kind == "BatchesDone" else 0


def to_record(ev: Event) -> dict:
    """JSON-safe dict: bytes become hex strings, tuples become lists."""
    rec = {"type": type(ev).__name__}
    for k, v in asdict(ev).items():
        if isinstance(v, bytes):
            v = {"hex": v.hex()}
        elif k == "route":
            v = [{"hex": b.hex()} for b in v]
        rec[k] = v
    return rec


def from_record(rec: dict) -> Event:
    """Inverse of ``to_record``; raises ValueError naming the defect."""
    rec = dict(rec)
    name = rec.pop("type", None)
    cls = EVENT_TYPES.get(name)
    if cls is None:
        raise ValueError(f"unknown event type {name!r}")
    kw = {}
    names = {f.name for f in fields(cls)}
    for k, v in rec.items():
        if k not in names:
            raise ValueError(f"{name}: unknown field {k!r}")
        if isinstance(v, dict) and "hex" in v:
            v = bytes.fromhex(v["hex"])
        elif k == "route":
            v = tuple(bytes.fromhex(x["hex"]) for x in v)
        elif k == "scalars":
            v = tuple(tuple(x) for x in v)
        kw[k] = v
    return cls(**kw)
