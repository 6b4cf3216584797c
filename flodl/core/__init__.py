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

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the names, for type checkers; at run time __getattr__ below loads them
    from ._api import *  # noqa: F403

__all__ = [
    "BATCH_RECORDS",
    "batches_in",
    "hello_event",
    "hello_oversized",
    "metrics_event",
    "chunk_events",
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
    "RankRefused",
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
    "LastWord",
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


def __getattr__(name: str) -> Any:
    """The core is loaded on the first use of a public name (PEP 562), not when the
    package is: ``flodl.core._config`` alone -- the settings schema, all that `flodl run`
    needs before it starts the processes -- then costs no import of the rest (0.45 s of
    protobuf, numpy and the policies, on the path to a run's first batch)."""
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from . import _api

    globals().update({n: getattr(_api, n) for n in __all__})
    return globals()[name]
