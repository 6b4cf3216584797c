from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Policy(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    POLICY_UNSPECIFIED: _ClassVar[Policy]
    POLICY_SYNC: _ClassVar[Policy]
    POLICY_CADENCE: _ClassVar[Policy]
    POLICY_ASYNC: _ClassVar[Policy]

class Plane(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PLANE_UNSPECIFIED: _ClassVar[Plane]
    PLANE_BUS: _ClassVar[Plane]
    PLANE_COLLECTIVE: _ClassVar[Plane]

class SaveReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SAVE_REASON_GRACEFUL_SHUTDOWN: _ClassVar[SaveReason]
    SAVE_REASON_MAX_FAILURE_EXCEEDED: _ClassVar[SaveReason]
    SAVE_REASON_SINGLE_SURVIVOR: _ClassVar[SaveReason]
    SAVE_REASON_ALL_RANKS_LOST: _ClassVar[SaveReason]
    SAVE_REASON_REDUCE_STALL: _ClassVar[SaveReason]
    SAVE_REASON_CHECKPOINT: _ClassVar[SaveReason]

class IntentKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    INTENT_KIND_UNSPECIFIED: _ClassVar[IntentKind]
    INTENT_KIND_EVAL_NOW: _ClassVar[IntentKind]
    INTENT_KIND_CHECKPOINT_NOW: _ClassVar[IntentKind]

class RoundKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROUND_KIND_MODEL: _ClassVar[RoundKind]
    ROUND_KIND_CONTROL: _ClassVar[RoundKind]

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_F32: _ClassVar[DType]
    DTYPE_BF16: _ClassVar[DType]

class RoundPhase(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROUND_PHASE_UNSPECIFIED: _ClassVar[RoundPhase]
    ROUND_PHASE_PARAMS: _ClassVar[RoundPhase]
    ROUND_PHASE_BUFFERS: _ClassVar[RoundPhase]
    ROUND_PHASE_BOOTSTRAP: _ClassVar[RoundPhase]
POLICY_UNSPECIFIED: Policy
POLICY_SYNC: Policy
POLICY_CADENCE: Policy
POLICY_ASYNC: Policy
PLANE_UNSPECIFIED: Plane
PLANE_BUS: Plane
PLANE_COLLECTIVE: Plane
SAVE_REASON_GRACEFUL_SHUTDOWN: SaveReason
SAVE_REASON_MAX_FAILURE_EXCEEDED: SaveReason
SAVE_REASON_SINGLE_SURVIVOR: SaveReason
SAVE_REASON_ALL_RANKS_LOST: SaveReason
SAVE_REASON_REDUCE_STALL: SaveReason
SAVE_REASON_CHECKPOINT: SaveReason
INTENT_KIND_UNSPECIFIED: IntentKind
INTENT_KIND_EVAL_NOW: IntentKind
INTENT_KIND_CHECKPOINT_NOW: IntentKind
ROUND_KIND_MODEL: RoundKind
ROUND_KIND_CONTROL: RoundKind
DTYPE_F32: DType
DTYPE_BF16: DType
ROUND_PHASE_UNSPECIFIED: RoundPhase
ROUND_PHASE_PARAMS: RoundPhase
ROUND_PHASE_BUFFERS: RoundPhase
ROUND_PHASE_BOOTSTRAP: RoundPhase

class Sender(_message.Message):
    __slots__ = ("kind", "rank", "host", "incarnation")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        KIND_UNSPECIFIED: _ClassVar[Sender.Kind]
        KIND_RANK: _ClassVar[Sender.Kind]
        KIND_RELAY: _ClassVar[Sender.Kind]
        KIND_AGENT: _ClassVar[Sender.Kind]
        KIND_COORDINATOR: _ClassVar[Sender.Kind]
    KIND_UNSPECIFIED: Sender.Kind
    KIND_RANK: Sender.Kind
    KIND_RELAY: Sender.Kind
    KIND_AGENT: Sender.Kind
    KIND_COORDINATOR: Sender.Kind
    KIND_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    kind: Sender.Kind
    rank: int
    host: str
    incarnation: int
    def __init__(self, kind: _Optional[_Union[Sender.Kind, str]] = ..., rank: _Optional[int] = ..., host: _Optional[str] = ..., incarnation: _Optional[int] = ...) -> None: ...

class Envelope(_message.Message):
    __slots__ = ("protocol_major", "protocol_minor", "session", "sender", "seq", "blob_count", "control", "timing", "metrics", "hello", "hello_ack", "round", "relay", "agent")
    PROTOCOL_MAJOR_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_MINOR_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    SENDER_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    BLOB_COUNT_FIELD_NUMBER: _ClassVar[int]
    CONTROL_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    HELLO_FIELD_NUMBER: _ClassVar[int]
    HELLO_ACK_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    RELAY_FIELD_NUMBER: _ClassVar[int]
    AGENT_FIELD_NUMBER: _ClassVar[int]
    protocol_major: int
    protocol_minor: int
    session: str
    sender: Sender
    seq: int
    blob_count: int
    control: Control
    timing: Timing
    metrics: Metrics
    hello: RankHello
    hello_ack: HelloAck
    round: RoundHeader
    relay: RelayMsg
    agent: AgentMsg
    def __init__(self, protocol_major: _Optional[int] = ..., protocol_minor: _Optional[int] = ..., session: _Optional[str] = ..., sender: _Optional[_Union[Sender, _Mapping]] = ..., seq: _Optional[int] = ..., blob_count: _Optional[int] = ..., control: _Optional[_Union[Control, _Mapping]] = ..., timing: _Optional[_Union[Timing, _Mapping]] = ..., metrics: _Optional[_Union[Metrics, _Mapping]] = ..., hello: _Optional[_Union[RankHello, _Mapping]] = ..., hello_ack: _Optional[_Union[HelloAck, _Mapping]] = ..., round: _Optional[_Union[RoundHeader, _Mapping]] = ..., relay: _Optional[_Union[RelayMsg, _Mapping]] = ..., agent: _Optional[_Union[AgentMsg, _Mapping]] = ...) -> None: ...

class RankHello(_message.Message):
    __slots__ = ("rank", "world_size", "model_sig", "dataset_len", "host", "pid", "bf16_wire", "task", "agent_token", "restart_count", "unpinned_slot")
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    MODEL_SIG_FIELD_NUMBER: _ClassVar[int]
    DATASET_LEN_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    BF16_WIRE_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    AGENT_TOKEN_FIELD_NUMBER: _ClassVar[int]
    RESTART_COUNT_FIELD_NUMBER: _ClassVar[int]
    UNPINNED_SLOT_FIELD_NUMBER: _ClassVar[int]
    rank: int
    world_size: int
    model_sig: bytes
    dataset_len: int
    host: str
    pid: int
    bf16_wire: bool
    task: str
    agent_token: bytes
    restart_count: int
    unpinned_slot: int
    def __init__(self, rank: _Optional[int] = ..., world_size: _Optional[int] = ..., model_sig: _Optional[bytes] = ..., dataset_len: _Optional[int] = ..., host: _Optional[str] = ..., pid: _Optional[int] = ..., bf16_wire: _Optional[bool] = ..., task: _Optional[str] = ..., agent_token: _Optional[bytes] = ..., restart_count: _Optional[int] = ..., unpinned_slot: _Optional[int] = ...) -> None: ...

class RunSpec(_message.Message):
    __slots__ = ("world_size", "total_samples", "batch_size", "num_epochs", "seed", "policy", "plane", "gamma", "easgd_alpha", "bf16_wire", "heartbeat_interval_s", "liveness_timeout_s", "start_epoch", "resume_from", "join_running", "global_step", "samples_committed", "batch_report_ms", "report_batches", "report_floor_ms", "batches_in_metrics")
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    TOTAL_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_EPOCHS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    PLANE_FIELD_NUMBER: _ClassVar[int]
    GAMMA_FIELD_NUMBER: _ClassVar[int]
    EASGD_ALPHA_FIELD_NUMBER: _ClassVar[int]
    BF16_WIRE_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    LIVENESS_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    START_EPOCH_FIELD_NUMBER: _ClassVar[int]
    RESUME_FROM_FIELD_NUMBER: _ClassVar[int]
    JOIN_RUNNING_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_STEP_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_COMMITTED_FIELD_NUMBER: _ClassVar[int]
    BATCH_REPORT_MS_FIELD_NUMBER: _ClassVar[int]
    REPORT_BATCHES_FIELD_NUMBER: _ClassVar[int]
    REPORT_FLOOR_MS_FIELD_NUMBER: _ClassVar[int]
    BATCHES_IN_METRICS_FIELD_NUMBER: _ClassVar[int]
    world_size: int
    total_samples: int
    batch_size: int
    num_epochs: int
    seed: int
    policy: Policy
    plane: Plane
    gamma: float
    easgd_alpha: float
    bf16_wire: bool
    heartbeat_interval_s: float
    liveness_timeout_s: float
    start_epoch: int
    resume_from: str
    join_running: bool
    global_step: int
    samples_committed: int
    batch_report_ms: float
    report_batches: int
    report_floor_ms: float
    batches_in_metrics: bool
    def __init__(self, world_size: _Optional[int] = ..., total_samples: _Optional[int] = ..., batch_size: _Optional[int] = ..., num_epochs: _Optional[int] = ..., seed: _Optional[int] = ..., policy: _Optional[_Union[Policy, str]] = ..., plane: _Optional[_Union[Plane, str]] = ..., gamma: _Optional[float] = ..., easgd_alpha: _Optional[float] = ..., bf16_wire: _Optional[bool] = ..., heartbeat_interval_s: _Optional[float] = ..., liveness_timeout_s: _Optional[float] = ..., start_epoch: _Optional[int] = ..., resume_from: _Optional[str] = ..., join_running: _Optional[bool] = ..., global_step: _Optional[int] = ..., samples_committed: _Optional[int] = ..., batch_report_ms: _Optional[float] = ..., report_batches: _Optional[int] = ..., report_floor_ms: _Optional[float] = ..., batches_in_metrics: _Optional[bool] = ...) -> None: ...

class HelloAck(_message.Message):
    __slots__ = ("accepted", "reason", "run", "deferred", "rank")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    RUN_FIELD_NUMBER: _ClassVar[int]
    DEFERRED_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    reason: str
    run: RunSpec
    deferred: bool
    rank: int
    def __init__(self, accepted: _Optional[bool] = ..., reason: _Optional[str] = ..., run: _Optional[_Union[RunSpec, _Mapping]] = ..., deferred: _Optional[bool] = ..., rank: _Optional[int] = ...) -> None: ...

class EpochPlan(_message.Message):
    __slots__ = ("epoch", "partition_offset", "partition_size")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    PARTITION_OFFSET_FIELD_NUMBER: _ClassVar[int]
    PARTITION_SIZE_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    partition_offset: int
    partition_size: int
    def __init__(self, epoch: _Optional[int] = ..., partition_offset: _Optional[int] = ..., partition_size: _Optional[int] = ...) -> None: ...

class Span(_message.Message):
    __slots__ = ("offset", "size")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    offset: int
    size: int
    def __init__(self, offset: _Optional[int] = ..., size: _Optional[int] = ...) -> None: ...

class StageSegment(_message.Message):
    __slots__ = ("epoch", "spans")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SPANS_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    spans: _containers.RepeatedCompositeFieldContainer[Span]
    def __init__(self, epoch: _Optional[int] = ..., spans: _Optional[_Iterable[_Union[Span, _Mapping]]] = ...) -> None: ...

class ScalarAccum(_message.Message):
    __slots__ = ("sum", "count")
    SUM_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    sum: float
    count: int
    def __init__(self, sum: _Optional[float] = ..., count: _Optional[int] = ...) -> None: ...

class ScalarMap(_message.Message):
    __slots__ = ("values",)
    class ValuesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    VALUES_FIELD_NUMBER: _ClassVar[int]
    values: _containers.ScalarMap[str, float]
    def __init__(self, values: _Optional[_Mapping[str, float]] = ...) -> None: ...

class EpochMetrics(_message.Message):
    __slots__ = ("epoch", "scalars", "per_rank", "avg_loss", "epoch_ms", "per_rank_throughput", "per_rank_batch_share", "per_rank_loss", "per_rank_samples", "per_rank_batches")
    class ScalarsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SCALARS_FIELD_NUMBER: _ClassVar[int]
    PER_RANK_FIELD_NUMBER: _ClassVar[int]
    AVG_LOSS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_MS_FIELD_NUMBER: _ClassVar[int]
    PER_RANK_THROUGHPUT_FIELD_NUMBER: _ClassVar[int]
    PER_RANK_BATCH_SHARE_FIELD_NUMBER: _ClassVar[int]
    PER_RANK_LOSS_FIELD_NUMBER: _ClassVar[int]
    PER_RANK_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    PER_RANK_BATCHES_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    scalars: _containers.ScalarMap[str, float]
    per_rank: _containers.RepeatedCompositeFieldContainer[ScalarMap]
    avg_loss: float
    epoch_ms: float
    per_rank_throughput: _containers.RepeatedScalarFieldContainer[float]
    per_rank_batch_share: _containers.RepeatedScalarFieldContainer[float]
    per_rank_loss: _containers.RepeatedScalarFieldContainer[float]
    per_rank_samples: _containers.RepeatedScalarFieldContainer[int]
    per_rank_batches: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, epoch: _Optional[int] = ..., scalars: _Optional[_Mapping[str, float]] = ..., per_rank: _Optional[_Iterable[_Union[ScalarMap, _Mapping]]] = ..., avg_loss: _Optional[float] = ..., epoch_ms: _Optional[float] = ..., per_rank_throughput: _Optional[_Iterable[float]] = ..., per_rank_batch_share: _Optional[_Iterable[float]] = ..., per_rank_loss: _Optional[_Iterable[float]] = ..., per_rank_samples: _Optional[_Iterable[int]] = ..., per_rank_batches: _Optional[_Iterable[int]] = ...) -> None: ...

class Control(_message.Message):
    __slots__ = ("command_id", "request_params", "update", "sync_now", "start_epoch", "extend_partition", "declare_dead", "rendezvous", "throttle", "set_global_step", "checkpoint", "execute_eval", "set_epoch_callback_role", "shutdown", "shutdown_with_save", "epoch_aggregated", "eval_broadcast", "save_consensus_model", "coord_heartbeat", "stage_advisory", "arm_consensus_eval", "trim_partition")
    class RequestParams(_message.Message):
        __slots__ = ("cycle", "next_plan", "extend")
        CYCLE_FIELD_NUMBER: _ClassVar[int]
        NEXT_PLAN_FIELD_NUMBER: _ClassVar[int]
        EXTEND_FIELD_NUMBER: _ClassVar[int]
        cycle: int
        next_plan: EpochPlan
        extend: Control.ExtendPartition
        def __init__(self, cycle: _Optional[int] = ..., next_plan: _Optional[_Union[EpochPlan, _Mapping]] = ..., extend: _Optional[_Union[Control.ExtendPartition, _Mapping]] = ...) -> None: ...
    class Update(_message.Message):
        __slots__ = ("version", "next_plan", "cycle", "report_at_step", "global_step", "samples_committed")
        VERSION_FIELD_NUMBER: _ClassVar[int]
        NEXT_PLAN_FIELD_NUMBER: _ClassVar[int]
        CYCLE_FIELD_NUMBER: _ClassVar[int]
        REPORT_AT_STEP_FIELD_NUMBER: _ClassVar[int]
        GLOBAL_STEP_FIELD_NUMBER: _ClassVar[int]
        SAMPLES_COMMITTED_FIELD_NUMBER: _ClassVar[int]
        version: int
        next_plan: EpochPlan
        cycle: int
        report_at_step: int
        global_step: int
        samples_committed: int
        def __init__(self, version: _Optional[int] = ..., next_plan: _Optional[_Union[EpochPlan, _Mapping]] = ..., cycle: _Optional[int] = ..., report_at_step: _Optional[int] = ..., global_step: _Optional[int] = ..., samples_committed: _Optional[int] = ...) -> None: ...
    class SyncNow(_message.Message):
        __slots__ = ("cycle",)
        CYCLE_FIELD_NUMBER: _ClassVar[int]
        cycle: int
        def __init__(self, cycle: _Optional[int] = ...) -> None: ...
    class StartEpoch(_message.Message):
        __slots__ = ("plan", "epoch_callback_role")
        PLAN_FIELD_NUMBER: _ClassVar[int]
        EPOCH_CALLBACK_ROLE_FIELD_NUMBER: _ClassVar[int]
        plan: EpochPlan
        epoch_callback_role: int
        def __init__(self, plan: _Optional[_Union[EpochPlan, _Mapping]] = ..., epoch_callback_role: _Optional[int] = ...) -> None: ...
    class ExtendPartition(_message.Message):
        __slots__ = ("epoch", "partition_offset", "partition_size")
        EPOCH_FIELD_NUMBER: _ClassVar[int]
        PARTITION_OFFSET_FIELD_NUMBER: _ClassVar[int]
        PARTITION_SIZE_FIELD_NUMBER: _ClassVar[int]
        epoch: int
        partition_offset: int
        partition_size: int
        def __init__(self, epoch: _Optional[int] = ..., partition_offset: _Optional[int] = ..., partition_size: _Optional[int] = ...) -> None: ...
    class DeclareDead(_message.Message):
        __slots__ = ("rank",)
        RANK_FIELD_NUMBER: _ClassVar[int]
        rank: int
        def __init__(self, rank: _Optional[int] = ...) -> None: ...
    class TrimPartition(_message.Message):
        __slots__ = ("epoch", "keep")
        EPOCH_FIELD_NUMBER: _ClassVar[int]
        KEEP_FIELD_NUMBER: _ClassVar[int]
        epoch: int
        keep: int
        def __init__(self, epoch: _Optional[int] = ..., keep: _Optional[int] = ...) -> None: ...
    class Rendezvous(_message.Message):
        __slots__ = ("store_addr", "generation", "new_rank", "new_world_size", "backend", "timeout_s", "seed_ranks", "seed_cycle")
        STORE_ADDR_FIELD_NUMBER: _ClassVar[int]
        GENERATION_FIELD_NUMBER: _ClassVar[int]
        NEW_RANK_FIELD_NUMBER: _ClassVar[int]
        NEW_WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
        BACKEND_FIELD_NUMBER: _ClassVar[int]
        TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
        SEED_RANKS_FIELD_NUMBER: _ClassVar[int]
        SEED_CYCLE_FIELD_NUMBER: _ClassVar[int]
        store_addr: str
        generation: int
        new_rank: int
        new_world_size: int
        backend: str
        timeout_s: float
        seed_ranks: _containers.RepeatedScalarFieldContainer[int]
        seed_cycle: int
        def __init__(self, store_addr: _Optional[str] = ..., generation: _Optional[int] = ..., new_rank: _Optional[int] = ..., new_world_size: _Optional[int] = ..., backend: _Optional[str] = ..., timeout_s: _Optional[float] = ..., seed_ranks: _Optional[_Iterable[int]] = ..., seed_cycle: _Optional[int] = ...) -> None: ...
    class Throttle(_message.Message):
        __slots__ = ()
        def __init__(self) -> None: ...
    class SetGlobalStep(_message.Message):
        __slots__ = ("global_step", "samples_committed")
        GLOBAL_STEP_FIELD_NUMBER: _ClassVar[int]
        SAMPLES_COMMITTED_FIELD_NUMBER: _ClassVar[int]
        global_step: int
        samples_committed: int
        def __init__(self, global_step: _Optional[int] = ..., samples_committed: _Optional[int] = ...) -> None: ...
    class Checkpoint(_message.Message):
        __slots__ = ("version", "target_rank", "path", "cycle")
        VERSION_FIELD_NUMBER: _ClassVar[int]
        TARGET_RANK_FIELD_NUMBER: _ClassVar[int]
        PATH_FIELD_NUMBER: _ClassVar[int]
        CYCLE_FIELD_NUMBER: _ClassVar[int]
        version: int
        target_rank: int
        path: str
        cycle: int
        def __init__(self, version: _Optional[int] = ..., target_rank: _Optional[int] = ..., path: _Optional[str] = ..., cycle: _Optional[int] = ...) -> None: ...
    class ExecuteEval(_message.Message):
        __slots__ = ("schedule_id", "epoch", "target_rank", "final", "save_model_path")
        SCHEDULE_ID_FIELD_NUMBER: _ClassVar[int]
        EPOCH_FIELD_NUMBER: _ClassVar[int]
        TARGET_RANK_FIELD_NUMBER: _ClassVar[int]
        FINAL_FIELD_NUMBER: _ClassVar[int]
        SAVE_MODEL_PATH_FIELD_NUMBER: _ClassVar[int]
        schedule_id: int
        epoch: int
        target_rank: int
        final: bool
        save_model_path: str
        def __init__(self, schedule_id: _Optional[int] = ..., epoch: _Optional[int] = ..., target_rank: _Optional[int] = ..., final: _Optional[bool] = ..., save_model_path: _Optional[str] = ...) -> None: ...
    class SetEpochCallbackRole(_message.Message):
        __slots__ = ("rank",)
        RANK_FIELD_NUMBER: _ClassVar[int]
        rank: int
        def __init__(self, rank: _Optional[int] = ...) -> None: ...
    class Shutdown(_message.Message):
        __slots__ = ("reason",)
        REASON_FIELD_NUMBER: _ClassVar[int]
        reason: str
        def __init__(self, reason: _Optional[str] = ...) -> None: ...
    class ShutdownWithSave(_message.Message):
        __slots__ = ("reason", "detail")
        REASON_FIELD_NUMBER: _ClassVar[int]
        DETAIL_FIELD_NUMBER: _ClassVar[int]
        reason: SaveReason
        detail: str
        def __init__(self, reason: _Optional[_Union[SaveReason, str]] = ..., detail: _Optional[str] = ...) -> None: ...
    class EpochAggregated(_message.Message):
        __slots__ = ("metrics",)
        METRICS_FIELD_NUMBER: _ClassVar[int]
        metrics: EpochMetrics
        def __init__(self, metrics: _Optional[_Union[EpochMetrics, _Mapping]] = ...) -> None: ...
    class EvalBroadcast(_message.Message):
        __slots__ = ("epoch", "metric")
        EPOCH_FIELD_NUMBER: _ClassVar[int]
        METRIC_FIELD_NUMBER: _ClassVar[int]
        epoch: int
        metric: float
        def __init__(self, epoch: _Optional[int] = ..., metric: _Optional[float] = ...) -> None: ...
    class SaveConsensusModel(_message.Message):
        __slots__ = ("target_rank",)
        TARGET_RANK_FIELD_NUMBER: _ClassVar[int]
        target_rank: int
        def __init__(self, target_rank: _Optional[int] = ...) -> None: ...
    class CoordHeartbeat(_message.Message):
        __slots__ = ("beat",)
        BEAT_FIELD_NUMBER: _ClassVar[int]
        beat: int
        def __init__(self, beat: _Optional[int] = ...) -> None: ...
    class StageAdvisory(_message.Message):
        __slots__ = ("counts", "segments")
        COUNTS_FIELD_NUMBER: _ClassVar[int]
        SEGMENTS_FIELD_NUMBER: _ClassVar[int]
        counts: _containers.RepeatedScalarFieldContainer[int]
        segments: _containers.RepeatedCompositeFieldContainer[StageSegment]
        def __init__(self, counts: _Optional[_Iterable[int]] = ..., segments: _Optional[_Iterable[_Union[StageSegment, _Mapping]]] = ...) -> None: ...
    class ArmConsensusEval(_message.Message):
        __slots__ = ("schedule_id", "epoch", "target_rank")
        SCHEDULE_ID_FIELD_NUMBER: _ClassVar[int]
        EPOCH_FIELD_NUMBER: _ClassVar[int]
        TARGET_RANK_FIELD_NUMBER: _ClassVar[int]
        schedule_id: int
        epoch: int
        target_rank: int
        def __init__(self, schedule_id: _Optional[int] = ..., epoch: _Optional[int] = ..., target_rank: _Optional[int] = ...) -> None: ...
    COMMAND_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_PARAMS_FIELD_NUMBER: _ClassVar[int]
    UPDATE_FIELD_NUMBER: _ClassVar[int]
    SYNC_NOW_FIELD_NUMBER: _ClassVar[int]
    START_EPOCH_FIELD_NUMBER: _ClassVar[int]
    EXTEND_PARTITION_FIELD_NUMBER: _ClassVar[int]
    DECLARE_DEAD_FIELD_NUMBER: _ClassVar[int]
    RENDEZVOUS_FIELD_NUMBER: _ClassVar[int]
    THROTTLE_FIELD_NUMBER: _ClassVar[int]
    SET_GLOBAL_STEP_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    EXECUTE_EVAL_FIELD_NUMBER: _ClassVar[int]
    SET_EPOCH_CALLBACK_ROLE_FIELD_NUMBER: _ClassVar[int]
    SHUTDOWN_FIELD_NUMBER: _ClassVar[int]
    SHUTDOWN_WITH_SAVE_FIELD_NUMBER: _ClassVar[int]
    EPOCH_AGGREGATED_FIELD_NUMBER: _ClassVar[int]
    EVAL_BROADCAST_FIELD_NUMBER: _ClassVar[int]
    SAVE_CONSENSUS_MODEL_FIELD_NUMBER: _ClassVar[int]
    COORD_HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    STAGE_ADVISORY_FIELD_NUMBER: _ClassVar[int]
    ARM_CONSENSUS_EVAL_FIELD_NUMBER: _ClassVar[int]
    TRIM_PARTITION_FIELD_NUMBER: _ClassVar[int]
    command_id: int
    request_params: Control.RequestParams
    update: Control.Update
    sync_now: Control.SyncNow
    start_epoch: Control.StartEpoch
    extend_partition: Control.ExtendPartition
    declare_dead: Control.DeclareDead
    rendezvous: Control.Rendezvous
    throttle: Control.Throttle
    set_global_step: Control.SetGlobalStep
    checkpoint: Control.Checkpoint
    execute_eval: Control.ExecuteEval
    set_epoch_callback_role: Control.SetEpochCallbackRole
    shutdown: Control.Shutdown
    shutdown_with_save: Control.ShutdownWithSave
    epoch_aggregated: Control.EpochAggregated
    eval_broadcast: Control.EvalBroadcast
    save_consensus_model: Control.SaveConsensusModel
    coord_heartbeat: Control.CoordHeartbeat
    stage_advisory: Control.StageAdvisory
    arm_consensus_eval: Control.ArmConsensusEval
    trim_partition: Control.TrimPartition
    def __init__(self, command_id: _Optional[int] = ..., request_params: _Optional[_Union[Control.RequestParams, _Mapping]] = ..., update: _Optional[_Union[Control.Update, _Mapping]] = ..., sync_now: _Optional[_Union[Control.SyncNow, _Mapping]] = ..., start_epoch: _Optional[_Union[Control.StartEpoch, _Mapping]] = ..., extend_partition: _Optional[_Union[Control.ExtendPartition, _Mapping]] = ..., declare_dead: _Optional[_Union[Control.DeclareDead, _Mapping]] = ..., rendezvous: _Optional[_Union[Control.Rendezvous, _Mapping]] = ..., throttle: _Optional[_Union[Control.Throttle, _Mapping]] = ..., set_global_step: _Optional[_Union[Control.SetGlobalStep, _Mapping]] = ..., checkpoint: _Optional[_Union[Control.Checkpoint, _Mapping]] = ..., execute_eval: _Optional[_Union[Control.ExecuteEval, _Mapping]] = ..., set_epoch_callback_role: _Optional[_Union[Control.SetEpochCallbackRole, _Mapping]] = ..., shutdown: _Optional[_Union[Control.Shutdown, _Mapping]] = ..., shutdown_with_save: _Optional[_Union[Control.ShutdownWithSave, _Mapping]] = ..., epoch_aggregated: _Optional[_Union[Control.EpochAggregated, _Mapping]] = ..., eval_broadcast: _Optional[_Union[Control.EvalBroadcast, _Mapping]] = ..., save_consensus_model: _Optional[_Union[Control.SaveConsensusModel, _Mapping]] = ..., coord_heartbeat: _Optional[_Union[Control.CoordHeartbeat, _Mapping]] = ..., stage_advisory: _Optional[_Union[Control.StageAdvisory, _Mapping]] = ..., arm_consensus_eval: _Optional[_Union[Control.ArmConsensusEval, _Mapping]] = ..., trim_partition: _Optional[_Union[Control.TrimPartition, _Mapping]] = ...) -> None: ...

class Timing(_message.Message):
    __slots__ = ("rank", "batch", "sync_ack", "exiting", "lr_update", "intent", "heartbeat", "snapshot_ready", "eval_result", "checkpoint_result", "epoch_fn_elapsed", "resync", "store_ready", "collective_failed", "seeded", "partition_trimmed", "batches", "time_account")
    class BatchRun(_message.Message):
        __slots__ = ("batch",)
        BATCH_FIELD_NUMBER: _ClassVar[int]
        batch: _containers.RepeatedCompositeFieldContainer[Timing.Batch]
        def __init__(self, batch: _Optional[_Iterable[_Union[Timing.Batch, _Mapping]]] = ...) -> None: ...
    class PartitionTrimmed(_message.Message):
        __slots__ = ("command_id", "epoch", "kept", "released")
        COMMAND_ID_FIELD_NUMBER: _ClassVar[int]
        EPOCH_FIELD_NUMBER: _ClassVar[int]
        KEPT_FIELD_NUMBER: _ClassVar[int]
        RELEASED_FIELD_NUMBER: _ClassVar[int]
        command_id: int
        epoch: int
        kept: int
        released: _containers.RepeatedCompositeFieldContainer[Span]
        def __init__(self, command_id: _Optional[int] = ..., epoch: _Optional[int] = ..., kept: _Optional[int] = ..., released: _Optional[_Iterable[_Union[Span, _Mapping]]] = ...) -> None: ...
    class Seeded(_message.Message):
        __slots__ = ("cycle",)
        CYCLE_FIELD_NUMBER: _ClassVar[int]
        cycle: int
        def __init__(self, cycle: _Optional[int] = ...) -> None: ...
    class Batch(_message.Message):
        __slots__ = ("batch_ms", "data_ms", "step_count", "batch_loss", "param_norm", "sync_divergence", "lr", "samples", "epoch", "offset", "wait_ms")
        BATCH_MS_FIELD_NUMBER: _ClassVar[int]
        DATA_MS_FIELD_NUMBER: _ClassVar[int]
        STEP_COUNT_FIELD_NUMBER: _ClassVar[int]
        BATCH_LOSS_FIELD_NUMBER: _ClassVar[int]
        PARAM_NORM_FIELD_NUMBER: _ClassVar[int]
        SYNC_DIVERGENCE_FIELD_NUMBER: _ClassVar[int]
        LR_FIELD_NUMBER: _ClassVar[int]
        SAMPLES_FIELD_NUMBER: _ClassVar[int]
        EPOCH_FIELD_NUMBER: _ClassVar[int]
        OFFSET_FIELD_NUMBER: _ClassVar[int]
        WAIT_MS_FIELD_NUMBER: _ClassVar[int]
        batch_ms: float
        data_ms: float
        step_count: int
        batch_loss: float
        param_norm: float
        sync_divergence: float
        lr: float
        samples: int
        epoch: int
        offset: int
        wait_ms: float
        def __init__(self, batch_ms: _Optional[float] = ..., data_ms: _Optional[float] = ..., step_count: _Optional[int] = ..., batch_loss: _Optional[float] = ..., param_norm: _Optional[float] = ..., sync_divergence: _Optional[float] = ..., lr: _Optional[float] = ..., samples: _Optional[int] = ..., epoch: _Optional[int] = ..., offset: _Optional[int] = ..., wait_ms: _Optional[float] = ...) -> None: ...
    class SyncAck(_message.Message):
        __slots__ = ("cycle", "step_count", "divergence", "post_norm", "pre_norm")
        CYCLE_FIELD_NUMBER: _ClassVar[int]
        STEP_COUNT_FIELD_NUMBER: _ClassVar[int]
        DIVERGENCE_FIELD_NUMBER: _ClassVar[int]
        POST_NORM_FIELD_NUMBER: _ClassVar[int]
        PRE_NORM_FIELD_NUMBER: _ClassVar[int]
        cycle: int
        step_count: int
        divergence: float
        post_norm: float
        pre_norm: float
        def __init__(self, cycle: _Optional[int] = ..., step_count: _Optional[int] = ..., divergence: _Optional[float] = ..., post_norm: _Optional[float] = ..., pre_norm: _Optional[float] = ...) -> None: ...
    class Exiting(_message.Message):
        __slots__ = ("param_digest", "steps")
        PARAM_DIGEST_FIELD_NUMBER: _ClassVar[int]
        STEPS_FIELD_NUMBER: _ClassVar[int]
        param_digest: bytes
        steps: int
        def __init__(self, param_digest: _Optional[bytes] = ..., steps: _Optional[int] = ...) -> None: ...
    class LrUpdate(_message.Message):
        __slots__ = ("lr",)
        LR_FIELD_NUMBER: _ClassVar[int]
        lr: float
        def __init__(self, lr: _Optional[float] = ...) -> None: ...
    class Intent(_message.Message):
        __slots__ = ("kind",)
        KIND_FIELD_NUMBER: _ClassVar[int]
        kind: IntentKind
        def __init__(self, kind: _Optional[_Union[IntentKind, str]] = ...) -> None: ...
    class Heartbeat(_message.Message):
        __slots__ = ("step_count",)
        STEP_COUNT_FIELD_NUMBER: _ClassVar[int]
        step_count: int
        def __init__(self, step_count: _Optional[int] = ...) -> None: ...
    class SnapshotReady(_message.Message):
        __slots__ = ("cycle",)
        CYCLE_FIELD_NUMBER: _ClassVar[int]
        cycle: int
        def __init__(self, cycle: _Optional[int] = ...) -> None: ...
    class EvalResult(_message.Message):
        __slots__ = ("schedule_id", "epoch", "metric", "elapsed_ms", "error", "final", "model_sha256", "model_error")
        SCHEDULE_ID_FIELD_NUMBER: _ClassVar[int]
        EPOCH_FIELD_NUMBER: _ClassVar[int]
        METRIC_FIELD_NUMBER: _ClassVar[int]
        ELAPSED_MS_FIELD_NUMBER: _ClassVar[int]
        ERROR_FIELD_NUMBER: _ClassVar[int]
        FINAL_FIELD_NUMBER: _ClassVar[int]
        MODEL_SHA256_FIELD_NUMBER: _ClassVar[int]
        MODEL_ERROR_FIELD_NUMBER: _ClassVar[int]
        schedule_id: int
        epoch: int
        metric: float
        elapsed_ms: float
        error: str
        final: bool
        model_sha256: bytes
        model_error: str
        def __init__(self, schedule_id: _Optional[int] = ..., epoch: _Optional[int] = ..., metric: _Optional[float] = ..., elapsed_ms: _Optional[float] = ..., error: _Optional[str] = ..., final: _Optional[bool] = ..., model_sha256: _Optional[bytes] = ..., model_error: _Optional[str] = ...) -> None: ...
    class CheckpointResult(_message.Message):
        __slots__ = ("version", "elapsed_ms", "error", "sha256", "cycle")
        VERSION_FIELD_NUMBER: _ClassVar[int]
        ELAPSED_MS_FIELD_NUMBER: _ClassVar[int]
        ERROR_FIELD_NUMBER: _ClassVar[int]
        SHA256_FIELD_NUMBER: _ClassVar[int]
        CYCLE_FIELD_NUMBER: _ClassVar[int]
        version: int
        elapsed_ms: float
        error: str
        sha256: bytes
        cycle: int
        def __init__(self, version: _Optional[int] = ..., elapsed_ms: _Optional[float] = ..., error: _Optional[str] = ..., sha256: _Optional[bytes] = ..., cycle: _Optional[int] = ...) -> None: ...
    class EpochFnElapsed(_message.Message):
        __slots__ = ("epoch", "elapsed_ms")
        EPOCH_FIELD_NUMBER: _ClassVar[int]
        ELAPSED_MS_FIELD_NUMBER: _ClassVar[int]
        epoch: int
        elapsed_ms: float
        def __init__(self, epoch: _Optional[int] = ..., elapsed_ms: _Optional[float] = ...) -> None: ...
    class Resync(_message.Message):
        __slots__ = ("coordinator_incarnation", "last_command_id", "local_step", "folded_step", "throttled", "idle", "batches", "held", "chunks")
        COORDINATOR_INCARNATION_FIELD_NUMBER: _ClassVar[int]
        LAST_COMMAND_ID_FIELD_NUMBER: _ClassVar[int]
        LOCAL_STEP_FIELD_NUMBER: _ClassVar[int]
        FOLDED_STEP_FIELD_NUMBER: _ClassVar[int]
        THROTTLED_FIELD_NUMBER: _ClassVar[int]
        IDLE_FIELD_NUMBER: _ClassVar[int]
        BATCHES_FIELD_NUMBER: _ClassVar[int]
        HELD_FIELD_NUMBER: _ClassVar[int]
        CHUNKS_FIELD_NUMBER: _ClassVar[int]
        coordinator_incarnation: int
        last_command_id: int
        local_step: int
        folded_step: int
        throttled: bool
        idle: bool
        batches: _containers.RepeatedCompositeFieldContainer[Timing.Batch]
        held: _containers.RepeatedCompositeFieldContainer[EpochPlan]
        chunks: _containers.RepeatedCompositeFieldContainer[Metrics]
        def __init__(self, coordinator_incarnation: _Optional[int] = ..., last_command_id: _Optional[int] = ..., local_step: _Optional[int] = ..., folded_step: _Optional[int] = ..., throttled: _Optional[bool] = ..., idle: _Optional[bool] = ..., batches: _Optional[_Iterable[_Union[Timing.Batch, _Mapping]]] = ..., held: _Optional[_Iterable[_Union[EpochPlan, _Mapping]]] = ..., chunks: _Optional[_Iterable[_Union[Metrics, _Mapping]]] = ...) -> None: ...
    RANK_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    SYNC_ACK_FIELD_NUMBER: _ClassVar[int]
    EXITING_FIELD_NUMBER: _ClassVar[int]
    LR_UPDATE_FIELD_NUMBER: _ClassVar[int]
    INTENT_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_READY_FIELD_NUMBER: _ClassVar[int]
    EVAL_RESULT_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_RESULT_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FN_ELAPSED_FIELD_NUMBER: _ClassVar[int]
    RESYNC_FIELD_NUMBER: _ClassVar[int]
    STORE_READY_FIELD_NUMBER: _ClassVar[int]
    COLLECTIVE_FAILED_FIELD_NUMBER: _ClassVar[int]
    SEEDED_FIELD_NUMBER: _ClassVar[int]
    PARTITION_TRIMMED_FIELD_NUMBER: _ClassVar[int]
    BATCHES_FIELD_NUMBER: _ClassVar[int]
    TIME_ACCOUNT_FIELD_NUMBER: _ClassVar[int]
    rank: int
    batch: Timing.Batch
    sync_ack: Timing.SyncAck
    exiting: Timing.Exiting
    lr_update: Timing.LrUpdate
    intent: Timing.Intent
    heartbeat: Timing.Heartbeat
    snapshot_ready: Timing.SnapshotReady
    eval_result: Timing.EvalResult
    checkpoint_result: Timing.CheckpointResult
    epoch_fn_elapsed: Timing.EpochFnElapsed
    resync: Timing.Resync
    store_ready: StoreReady
    collective_failed: CollectiveFailed
    seeded: Timing.Seeded
    partition_trimmed: Timing.PartitionTrimmed
    batches: Timing.BatchRun
    time_account: TimeAccount
    def __init__(self, rank: _Optional[int] = ..., batch: _Optional[_Union[Timing.Batch, _Mapping]] = ..., sync_ack: _Optional[_Union[Timing.SyncAck, _Mapping]] = ..., exiting: _Optional[_Union[Timing.Exiting, _Mapping]] = ..., lr_update: _Optional[_Union[Timing.LrUpdate, _Mapping]] = ..., intent: _Optional[_Union[Timing.Intent, _Mapping]] = ..., heartbeat: _Optional[_Union[Timing.Heartbeat, _Mapping]] = ..., snapshot_ready: _Optional[_Union[Timing.SnapshotReady, _Mapping]] = ..., eval_result: _Optional[_Union[Timing.EvalResult, _Mapping]] = ..., checkpoint_result: _Optional[_Union[Timing.CheckpointResult, _Mapping]] = ..., epoch_fn_elapsed: _Optional[_Union[Timing.EpochFnElapsed, _Mapping]] = ..., resync: _Optional[_Union[Timing.Resync, _Mapping]] = ..., store_ready: _Optional[_Union[StoreReady, _Mapping]] = ..., collective_failed: _Optional[_Union[CollectiveFailed, _Mapping]] = ..., seeded: _Optional[_Union[Timing.Seeded, _Mapping]] = ..., partition_trimmed: _Optional[_Union[Timing.PartitionTrimmed, _Mapping]] = ..., batches: _Optional[_Union[Timing.BatchRun, _Mapping]] = ..., time_account: _Optional[_Union[TimeAccount, _Mapping]] = ...) -> None: ...

class StoreReady(_message.Message):
    __slots__ = ("generation", "addr")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    ADDR_FIELD_NUMBER: _ClassVar[int]
    generation: int
    addr: str
    def __init__(self, generation: _Optional[int] = ..., addr: _Optional[str] = ...) -> None: ...

class TimeAccount(_message.Message):
    __slots__ = ("wall_s", "training_s", "barrier_s", "averaging_s", "calibration_s", "recovery_s", "checkpoint_s", "eval_s", "startup_s")
    WALL_S_FIELD_NUMBER: _ClassVar[int]
    TRAINING_S_FIELD_NUMBER: _ClassVar[int]
    BARRIER_S_FIELD_NUMBER: _ClassVar[int]
    AVERAGING_S_FIELD_NUMBER: _ClassVar[int]
    CALIBRATION_S_FIELD_NUMBER: _ClassVar[int]
    RECOVERY_S_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_S_FIELD_NUMBER: _ClassVar[int]
    EVAL_S_FIELD_NUMBER: _ClassVar[int]
    STARTUP_S_FIELD_NUMBER: _ClassVar[int]
    wall_s: float
    training_s: float
    barrier_s: float
    averaging_s: float
    calibration_s: float
    recovery_s: float
    checkpoint_s: float
    eval_s: float
    startup_s: float
    def __init__(self, wall_s: _Optional[float] = ..., training_s: _Optional[float] = ..., barrier_s: _Optional[float] = ..., averaging_s: _Optional[float] = ..., calibration_s: _Optional[float] = ..., recovery_s: _Optional[float] = ..., checkpoint_s: _Optional[float] = ..., eval_s: _Optional[float] = ..., startup_s: _Optional[float] = ...) -> None: ...

class CollectiveFailed(_message.Message):
    __slots__ = ("generation", "cycle", "reason", "seeding")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    CYCLE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    SEEDING_FIELD_NUMBER: _ClassVar[int]
    generation: int
    cycle: int
    reason: str
    seeding: bool
    def __init__(self, generation: _Optional[int] = ..., cycle: _Optional[int] = ..., reason: _Optional[str] = ..., seeding: _Optional[bool] = ...) -> None: ...

class Metrics(_message.Message):
    __slots__ = ("rank", "epoch", "chunk_seq", "avg_loss", "batches_processed", "epoch_ms", "samples_processed", "share_complete_ms", "compute_only_ms", "data_starve_ms", "scalars", "batches", "time_account")
    class ScalarsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: ScalarAccum
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[ScalarAccum, _Mapping]] = ...) -> None: ...
    RANK_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    CHUNK_SEQ_FIELD_NUMBER: _ClassVar[int]
    AVG_LOSS_FIELD_NUMBER: _ClassVar[int]
    BATCHES_PROCESSED_FIELD_NUMBER: _ClassVar[int]
    EPOCH_MS_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_PROCESSED_FIELD_NUMBER: _ClassVar[int]
    SHARE_COMPLETE_MS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_ONLY_MS_FIELD_NUMBER: _ClassVar[int]
    DATA_STARVE_MS_FIELD_NUMBER: _ClassVar[int]
    SCALARS_FIELD_NUMBER: _ClassVar[int]
    BATCHES_FIELD_NUMBER: _ClassVar[int]
    TIME_ACCOUNT_FIELD_NUMBER: _ClassVar[int]
    rank: int
    epoch: int
    chunk_seq: int
    avg_loss: float
    batches_processed: int
    epoch_ms: float
    samples_processed: int
    share_complete_ms: float
    compute_only_ms: float
    data_starve_ms: float
    scalars: _containers.MessageMap[str, ScalarAccum]
    batches: _containers.RepeatedCompositeFieldContainer[Timing.Batch]
    time_account: TimeAccount
    def __init__(self, rank: _Optional[int] = ..., epoch: _Optional[int] = ..., chunk_seq: _Optional[int] = ..., avg_loss: _Optional[float] = ..., batches_processed: _Optional[int] = ..., epoch_ms: _Optional[float] = ..., samples_processed: _Optional[int] = ..., share_complete_ms: _Optional[float] = ..., compute_only_ms: _Optional[float] = ..., data_starve_ms: _Optional[float] = ..., scalars: _Optional[_Mapping[str, ScalarAccum]] = ..., batches: _Optional[_Iterable[_Union[Timing.Batch, _Mapping]]] = ..., time_account: _Optional[_Union[TimeAccount, _Mapping]] = ...) -> None: ...

class TensorMeta(_message.Message):
    __slots__ = ("dtype", "shape", "elided", "blob_index", "nbytes")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    ELIDED_FIELD_NUMBER: _ClassVar[int]
    BLOB_INDEX_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    elided: bool
    blob_index: int
    nbytes: int
    def __init__(self, dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., elided: _Optional[bool] = ..., blob_index: _Optional[int] = ..., nbytes: _Optional[int] = ...) -> None: ...

class RoundHeader(_message.Message):
    __slots__ = ("cycle", "phase", "kind", "weight", "tensors", "contributing_ranks", "deliver_to", "seed", "buffer_tensors", "buffer_weight", "relay_stats")
    CYCLE_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    CONTRIBUTING_RANKS_FIELD_NUMBER: _ClassVar[int]
    DELIVER_TO_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    BUFFER_TENSORS_FIELD_NUMBER: _ClassVar[int]
    BUFFER_WEIGHT_FIELD_NUMBER: _ClassVar[int]
    RELAY_STATS_FIELD_NUMBER: _ClassVar[int]
    cycle: int
    phase: RoundPhase
    kind: RoundKind
    weight: float
    tensors: _containers.RepeatedCompositeFieldContainer[TensorMeta]
    contributing_ranks: _containers.RepeatedScalarFieldContainer[int]
    deliver_to: _containers.RepeatedScalarFieldContainer[int]
    seed: bool
    buffer_tensors: int
    buffer_weight: float
    relay_stats: RelayStats
    def __init__(self, cycle: _Optional[int] = ..., phase: _Optional[_Union[RoundPhase, str]] = ..., kind: _Optional[_Union[RoundKind, str]] = ..., weight: _Optional[float] = ..., tensors: _Optional[_Iterable[_Union[TensorMeta, _Mapping]]] = ..., contributing_ranks: _Optional[_Iterable[int]] = ..., deliver_to: _Optional[_Iterable[int]] = ..., seed: _Optional[bool] = ..., buffer_tensors: _Optional[int] = ..., buffer_weight: _Optional[float] = ..., relay_stats: _Optional[_Union[RelayStats, _Mapping]] = ...) -> None: ...

class RelayStats(_message.Message):
    __slots__ = ("folds_sent", "ranks_folded", "parts_forwarded", "folds_discarded", "fanouts", "fanout_copies")
    FOLDS_SENT_FIELD_NUMBER: _ClassVar[int]
    RANKS_FOLDED_FIELD_NUMBER: _ClassVar[int]
    PARTS_FORWARDED_FIELD_NUMBER: _ClassVar[int]
    FOLDS_DISCARDED_FIELD_NUMBER: _ClassVar[int]
    FANOUTS_FIELD_NUMBER: _ClassVar[int]
    FANOUT_COPIES_FIELD_NUMBER: _ClassVar[int]
    folds_sent: int
    ranks_folded: int
    parts_forwarded: int
    folds_discarded: int
    fanouts: int
    fanout_copies: int
    def __init__(self, folds_sent: _Optional[int] = ..., ranks_folded: _Optional[int] = ..., parts_forwarded: _Optional[int] = ..., folds_discarded: _Optional[int] = ..., fanouts: _Optional[int] = ..., fanout_copies: _Optional[int] = ...) -> None: ...

class RelayMsg(_message.Message):
    __slots__ = ("hello", "rank_exit", "declare_dead", "fold_open", "fold_drop")
    class FoldOpen(_message.Message):
        __slots__ = ("cycle", "ranks", "identities")
        CYCLE_FIELD_NUMBER: _ClassVar[int]
        RANKS_FIELD_NUMBER: _ClassVar[int]
        IDENTITIES_FIELD_NUMBER: _ClassVar[int]
        cycle: int
        ranks: _containers.RepeatedScalarFieldContainer[int]
        identities: _containers.RepeatedScalarFieldContainer[bytes]
        def __init__(self, cycle: _Optional[int] = ..., ranks: _Optional[_Iterable[int]] = ..., identities: _Optional[_Iterable[bytes]] = ...) -> None: ...
    class FoldDrop(_message.Message):
        __slots__ = ("cycle", "rank")
        CYCLE_FIELD_NUMBER: _ClassVar[int]
        RANK_FIELD_NUMBER: _ClassVar[int]
        cycle: int
        rank: int
        def __init__(self, cycle: _Optional[int] = ..., rank: _Optional[int] = ...) -> None: ...
    class RelayHello(_message.Message):
        __slots__ = ("host", "ranks")
        HOST_FIELD_NUMBER: _ClassVar[int]
        RANKS_FIELD_NUMBER: _ClassVar[int]
        host: str
        ranks: _containers.RepeatedScalarFieldContainer[int]
        def __init__(self, host: _Optional[str] = ..., ranks: _Optional[_Iterable[int]] = ...) -> None: ...
    class RankExit(_message.Message):
        __slots__ = ("rank",)
        RANK_FIELD_NUMBER: _ClassVar[int]
        rank: int
        def __init__(self, rank: _Optional[int] = ...) -> None: ...
    class DeclareDead(_message.Message):
        __slots__ = ("rank",)
        RANK_FIELD_NUMBER: _ClassVar[int]
        rank: int
        def __init__(self, rank: _Optional[int] = ...) -> None: ...
    HELLO_FIELD_NUMBER: _ClassVar[int]
    RANK_EXIT_FIELD_NUMBER: _ClassVar[int]
    DECLARE_DEAD_FIELD_NUMBER: _ClassVar[int]
    FOLD_OPEN_FIELD_NUMBER: _ClassVar[int]
    FOLD_DROP_FIELD_NUMBER: _ClassVar[int]
    hello: RelayMsg.RelayHello
    rank_exit: RelayMsg.RankExit
    declare_dead: RelayMsg.DeclareDead
    fold_open: RelayMsg.FoldOpen
    fold_drop: RelayMsg.FoldDrop
    def __init__(self, hello: _Optional[_Union[RelayMsg.RelayHello, _Mapping]] = ..., rank_exit: _Optional[_Union[RelayMsg.RankExit, _Mapping]] = ..., declare_dead: _Optional[_Union[RelayMsg.DeclareDead, _Mapping]] = ..., fold_open: _Optional[_Union[RelayMsg.FoldOpen, _Mapping]] = ..., fold_drop: _Optional[_Union[RelayMsg.FoldDrop, _Mapping]] = ...) -> None: ...

class AgentMsg(_message.Message):
    __slots__ = ("hello", "rank_exited", "abort", "relay_restarting", "hello_ack", "run_ended")
    class RunEnded(_message.Message):
        __slots__ = ("ok", "reason")
        OK_FIELD_NUMBER: _ClassVar[int]
        REASON_FIELD_NUMBER: _ClassVar[int]
        ok: bool
        reason: str
        def __init__(self, ok: _Optional[bool] = ..., reason: _Optional[str] = ...) -> None: ...
    class HelloAck(_message.Message):
        __slots__ = ("accepted", "reason")
        ACCEPTED_FIELD_NUMBER: _ClassVar[int]
        REASON_FIELD_NUMBER: _ClassVar[int]
        accepted: bool
        reason: str
        def __init__(self, accepted: _Optional[bool] = ..., reason: _Optional[str] = ...) -> None: ...
    class RelayRestarting(_message.Message):
        __slots__ = ("identity", "reason", "token", "ready")
        IDENTITY_FIELD_NUMBER: _ClassVar[int]
        REASON_FIELD_NUMBER: _ClassVar[int]
        TOKEN_FIELD_NUMBER: _ClassVar[int]
        READY_FIELD_NUMBER: _ClassVar[int]
        identity: bytes
        reason: str
        token: bytes
        ready: bool
        def __init__(self, identity: _Optional[bytes] = ..., reason: _Optional[str] = ..., token: _Optional[bytes] = ..., ready: _Optional[bool] = ...) -> None: ...
    class AgentHello(_message.Message):
        __slots__ = ("host", "ranks", "token")
        HOST_FIELD_NUMBER: _ClassVar[int]
        RANKS_FIELD_NUMBER: _ClassVar[int]
        TOKEN_FIELD_NUMBER: _ClassVar[int]
        host: str
        ranks: _containers.RepeatedScalarFieldContainer[int]
        token: bytes
        def __init__(self, host: _Optional[str] = ..., ranks: _Optional[_Iterable[int]] = ..., token: _Optional[bytes] = ...) -> None: ...
    class RankExited(_message.Message):
        __slots__ = ("rank", "code", "token", "restart_count", "restarting", "last_lines", "unpinned_slot")
        RANK_FIELD_NUMBER: _ClassVar[int]
        CODE_FIELD_NUMBER: _ClassVar[int]
        TOKEN_FIELD_NUMBER: _ClassVar[int]
        RESTART_COUNT_FIELD_NUMBER: _ClassVar[int]
        RESTARTING_FIELD_NUMBER: _ClassVar[int]
        LAST_LINES_FIELD_NUMBER: _ClassVar[int]
        UNPINNED_SLOT_FIELD_NUMBER: _ClassVar[int]
        rank: int
        code: int
        token: bytes
        restart_count: int
        restarting: bool
        last_lines: _containers.RepeatedScalarFieldContainer[str]
        unpinned_slot: int
        def __init__(self, rank: _Optional[int] = ..., code: _Optional[int] = ..., token: _Optional[bytes] = ..., restart_count: _Optional[int] = ..., restarting: _Optional[bool] = ..., last_lines: _Optional[_Iterable[str]] = ..., unpinned_slot: _Optional[int] = ...) -> None: ...
    class Abort(_message.Message):
        __slots__ = ("reason",)
        REASON_FIELD_NUMBER: _ClassVar[int]
        reason: str
        def __init__(self, reason: _Optional[str] = ...) -> None: ...
    HELLO_FIELD_NUMBER: _ClassVar[int]
    RANK_EXITED_FIELD_NUMBER: _ClassVar[int]
    ABORT_FIELD_NUMBER: _ClassVar[int]
    RELAY_RESTARTING_FIELD_NUMBER: _ClassVar[int]
    HELLO_ACK_FIELD_NUMBER: _ClassVar[int]
    RUN_ENDED_FIELD_NUMBER: _ClassVar[int]
    hello: AgentMsg.AgentHello
    rank_exited: AgentMsg.RankExited
    abort: AgentMsg.Abort
    relay_restarting: AgentMsg.RelayRestarting
    hello_ack: AgentMsg.HelloAck
    run_ended: AgentMsg.RunEnded
    def __init__(self, hello: _Optional[_Union[AgentMsg.AgentHello, _Mapping]] = ..., rank_exited: _Optional[_Union[AgentMsg.RankExited, _Mapping]] = ..., abort: _Optional[_Union[AgentMsg.Abort, _Mapping]] = ..., relay_restarting: _Optional[_Union[AgentMsg.RelayRestarting, _Mapping]] = ..., hello_ack: _Optional[_Union[AgentMsg.HelloAck, _Mapping]] = ..., run_ended: _Optional[_Union[AgentMsg.RunEnded, _Mapping]] = ...) -> None: ...
