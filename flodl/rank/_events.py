"""Events the rank machine consumes and commands it returns.

Events are what happened to the rank (a frame arrived, a batch finished, a reduce
completed); commands are what the shell must do about it (send a timing frame, copy
the parameters, apply a consensus, save a checkpoint, leave). Both are small frozen
values; protobuf messages ride inside them unchanged (``flodl.wire.pb``), and tensors
only as opaque objects the machine never looks into (``ConsensusReady.arrays``).

Don't subclass these.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from flodl.wire import pb

__all__ = [
    # events
    "Event",
    "Admitted",
    "IncarnationSeen",
    "ControlReceived",
    "ConsensusReady",
    "BatchTrained",
    "SeedApplied",
    # commands
    "Command",
    "SendTiming",
    "SendMetrics",
    "TrainBatch",
    "TakeSnapshot",
    "ApplyConsensus",
    "AbandonRounds",
    "SaveCheckpoint",
    "RunEval",
    "RunEpochFn",
    "FormGroup",
    "Exit",
    "Drop",
    "Warn",
    # what ``next_action`` answers when there is nothing to train
    "Sentinel",
    "WAIT_PLAN",
    "WAIT_THROTTLE",
]


class Sentinel:
    """A named singleton (h11's): its repr is its name, compare it with ``is``."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


WAIT_PLAN = Sentinel("WAIT_PLAN")  # no plan to train: block (servicing frames) until one comes
WAIT_THROTTLE = Sentinel("WAIT_THROTTLE")  # Throttle: block until Update (or Shutdown)


# -- events ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Event:
    pass


@dataclass(frozen=True, slots=True, kw_only=True)
class Admitted(Event):
    """hello_ack accepted this rank, and the shell built its model from ``spec``.
    ``global_step``: the checkpoint's, when the run resumed from one. ``hello_resent``:
    the hello went out more than once before this answer (an ack may have been lost
    with a coordinator that restarted meanwhile: the machine reports at once)."""

    spec: pb.RunSpec
    global_step: int = 0
    hello_resent: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class IncarnationSeen(Event):
    """A valid frame of the coordinator arrived, stamped with its ``incarnation``; fed
    before the frame is handled. ``hello_ack``: the frame is one."""

    incarnation: int
    hello_ack: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class ControlReceived(Event):
    control: pb.Control


@dataclass(frozen=True, slots=True, kw_only=True)
class ConsensusReady(Event):
    """The consensus of ``cycle`` is here (a bus round, a finished all-reduce).
    ``arrays`` None: this rank's work is not in it (weight 0, its fold was dropped, the
    reduce failed or was abandoned): keep the local parameters and the credit."""

    cycle: int
    arrays: Any = None


@dataclass(frozen=True, slots=True, kw_only=True)
class SeedApplied(Event):
    """A rank admitted into a running world (``RunSpec.join_running``): the shell loaded
    the seed consensus of ``cycle`` (``RoundHeader.seed``) into the parameters."""

    cycle: int


@dataclass(frozen=True, slots=True, kw_only=True)
class BatchTrained(Event):
    """The shell trained the ``TrainBatch`` it was handed (one optimizer step)."""

    epoch: int
    offset: int
    samples: int
    batch_ms: float = 0.0
    data_ms: float = 0.0
    loss: float = 0.0
    lr: float = 0.0


@dataclass(frozen=True, slots=True, kw_only=True)
class HeartbeatDue(Event):
    """A heartbeat interval passed since the rank's last timing frame (the shell keeps
    the clock: every timing frame it sends resets it). The machine answers with the
    batches it holds unreported, if any -- that report is the heartbeat -- else with a
    ``heartbeat``."""


# -- commands --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Command:
    pass


@dataclass(frozen=True, slots=True, kw_only=True)
class SendTiming(Command):
    """Send ``timing.<kind> = body`` (``pb.Timing(rank=..., **{kind: body})``)."""

    kind: str
    body: Any


@dataclass(frozen=True, slots=True, kw_only=True)
class SendMetrics(Command):
    """A plan was trained to its end: send its ``metrics``."""

    metrics: pb.Metrics


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainBatch(Command):
    """Train positions ``perm(epoch)[offset:offset+count]`` now, then feed ``BatchTrained``."""

    epoch: int
    offset: int
    count: int


@dataclass(frozen=True, slots=True, kw_only=True)
class TakeSnapshot(Command):
    """``RequestParams{cycle}``: deep-copy the parameters and contribute them with
    ``weight`` (n = steps since the last applied average, weight = n**gamma, 0 idle)."""

    cycle: int
    n: int
    step_count: int
    weight: float


@dataclass(frozen=True, slots=True, kw_only=True)
class ApplyConsensus(Command):
    """Apply the consensus ``arrays`` of ``cycle`` against its snapshot (None: keep
    local), then send ``sync_ack{cycle, step_count=ack_step}`` with the norms.
    ``moved``: the rank stepped since the snapshot (keep those steps on top)."""

    cycle: int
    arrays: Any
    ack_step: int
    moved: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class AbandonRounds(Command):
    """The coordinator restarted: these cycles' rounds died with it; drop their
    snapshots (and pending reduces) without an ack."""

    cycles: tuple[int, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class SaveCheckpoint(Command):
    """Save the model for ``command`` and answer ``checkpoint_result``. ``params``: the
    held consensus arrays to save as the parameters (None: the parameters as they are)."""

    command: pb.Control.Checkpoint
    params: Any = None


@dataclass(frozen=True, slots=True, kw_only=True)
class RunEval(Command):
    command: pb.Control.ExecuteEval


@dataclass(frozen=True, slots=True, kw_only=True)
class RunEpochFn(Command):
    """This rank holds the epoch-callback role: run ``epoch_fn`` (if any) and answer
    ``epoch_fn_elapsed``."""

    metrics: pb.EpochMetrics


@dataclass(frozen=True, slots=True, kw_only=True)
class FormGroup(Command):
    """Collective plane: a ``Rendezvous`` for the process-group shell."""

    command: pb.Control.Rendezvous


@dataclass(frozen=True, slots=True, kw_only=True)
class Exit(Command):
    """``Shutdown``/``ShutdownWithSave``: send ``exiting`` and leave cleanly (exit 0)."""

    reason: str
    steps: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Drop(Command):
    """A frame (or the part of it this event carried) is refused: count it by
    ``reason``. After ``IncarnationSeen``, the frame is not handled at all."""

    reason: str
    detail: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class Warn(Command):
    """Something the operator should read (the shell logs it at WARNING)."""

    text: str
    level: str = "warning"  # or "info"

