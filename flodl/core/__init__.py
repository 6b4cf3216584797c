"""flodl.core: the coordinator's deterministic brain, with no I/O (h11 for our protocol).

    state = initial_state(CoreConfig(world_size=3))
    state, commands = step(state, RankHello(now=0.0, route=(b"r0",), rank=0, ...))

``step`` is the only entry point. Events carry ``now``; commands are data the shell
executes in order. Same state + same event => same new state and commands, so a
journal of events ``replay``s to the same state. ``step`` updates the state in place
and returns it.

Everything else lives in ``_``-prefixed modules; whatever is listed in ``__all__``
below is the public API.
"""

from ._commands import (
    CHECKPOINT_META,
    FINAL_SCHEDULE_ID,
    Command,
    ForgetRank,
    Notice,
    OpenRound,
    SeedJoiner,
    Reply,
    RunFinished,
    Send,
    StageCheckpoint,
)
from ._config import CoreConfig
from ._errors import LocalViolation, ProtocolViolation, RankViolation
from ._events import (
    BATCH_RECORDS,
    batches_in,
    BatchDone,
    BatchesDone,
    CheckpointDone,
    ChunkDone,
    EpochFnElapsed,
    EvalDone,
    Event,
    HeartbeatSeen,
    IntentRaised,
    RankExiting,
    RankExitReported,
    RankHello,
    SendFailed,
    StopRequested,
    StoreReady,
    CollectiveFailed,
    ContributionRefused,
    CoordinatorRestarted,
    RankResynced,
    JoinerSeeded,
    PartitionTrimmed,
    SyncAcked,
    Tick,
    UNPINNED,
    UNPLACED,
    from_record,
    to_record,
)
from ._formation import MAX_EXIT_LINE_CHARS, MAX_EXIT_LINES
from ._averaging import should_average
from ._checkpoint import ResumePoint, checkpoint_meta, resume_plan, validate_meta
from ._state import CoordinatorState
from ._phases import (
    ACTIVE,
    DEAD,
    FINAL_EVAL,
    FINISHED,
    FORMING,
    IDLE,
    JOINING,
    LEFT,
    MEMBERSHIP,
    PENDING,
    ROUND,
    RUN,
    SHUTTING_DOWN,
    STOPPING,
    TRAINING,
    VACANT,
    Sentinel,
    diagram,
)
from ._step import initial_state, replay, step
from ._drift import view_drift
from ._status_view import status_view
from ._translate import hello_event, hello_oversized, metrics_event, timing_event

__all__ = [
    "BATCH_RECORDS",
    "batches_in",
    "hello_event",
    "hello_oversized",
    "metrics_event",
    "timing_event",
    # entry points
    "initial_state",
    "step",
    "replay",
    "status_view",
    "view_drift",
    "should_average",
    "CoreConfig",
    "CoordinatorState",
    "FINAL_SCHEDULE_ID",
    # checkpoints and resume
    "checkpoint_meta",
    "validate_meta",
    "resume_plan",
    "ResumePoint",
    # events
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
    "UNPINNED",
    "UNPLACED",
    "MAX_EXIT_LINES",
    "MAX_EXIT_LINE_CHARS",
    "SendFailed",
    "StopRequested",
    "StoreReady",
    "JoinerSeeded",
    "PartitionTrimmed",
    "SeedJoiner",
    "CollectiveFailed",
    "ContributionRefused",
    "CoordinatorRestarted",
    "RankResynced",
    "to_record",
    "from_record",
    # commands
    "Command",
    "Send",
    "Reply",
    "OpenRound",
    "ForgetRank",
    "Notice",
    "StageCheckpoint",
    "CHECKPOINT_META",
    "RunFinished",
    # phases and their transition tables (``_phases``)
    "Sentinel",
    "VACANT",
    "JOINING",
    "ACTIVE",
    "DEAD",
    "LEFT",
    "IDLE",
    "PENDING",
    "FORMING",
    "TRAINING",
    "FINAL_EVAL",
    "SHUTTING_DOWN",
    "STOPPING",
    "FINISHED",
    "MEMBERSHIP",
    "ROUND",
    "RUN",
    "diagram",
    # errors
    "ProtocolViolation",
    "RankViolation",
    "LocalViolation",
]
