"""Every public name of ``flodl.core``, imported eagerly: what ``flodl.core`` loads on the
first use of one of them (``flodl/core/__init__.py``: why not at its own import)."""

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
    LastWord,
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
    RankRefused,
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
from ._translate import chunk_events, hello_event, hello_oversized, metrics_event, timing_event
