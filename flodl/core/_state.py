"""The coordinator's state: small records, one per concern, composed in one object.

Theory of operation
-------------------
``CoordinatorState`` is plain data. Each concern owns one record and the module of the
same name is the only code that writes it:

=================  ===================  ==============================================
record             module               what it knows
=================  ===================  ==============================================
``RankRecord``     ``_membership``      phase, route, liveness, per-rank counters
``DispatchState``  ``_dispatch``        plans, assignments (plan + extensions), roles
``RoundState``     ``_averaging``       cycle, version, global step, the open round
``CoverageState``  ``_coverage``        committed positions per epoch, pending batches
``MetricsState``   ``_metrics``         ChunkDone buffers, aggregated epochs
``RunState``       ``_run``             run phase, final eval, stop/finish outcome
``CadenceState``   ``cadence``,         Cadence only: ElChe, window ledger, guard,
                   ``_feedback``        meta, chunk pools, per-rank chunk in flight
=================  ===================  ==============================================

``RoleState`` (``_roles``): the checkpoint / eval / epoch-callback roles, callback
costs and pending intents.

``CheckpointState`` (``_checkpointing``): saves asked and not yet answered, and the
resumed epoch's uncovered ranges.

``ResyncState`` (``_resync``): coordinator restarts, and the ranks that have not
reported to the restarted coordinator yet.

``CadenceState`` holds the pure engines (``ElChe``, ``WindowLedger``, ``ChunkPool``, the
guard, the meta-controller), which are plain objects without ``__eq__``; its own
``__eq__`` compares their attribute trees (``_plain``), so a replayed state still
compares ``==`` to the original.

Phases are sentinels defined with their transition tables in ``_phases``.

The state is mutated in place by ``step`` (ARCHITECTURE §3 allows it: the core owns
it and nothing outside writes it). Equality is structural, so a replayed state compares
``==`` to the original. Nothing in here holds a protobuf message: commands are built
from these values when they are emitted, and numbered by ``next_command_id``.

``index`` (``_rank_index.RankIndex``) holds incremental views of ``ranks`` -- who is
ACTIVE / addressable / DEAD, who has unfolded steps, whom the open round waits for, a
liveness floor -- so that an event costs O(1), not a walk over every rank. The records
keep it: an assignment to a ``RankRecord``'s ``phase``, ``last_step``, ``folded_step`` or
``last_seen`` tells it, so any writer (a mid-run join included) keeps it exact. It is
derived: equality ignores it; ``index_drift`` recomputes it (``flodl.core.view_drift``).

``send`` (and its forms for a command to many ranks, ``send_built`` /
``send_built_each`` / ``send_built_zip``, whose Control is built when first read) is
the single place a ``Send`` is made: it refuses (``LocalViolation``) to address a rank
that is not JOINING or ACTIVE, so "no command to a DEAD or LEFT rank"
is enforced where commands are born, not hoped for downstream.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field, is_dataclass
from typing import Any, Callable, Optional, Sequence

from flodl.wire import pb

from ._commands import Command, Encoder, LastWord, Send
from ._config import CoreConfig
from ._errors import LocalViolation
from ._rank_index import INDEXED_FIELDS, RankIndex
from ._phases import (  # noqa: F401  (re-exported: older imports of the phases from here)
    ACTIVE,
    DEAD,
    FINAL_EVAL,
    FINISHED,
    FORMING,
    IDLE,
    JOINING,
    LEFT,
    PENDING,
    SHUTTING_DOWN,
    STOPPING,
    TRAINING,
    VACANT,
)

__all__ = [
    "RankRecord",
    "DispatchState",
    "RoundState",
    "EpochCoverage",
    "CoverageState",
    "MetricsState",
    "FinalEval",
    "RunState",
    "CadenceState",
    "CheckpointState",
    "ResyncState",
    "RoleState",
    "CollectiveState",
    "CoordinatorState",
]


@dataclass(slots=True)
class RankRecord:
    rank: int
    phase: Any = VACANT
    route: tuple[bytes, ...] = ()
    incarnation: int = 0
    host: str = ""
    pid: int = 0
    last_seen: float = 0.0
    reason: str = ""  # why DEAD or LEFT (or why last vacated)
    # Elastic membership: admitted into a running world and the seed consensus asked for
    # it (``SeedJoiner``), not confirmed yet (``JoinerSeeded``).
    seeding: bool = False
    joined_at: Optional[float] = None  # admitted mid-run (JOINING while TRAINING): when
    refill: bool = False  # ... into a slot a DEAD or LEFT rank held (a restart)
    restart_count: int = 0  # the admitted process's FLODL_RESTART_COUNT (its hello)
    # The unpinned process slot that took this slot last (its agent's token digest, its
    # FLODL_LOCAL_RANK; "" / -1: pinned): its restart gets the slot back, its agent's exit
    # report finds it (``_membership.unpinned_slot``).
    agent: str = ""
    local_rank: int = -1
    # Training counters (monotone; last_step and folded_step restart at 0 with a process that
    # takes the slot again mid-run, ``_membership.on_seeded``; the totals never reset).
    last_step: int = 0  # highest step_count reported by a BatchDone
    folded_step: int = 0  # highest step_count folded into a consensus (SyncAcked)
    batches: int = 0
    samples: int = 0
    batch_frames: int = 0  # frames that reported batches (batches / batch_frames: the coalescing)
    train_ms: float = 0.0  # batch_ms + data_ms summed: the time the rank trained
    wait_ms: float = 0.0  # BatchDone.wait_ms summed: the time it sat idle waiting for a plan
    param_digest: str = ""
    divergence: Optional[float] = None  # from the latest SyncAcked
    # The state's RankIndex (``_rank_index``), told of every write to an indexed field.
    # Last on purpose: a copy restores the slots in order, so the fields it indexes are
    # set (as plain writes) before it is there to be told.
    index: Optional[RankIndex] = field(default=None, compare=False, repr=False)

    def set_quietly(self, name: str, value: Any) -> None:
        """Write without telling the index: only for a caller that tells it itself, at
        once for many records (``RankIndex.moved``)."""
        object.__setattr__(self, name, value)

    def count_batch(self, samples: int, spent_ms: float, wait_ms: float) -> None:
        """One batch into the rank's totals (``spent_ms``: trained, summed only when a
        sane time: a hostile frame's NaN, infinity or negative is not, so the summary stays
        JSON). These fields are not indexed (``_COUNTERS``), so they are written past
        ``__setattr__``'s hook: per batch, on the hot path (0.55 vs 1.2 us)."""
        _set = object.__setattr__
        _set(self, "batches", self.batches + 1)
        _set(self, "samples", self.samples + samples)
        if 0.0 <= spent_ms < _INF:
            _set(self, "train_ms", self.train_ms + spent_ms)
        _set(self, "wait_ms", self.wait_ms + wait_ms)

    def advance_step(self, step: int) -> None:
        """``last_step = step`` for a newer batch. A rank already among the index's movers
        (ACTIVE, steps no round folded) stays one at a higher step: the index has nothing to
        learn, so the write goes past ``__setattr__``'s hook (per batch, on the hot path)."""
        index = self.index
        if index is not None and step > self.last_step and self.rank in index.movers:
            object.__setattr__(self, "last_step", step)
        else:
            self.last_step = step

    def mean_batch_ms(self) -> float:
        """The rank's ms per batch over the batches it reported (0.0: none yet)."""
        return self.train_ms / self.batches if self.batches else 0.0

    def __setattr__(self, name: str, value: Any) -> None:
        index = getattr(self, "index", None) if name in INDEXED_FIELDS else None
        if index is None:
            object.__setattr__(self, name, value)
            return
        old = getattr(self, name)
        object.__setattr__(self, name, value)
        index.changed(self, name, old)


_INF = float("inf")
_COUNTERS = frozenset({"batches", "samples", "train_ms", "wait_ms"})  # what count_batch writes
assert not _COUNTERS & INDEXED_FIELDS, "count_batch must not write past the index"


@dataclass(slots=True)
class DispatchState:
    # epoch -> rank -> (offset, size): the cached equal plans (§8.2).
    plans: dict[int, dict[int, tuple[int, int]]] = field(default_factory=dict)
    # epoch -> rank -> ranges the rank owns (its plan, then extensions, in order).
    assigned: dict[int, dict[int, list[tuple[int, int]]]] = field(default_factory=dict)
    # epoch -> rank -> samples it reported trained (BatchDone) in that epoch.
    reported: dict[int, dict[int, int]] = field(default_factory=dict)
    rank_epoch: dict[int, int] = field(default_factory=dict)
    last_dispatched: Optional[int] = None
    dispatched_at: dict[int, float] = field(default_factory=dict)
    announced_role: Optional[int] = None  # last SetEpochCallbackRole broadcast (st.roles.epoch_role)
    extensions: int = 0  # ExtendPartition commands sent (diagnostics)
    # Sync, a rank joined mid-epoch (``_repartition``): joiners still owed a share of the
    # live epoch, the trims awaiting their answer (rank -> (command_id, epoch, joiners,
    # allotment ((to, samples), ...))),
    # and how trims ended ("sent", "answered", "settled_by_resync", "void", "dropped":
    # the member died) with the samples they moved ("samples").
    share_owed: list[int] = field(default_factory=list)
    trims: dict[int, tuple[int, int, tuple[int, ...], tuple[tuple[int, int], ...]]] = field(default_factory=dict)
    trim_counts: dict[str, int] = field(default_factory=dict)


@dataclass(slots=True)
class RoundState:
    phase: Any = IDLE
    cycle: int = 0
    version: int = 0  # finished rounds (the Update.version)
    global_step: int = 0
    ranks: tuple[int, ...] = ()  # the open round's participants
    acked: dict[int, int] = field(default_factory=dict)  # rank -> step_count acked
    opened_at: float = 0.0
    window_steps: int = 0  # steps folded by the acks of the open round
    divergence: dict[int, float] = field(default_factory=dict)
    window: dict[int, int] = field(default_factory=dict)  # rank -> steps its ack folded
    gate_reason: str = ""  # why the gate last said no (or yes)
    open_s: float = 0.0  # total time rounds were open (trigger -> finish): averaging overhead
    refused: dict[int, str] = field(default_factory=dict)  # open round: rank -> why its contribution was refused


@dataclass(slots=True)
class EpochCoverage:
    epoch: int
    expected: int
    committed: bytearray  # 1 per committed position; released (emptied) once frozen
    unique: int = 0
    trained: int = 0  # committed count, duplicates included
    duplicates: int = 0
    discarded: int = 0  # trained by a rank that died before its window was folded
    frozen: bool = False
    # Batches of this epoch on the ranks' pending lists: ``freeze`` walks the lists only
    # when some are left (at a 4,096-rank epoch's end the lists hold the next epoch's).
    pending: int = 0


@dataclass(slots=True)
class CoverageState:
    epochs: dict[int, EpochCoverage] = field(default_factory=dict)
    # rank -> [(epoch, offset, samples, step_count)], in step order, not yet committed.
    pending: dict[int, list[tuple[int, int, int, int]]] = field(default_factory=dict)


@dataclass(slots=True)
class EpochSums:
    """One epoch's running sums over its ``ChunkDone``s (``_metrics._add``), a column per
    quantity indexed by rank (grown to the highest rank that reported; zeros for the
    rest): the epoch-boundary step hands the columns to the aggregation as they are,
    rather than gathering one record per rank of a world of thousands."""

    batches: list[int] = field(default_factory=list)
    samples: list[int] = field(default_factory=list)
    loss_b: list[float] = field(default_factory=list)  # avg_loss x batches
    epoch_ms: list[float] = field(default_factory=list)
    share_ms: list[float] = field(default_factory=list)  # share_complete_ms
    scalars: dict[int, dict[str, list[Any]]] = field(default_factory=dict)  # rank -> name -> [sum, count]


@dataclass(slots=True)
class MetricsState:
    # epoch -> rank -> the chunk_seq of each ChunkDone, in arrival order: what the
    # duplicate check and the aggregation rule need (the metrics are in ``sums``); not
    # the events, which an epoch's aggregation would free by the thousand.
    chunks: dict[int, dict[int, list[int]]] = field(default_factory=dict)
    # epoch -> its running sums over those chunks, kept as they arrive so that the
    # epoch-boundary step does not walk every chunk.
    sums: dict[int, EpochSums] = field(default_factory=dict)
    last_aggregated: Optional[int] = None
    history: list[dict[str, Any]] = field(default_factory=list)
    late_chunks: int = 0


@dataclass(slots=True)
class FinalEval:
    target: int
    sent_at: float
    answered: bool = False
    accuracy: Optional[float] = None
    error: Optional[str] = None
    tried: tuple[int, ...] = ()  # ranks asked, in order (the last is ``target``)


@dataclass(slots=True)
class RunState:
    phase: Any = FORMING
    formed_at: Optional[float] = None
    final_eval: Optional[FinalEval] = None
    deadline: Optional[float] = None  # SHUTTING_DOWN / STOPPING: give up waiting at
    stop_reason: str = ""
    ok: Optional[bool] = None
    reason: str = ""
    # FORMING: the first event's time (the formation deadline counts from it), and why
    # each slot that is not admitted is not (its last refusal, or how it was lost).
    forming_since: Optional[float] = None
    not_admitted: dict[int, str] = field(default_factory=dict)
    cohort_votes: dict[int, tuple] = field(default_factory=dict)  # rank -> ((sig, len), route) of its deferred hello
    joins: list[dict[str, Any]] = field(default_factory=list)  # mid-run joins: {rank, host, admitted_at, joined_at, cycle, refill, restart_count}
    formed_with: tuple[int, ...] = ()  # the ranks the world formed with (elastic: maybe fewer than the slots)
    # FORMING, what can never come (``_formation``): slot -> why its process ended for good;
    # an unpinned process that ended for good before taking a slot ("agent/local" -> why);
    # slots whose holder the cohort vote evicted (their process's exit is no loss).
    gone: dict[int, str] = field(default_factory=dict)
    unplaced_gone: dict[str, str] = field(default_factory=dict)
    evicted: set[int] = field(default_factory=set)
    # Members the shell refused mid-run (``RankRefused``), and why: the run then ends not ok.
    refused: dict[int, str] = field(default_factory=dict)


def _plain(x: Any) -> Any:
    """A comparable tree of plain values for ``x`` (objects by their attributes)."""
    if x is None or isinstance(x, (bool, int, float, str, bytes)):
        return x
    if isinstance(x, (list, tuple, deque)):
        return (type(x).__name__, tuple(_plain(v) for v in x))
    if isinstance(x, dict):
        return ("dict", tuple((k, _plain(v)) for k, v in sorted(x.items(), key=lambda kv: kv[0])))
    if isinstance(x, (set, frozenset)):
        return ("set", frozenset(x))
    if is_dataclass(x):
        return x  # dataclasses compare by value already
    if hasattr(x, "__dict__"):
        return (type(x).__name__, _plain(vars(x)))
    return x


@dataclass(slots=True, eq=False)
class CadenceState:
    """Cadence policy: the ElChe engine and the progressive dispatch ledger.

    ``window_mark[r]`` is the rank's last reported step when the latest round opened
    (its ``RequestParams``): steps since then are its current window -- the round
    overlaps the next window, so the reduce barrier counts from the trigger, not from
    the finish (folding still goes by the acked snapshot step). ``in_flight[r]`` is the
    chunk ``(epoch, offset, size)`` the rank was handed last and is training or will (a
    trigger's window may be queued behind a run-ahead chunk, ``cadence._dispatcher._ahead``,
    and a chunk is extended before the rank runs dry, ``top_up``; the pool counts what is
    left of all of them, within the rank's reduce budget and run-ahead room).
    ``barrier_at`` is when, during the open round, every rank had reached its window
    end (the round then delays the next one); ``exposed_s`` sums those delays.
    """

    elche: Any  # _elche.ElChe
    ledger: Any  # _window.WindowLedger: timing of the current window
    guard: Any  # _guards.Guard
    meta: Any  # Optional[_lr_meta.LrEventMeta]
    overshoot: Any  # _overshoot.OvershootBudget
    pools: dict[int, Any] = field(default_factory=dict)  # epoch -> _chunk_pool.ChunkPool
    final_plan: Any = None  # _chunk_pool.FinalWindowPlan pinned for the current window
    in_flight: dict[int, tuple[int, int, int]] = field(default_factory=dict)
    window_mark: dict[int, int] = field(default_factory=dict)
    throttled: set[int] = field(default_factory=set)
    last_lr: dict[int, float] = field(default_factory=dict)  # rank -> latest BatchDone.lr > 0
    last_wait_ms: dict[int, float] = field(default_factory=dict)  # rank -> latest BatchDone.wait_ms > 0
    last_sync_ms: float = 0.0  # what the last finished round delayed training (ms; see _feedback)
    # The longest batch any rank reported (ms, capped at the liveness timeout): how long an
    # open round may wait for a rank to reach a batch boundary (``_boundary.run_ahead_room``).
    slowest_batch_ms: float = 0.0
    barrier_at: Optional[float] = None  # open round: when every rank reached its window end
    exposed_s: float = 0.0  # total time rounds delayed the next window (summary)
    averages: dict[int, int] = field(default_factory=dict)  # epoch -> rounds finished in it
    last_verdict: str = ""
    # The policy's switches for the engines (``_policy``): set by the dispatcher's setup.
    barrier_paced: bool = True  # False under Async: no final-window plan, probe/proportional chunks
    overshoot_on: bool = False  # True under Async: the reduce budget has a look-ahead
    streams_epochs: bool = False  # epoch e+1 opens while e is live (Async, and Cadence at its boundary)
    # Incremental views, so that no batch walks every rank (``cadence._views``):
    # ranks a wake may serve (a superset of those it can), a lazy min-heap of ranks that
    # may block the gate (``in_open``: its members), and ElChe's counts with the ranks
    # that are not ACTIVE zeroed, with their sum, keyed by the rank index's alive_version.
    wakeable: set[int] = field(default_factory=set)
    open_windows: list[int] = field(default_factory=list)
    in_open: set[int] = field(default_factory=set)
    # Ranks taken out of ``wakeable`` / of ``open_windows`` since the last ``rearm``: what
    # it puts back (with the ranks the index released), not every ACTIVE rank; and the
    # ranks a wake found leaving the run's tail (``_boundary``), out of ``wakeable``
    # until a rearm or until nobody trains (``cadence._views``).
    dropped_wake: set[int] = field(default_factory=set)
    dropped_open: set[int] = field(default_factory=set)
    parked: set[int] = field(default_factory=set)
    # A rearm put many ranks back into ``open_windows``: the gate's next pass sifts them
    # in one sweep rather than one pop each (``_dispatcher.windows_done``).
    open_refilled: bool = False
    alive_counts: Optional[tuple[int, list[int], int, bool]] = None  # (+ calibrated or speed-hinted)
    # The Throttle's floor (``max_batch_diff``): a lazy min-heap of (window steps, rank)
    # lower bounds, rebuilt when a window mark moves (``marks_version``) or the ACTIVE set
    # changes (a new process's steps restart at 0) -- ``_dispatcher._min_window_steps``.
    marks_version: int = 0
    steps_floor: list[tuple[int, int]] = field(default_factory=list)
    steps_floor_key: tuple[int, int] = (-1, -1)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, CadenceState):
            return NotImplemented
        return _plain({k: getattr(self, k) for k in self.__slots__}) == _plain(
            {k: getattr(other, k) for k in other.__slots__}
        )


@dataclass(slots=True)
class ResyncState:
    """Coordinator restarts and the ranks' resynchronisation (``_resync``).

    ``awaiting[r]``: when the rank was asked to resync (it is ACTIVE and has not sent its
    ``RankResynced`` since the latest restart). ``sent[r]``: the commands this incarnation
    sent it while awaiting, as ``(command_id, kind, epoch, offset, size)`` -- those its
    report may not reflect yet. ``log``: one row per restart for the run summary.
    """

    restarts: int = 0
    # The last command id the journal replayed to at the latest restart: a rank that
    # reports a later one saw commands the journal lost (``_resync.on_resynced``).
    journal_end: Optional[int] = None
    awaiting: dict[int, float] = field(default_factory=dict)
    sent: dict[int, list[tuple[int, str, int, int, int]]] = field(default_factory=dict)
    log: list[dict[str, Any]] = field(default_factory=list)


@dataclass(slots=True)
class CheckpointState:
    """Consensus checkpoints in flight and the resume point (``_checkpointing``).

    ``pending[version] = (cycle, tried)``: a save asked of ``tried[-1]`` not answered
    yet (earlier entries refused it). ``resume_holes[e]``: the uncovered ranges of
    epoch ``e`` recorded by the resumed checkpoint (the resume epoch and any later one
    it had samples of), dispatched instead of the whole epoch.
    """

    armed_epoch: Optional[int] = None  # last epoch whose end armed a regular checkpoint
    last_version: Optional[int] = None  # the latest version a save was decided for
    # The consensus cycle of ``last_version``'s save and the epoch its last meta was
    # staged for: a later epoch aggregated at the same consensus stages its own meta
    # for that save (``_checkpointing``). None after a resume: no save of this run.
    last_cycle: Optional[int] = None
    last_epoch: Optional[int] = None
    pending: dict[int, tuple[int, tuple[int, ...]]] = field(default_factory=dict)
    given_up: int = 0
    # A checkpoint due while a round was open (some of its acks may already have
    # committed batches that only its consensus holds): taken when that round finishes,
    # at its cycle (``_checkpointing.on_round_finished``). The value is the reason.
    deferred: Optional[str] = None
    deferred_epochs: list[int] = field(default_factory=list)  # each gets its own meta at that finish
    abandoned: list[int] = field(default_factory=list)  # versions given up (no rank could save them)
    resume_holes: dict[int, tuple[tuple[int, int], ...]] = field(default_factory=dict)


@dataclass(slots=True)
class RoleState:
    checkpoint_role: Optional[int] = None
    eval_role: Optional[int] = None
    epoch_role: Optional[int] = None
    dirty: bool = True  # the epoch role is not announced yet
    calibration_elected: bool = False  # the one-time calibration election ran
    checkpoint_ewma_ms: Optional[float] = None
    eval_ewma_ms: Optional[float] = None
    epoch_fn_ewma_ms: Optional[float] = None
    pending_eval_intent: bool = False
    pending_checkpoint_intent: bool = False
    pending_evals: dict[int, tuple[int, int]] = field(default_factory=dict)  # schedule -> (epoch, rank)
    evals: list[dict] = field(default_factory=list)  # [{epoch, metric}] answered non-final evals


@dataclass(slots=True)
class CollectiveState:
    generation: int = 0  # 0: no group yet
    members: tuple[int, ...] = ()  # global ranks of the current generation, in dense order
    members_version: int = -1  # the rank index's alive_version when members were chosen
    store_host: Optional[int] = None  # members[0]: the lowest member not tried
    tried: tuple[int, ...] = ()  # store hosts that did not answer / whose group did not form
    store_addr: str = ""  # "" until the store host's StoreReady
    announced_at: float = 0.0  # when the current generation was announced
    ready_at: Optional[float] = None  # when its store address went out
    reform_reason: str = ""  # a re-formation is due for this reason (set by a failure)
    host_failed: bool = False  # ... and the store host is to blame (it joins ``tried``)
    exhausted: str = ""  # every member tried without a group forming: why (the step's ``fail`` rule ends the run)
    reforms: int = 0  # generations after the first
    failures: int = 0  # CollectiveFailed reports that caused a re-formation
    rendezvous_s: float = 0.0  # summed announce -> store address time
    # Joining a running world (issue 12): the members of this generation that are JOINING
    # and get the parameters by its seed broadcast; no round opens while any is left.
    joiners: tuple[int, ...] = ()
    seed_failures: int = 0  # seed broadcasts failed in a row (``SEED_ATTEMPTS`` drops the joiners)
    seeds: int = 0  # joiners seeded by a broadcast


@dataclass(slots=True)
class CoordinatorState:
    config: CoreConfig
    ranks: list[RankRecord]
    dispatch: DispatchState = field(default_factory=DispatchState)
    rounds: RoundState = field(default_factory=RoundState)
    coverage: CoverageState = field(default_factory=CoverageState)
    metrics: MetricsState = field(default_factory=MetricsState)
    run: RunState = field(default_factory=RunState)
    cadence: Optional[CadenceState] = None  # set by the Cadence dispatcher's setup
    collective: Optional[CollectiveState] = None  # the collective plane's (``_collective.setup``)
    checkpoints: CheckpointState = field(default_factory=CheckpointState)
    roles: RoleState = field(default_factory=RoleState)  # set from the config by initial_state
    resync: ResyncState = field(default_factory=ResyncState)  # coordinator restarts (_resync)
    cohort_sig: Optional[bytes] = None
    cohort_len: Optional[int] = None
    last_beacon: Optional[float] = None
    beats: int = 0
    # Ranks sent a command since the last beacon: they heard the coordinator (``beacon``).
    sent_since_beacon: set[int] = field(default_factory=set)
    now: float = 0.0  # the latest event time seen
    next_command_id: int = 1
    ignored: dict[str, int] = field(default_factory=dict)  # benign drops, by cause
    # rule -> the last reason the step's fixed point gave for it (``/status``: why not yet)
    reasons: dict[str, str] = field(default_factory=dict)
    # Incremental views of ``ranks`` (``_rank_index``): derived, so not compared.
    index: RankIndex = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        self.index = RankIndex(self.ranks)
        for rec in self.ranks:
            rec.index = self.index

    # -- queries ---------------------------------------------------------------------

    @property
    def total_samples(self) -> int:
        """The epoch size: the configured one, else the cohort's dataset length."""
        return self.config.total_samples or (self.cohort_len or 0)

    def route_of(self, rank: int) -> Optional[tuple[bytes, ...]]:
        """The ZeroMQ route of an addressable rank (JOINING or ACTIVE), else None."""
        if 0 <= rank < len(self.ranks) and self.addressable(rank):
            return self.ranks[rank].route
        return None

    def unpinned_slot_of(self, agent: str, local_rank: int) -> Optional[int]:
        """The slot an unpinned process of ``agent`` (its ``local_rank``) took last, or None."""
        if not agent:
            return None
        return next((r.rank for r in self.ranks if r.agent == agent and r.local_rank == local_rank), None)

    def admitted_on(self, route: tuple[bytes, ...], incarnation: int) -> Optional[int]:
        """The addressable rank admitted on ``route`` with ``incarnation`` (an unpinned
        hello's slot, for the shell), or None."""
        return next((r.rank for r in self.ranks if r.route == route and r.incarnation == incarnation
                     and self.addressable(r.rank)), None)  # fmt: skip

    def addressable(self, rank: int) -> bool:
        return self.ranks[rank].phase is JOINING or self.ranks[rank].phase is ACTIVE

    def alive_ranks(self) -> list[int]:
        """ACTIVE ranks in ascending order: the formed world's survivors (a new list)."""
        return list(self.index.alive())

    def alive_count(self) -> int:
        return self.index.alive_count()

    def alive_mask(self) -> list[bool]:
        """Per slot: is the rank ACTIVE (a window's report and ElChe's cap read this)."""
        return [rec.phase is ACTIVE for rec in self.ranks]

    def addressable_ranks(self) -> list[int]:
        return self.index.addressable()

    def any_unfolded(self) -> bool:
        """Some ACTIVE rank has steps no consensus folded yet."""
        return bool(self.index.movers)

    def index_drift(self) -> list[str]:
        """What the rank index disagrees with a recount about (empty: nothing); the
        property tests assert it after every step."""
        rs = self.rounds
        return self.index.drift(self.ranks, rs.ranks, rs.acked, rs.phase is PENDING)

    def unfolded(self, rank: int) -> int:
        """Steps the rank reported that no consensus has folded in yet."""
        rec = self.ranks[rank]
        return max(0, rec.last_step - rec.folded_step)

    # -- the one place commands addressed to a rank are made --------------------------

    def send(self, out: list[Command], rank: int, **cmd: Any) -> None:
        """Append ``Send(rank, Control(command_id=next, **cmd))``."""
        out.append(Send(rank, self._numbered(rank, cmd)))
        self.sent_since_beacon.add(rank)

    def send_last_word(self, out: list[Command], rank: int, **cmd: Any) -> None:
        """``send``, for a rank this step then forgets: a ``LastWord``, which carries its route."""
        out.append(LastWord(rank, self._numbered(rank, cmd), self.ranks[rank].route))

    def _numbered(self, rank: int, cmd: dict) -> pb.Control:
        """``Control(command_id=next, **cmd)`` for an addressable ``rank``."""
        self._check_addressable(rank)
        ctl = pb.Control(command_id=self.next_command_id, **cmd)
        self.next_command_id += 1
        return ctl

    def control(self, out: list[Command], rank: int) -> pb.Control:
        """Append ``Send(rank, Control(command_id=next))`` and return the Control, for the
        caller to set its command in place (``ctl.start_epoch.plan.epoch = e``): what a
        broadcast to thousands of ranks does, since protobuf (upb) builds a message field
        by field several times faster than from nested keyword messages, which it copies."""
        self._check_addressable(rank)
        ctl = pb.Control(command_id=self.next_command_id)
        self.next_command_id += 1
        out.append(Send(rank, ctl))
        self.sent_since_beacon.add(rank)
        return ctl

    def send_built(self, out: list[Command], rank: int, kind: str, build: Callable[..., None], args: tuple = ()) -> None:
        """Append ``Send.built(rank, next id, kind, build, args)``: its Control is built
        when first read, as ``build(pb.Control(command_id=id), *args)`` -- what a command
        to every one of thousands of ranks (a dispatch, a round, a heartbeat) sends, so
        that the step does not build N messages the shell builds again when it sends them
        (``Send``). ``args``: values nothing changes later."""
        rec = self.ranks[rank] if 0 <= rank < len(self.ranks) else None
        if rec is None or (rec.phase is not ACTIVE and rec.phase is not JOINING):
            self._check_addressable(rank)
        cid = self.next_command_id
        self.next_command_id = cid + 1
        out.append(Send.built(rank, cid, kind, build, args))
        self.sent_since_beacon.add(rank)

    def send_built_each(self, out: list[Command], ranks: Sequence[int], kind: str, build: Callable[..., None],
                        args: tuple = ()) -> None:  # fmt: skip
        """``send_built`` to each of ``ranks`` in order, with the same ``args``: every rank
        is checked addressable before anything is appended."""
        self._check_all_addressable(ranks)
        cid = self.next_command_id
        out.extend(Send.each(ranks, cid, kind, build, args))
        self.next_command_id = cid + len(ranks)
        self.sent_since_beacon.update(ranks)

    def send_built_zip(self, out: list[Command], ranks: list[int], kind: str, build: Callable[..., None],
                       args: list[tuple], wire: Optional[Encoder] = None) -> None:  # fmt: skip
        """``send_built`` to each of ``ranks`` in order, ``args[i]`` for ``ranks[i]``;
        ``wire``: ``build``'s bytes written directly (``Send.each_of``)."""
        self._check_all_addressable(ranks)
        cid = self.next_command_id
        out.extend(Send.each_of(ranks, cid, kind, build, args, wire))
        self.next_command_id = cid + len(ranks)
        self.sent_since_beacon.update(ranks)

    def _check_all_addressable(self, ranks: Sequence[int]) -> None:
        if self.index.phases[ACTIVE].issuperset(ranks):
            return  # the common case, one C-level pass (the index follows every phase write)
        recs = self.ranks
        for r in ranks:  # the common case (ACTIVE, JOINING) read inline: this runs per rank of a dispatch
            phase = recs[r].phase if 0 <= r < len(recs) else None
            if phase is not ACTIVE and phase is not JOINING:
                self._check_addressable(r)

    def _check_addressable(self, rank: int) -> None:
        phase = self.ranks[rank].phase if 0 <= rank < len(self.ranks) else None
        if phase is not JOINING and phase is not ACTIVE:
            phase = self.ranks[rank].phase if 0 <= rank < len(self.ranks) else "no such rank"
            raise LocalViolation(f"refusing to address rank {rank} ({phase!r})")

    def count_ignored(self, cause: str) -> None:
        self.ignored[cause] = self.ignored.get(cause, 0) + 1
