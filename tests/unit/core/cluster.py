"""Cluster: the real core against N in-memory ranks, each the real rank machine.

Every rank is ``flodl.rank.RankMachine`` -- the machine ``flodl_worker.rank`` drives with
torch and a socket and ``flodl.sim`` in virtual time -- in a small shell (``RankShell``)
with no tensors: so the core's scenario and property tests run the real rank's plans,
throttle, credit, folded step, checkpoint arming and resync report. What a rank sends is
decoded by the coordinator's own translation (``flodl.core.timing_event``).

The shell, as ``pump_once`` drives it (or a test, step by step):

* ``deliver_one`` hands the next control to the machine (``IncarnationSeen``, then
  ``ControlReceived``) and carries out its commands; ``train_one`` trains the machine's
  next ``TrainBatch`` (``speed_ms`` of the rank's own device clock, ``data_ms`` 1.0, loss
  ``2 / (1 + 0.05 step)``), reporting ``BatchDone``, and sends the chunk's ``Metrics``
  (``ChunkDone``: one per plan, ``epoch_ms`` the device clock's span) when it runs out.
* ``RequestParams``: the machine snapshots (``TakeSnapshot``); the reducer is simulated
  -- ``send_ack``: the consensus comes back (as the reducer sends it: to every
  contributor, ``None`` only when the round's whole mass is 0; its arrays are the marker
  ``(cycle,)``) and the machine's ``ApplyConsensus`` is acked
  (``SyncAcked{step_count = its ack_step}``). ``saved`` lists what each
  ``SaveCheckpoint`` saved (``params``: the held consensus marker, or None: as is).
* ``ExecuteEval`` answers ``eval_metric`` / ``eval_error``; ``Shutdown`` sends
  ``RankExiting`` (and, with ``agent_reports_exit``, the agent's ``RankExitReported``).
* Checkpoints reach the machine (arming, refusals); its answers (saved, or refused by
  name) are held in ``saves_due`` unless ``answer_checkpoints`` -- tests answer them by
  hand with ``CheckpointDone`` or ``send_saves``. ``answer_checkpoints`` also plays the
  coordinator's shell with a checkpoint directory: each ``Checkpoint`` names a path
  (without one the machine refuses it by name).
* ``scalars``: values a metrics recorder would add to every chunk (the rank itself adds
  none).

Fault knobs are wrappers around the machine, never in it: ``deaf`` (control kinds dropped
before the machine), ``defer_acks`` (the consensus waits for ``send_ack``),
``defer_chunks`` / ``hold_chunks`` (the chunk's metrics wait for ``send_chunk``; the rank
trains nothing meanwhile; its batches were reported before, as a rank of protocol 1.2
does: ``carry_batches`` off, see below), ``race_throttle`` (one batch lands between the snapshot and
the rest of the inbox), ``silence`` (hung: nothing in or out), ``kill``. The
coordinator's incarnation starts at 1 and changes with every ``CoordinatorRestarted``
fed; a control carries the incarnation that sent it: each machine notices a new one on
the first frame of it that it handles and sends its resync report (a frame of an
incarnation it left behind is dropped, ``stale_incarnation``).

Time is virtual: ``advance(dt)`` moves ``now``, lets every live, non-silent rank send a
heartbeat once per second of virtual time, and feeds a ``Tick``. Nothing sleeps.

Every event fed is kept in ``journal`` and every command in ``commands``; the cluster
checks, as commands arrive, that no ``Send`` addresses a rank the core already forgot
and that ``command_id``s strictly increase.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Optional

from flodl.core import (
    CheckpointDone,
    CoordinatorRestarted,
    CoreConfig,
    EvalDone,
    Event,
    ForgetRank,
    OpenRound,
    HeartbeatSeen,
    RankExiting,
    RankExitReported,
    RankHello,
    Reply,
    RunFinished,
    SeedJoiner,
    Send,
    SyncAcked,
    Tick,
    UNPINNED,
    initial_state,
    step,
    replay,
)
from flodl.rank import (
    AbandonRounds,
    Admitted,
    ApplyConsensus,
    BatchTrained,
    ConsensusReady,
    ControlReceived,
    Drop,
    Exit,
    FormGroup,
    IncarnationSeen,
    RankMachine,
    RunEpochFn,
    RunEval,
    SaveCheckpoint,
    SeedApplied,
    SendMetrics,
    SendTiming,
    TakeSnapshot,
    TrainBatch,
    Warn,
)
from flodl.wire import pb
from flodl.core import chunk_events
from flodl.core import timing_event

MODEL_SIG = b"\x5a" * 8


@dataclass
class RankShell:
    """A rank of the cluster: the real ``flodl.rank.RankMachine`` in a virtual-time shell,
    with the cluster's fault knobs around it (never inside it)."""

    rank: int
    route: tuple[bytes, ...]
    incarnation: int = 0
    speed_ms: float = 10.0
    inbox: deque = field(default_factory=deque)
    received: list = field(default_factory=list)
    alive: bool = True
    silent: bool = False
    admitted: bool = False
    refused: Optional[str] = None
    forgotten: bool = False
    exited: bool = False
    ack_due: Optional[tuple] = None  # (cycle, step at the snapshot) whose consensus has not come back
    chunk_due: Optional[int] = None  # epoch of the chunk whose metrics are held (metrics_due)
    metrics_due: Optional[Any] = None  # the pb.Metrics the machine emitted, not sent yet
    last_hb: float = 0.0
    trained: list = field(default_factory=list)  # (epoch, offset, samples, step)
    deaf: set = field(default_factory=set)  # control kinds dropped before the machine (fault injection)
    clock_ms: float = 0.0  # the rank's device time: speed_ms per batch (a chunk's epoch_ms)
    saves_due: list = field(default_factory=list)  # CheckpointDone answers held (answer_checkpoints off)
    saved: list = field(default_factory=list)  # (version, cycle named, params saved) of each SaveCheckpoint
    drops: dict = field(default_factory=dict)
    warnings: list = field(default_factory=list)
    seed_due: bool = False  # joining a running world: the coordinator asked the shell to send the seed
    seeded: bool = False  # ... and it arrived
    said_step: int = 0  # the last step the rank reported (a batch frame, a Metrics' batches, a resync)
    m: Any = None

    def __post_init__(self) -> None:
        self.m = RankMachine(self.rank)

    @property
    def active(self) -> bool:
        return self.alive and not self.silent and not self.exited and not self.forgotten

    @property
    def step(self) -> int:
        return self.m.local_step

    @property
    def throttled(self) -> bool:
        return self.m.throttled

    @property
    def work(self) -> list:
        """[epoch, offset, size] handed to this rank and not trained yet."""
        return [[p.epoch, p.partition_offset, p.partition_size] for p in self.m.held_positions()]


def _said_step(kind: str, body: Any) -> int:
    """The last step a timing frame reports (0: it reports none)."""
    if kind == "batch":
        return body.step_count
    if kind == "batches":
        return body.batch[-1].step_count if body.batch else 0
    if kind == "resync":
        return body.local_step
    return 0


class Cluster:
    """The core and its ranks (see the module docstring); ``ranks[r]`` is a ``RankShell``."""

    def __init__(
        self,
        world_size: int = 3,
        total: int = 100,
        batch_size: int = 8,
        epochs: int = 3,
        *,
        config: Optional[CoreConfig] = None,
        speeds: Optional[list[float]] = None,
        eval_metric: float = 0.875,
        eval_error: Optional[str] = None,
        defer_chunks: bool = False,
        carry_batches: Optional[bool] = None,
        defer_acks: bool = False,
        race_throttle: bool = False,
        agent_reports_exit: bool = False,
        answer_checkpoints: bool = False,
        scalars: Optional[dict] = None,
        dt: float = 0.01,
        **cfg: Any,
    ) -> None:
        # A frame per batch unless a test asks for coalesced reports: the scripted scenarios
        # here step batch by batch (the property tests draw batch_report_ms).
        cfg.setdefault("batch_report_ms", 0.0)
        self.config = config or CoreConfig(
            world_size=world_size, batch_size=batch_size, num_epochs=epochs, **cfg
        )
        self.total = total
        self.state = initial_state(self.config)
        self.now = 0.0
        self.dt = dt
        self.eval_metric = eval_metric
        self.eval_error = eval_error
        self.defer_chunks = defer_chunks
        # The ranks send a chunk's last batches in its Metrics (protocol 1.3) unless off:
        # by default off with ``defer_chunks``, whose scenarios hold a chunk's metrics back
        # after its batches arrived (what a 1.2 rank, still admitted, sends).
        self.carry_batches = not defer_chunks if carry_batches is None else carry_batches
        self.defer_acks = defer_acks
        self.race_throttle = race_throttle
        self.hold_chunks = False  # pump_once leaves due ChunkDones unsent while True
        self.agent_reports_exit = agent_reports_exit
        self.answer_checkpoints = answer_checkpoints
        self.scalars = dict(scalars or {})  # name -> per-batch value a metrics recorder adds to every chunk
        self.coordinator_incarnation = 1  # changes with every CoordinatorRestarted fed
        self.sent_by: dict[int, int] = {}  # command_id -> the incarnation that sent it (its frame's stamp)
        self.round_ranks: dict[int, set] = {}  # cycle -> the ranks its OpenRound expects
        self.round_weights: dict[int, dict] = {}  # cycle -> {rank: snapshot weight}
        speeds = speeds or [10.0 * (1 + r) for r in range(self.config.world_size)]
        self.ranks = [
            RankShell(r, (b"relay", b"rank-%d" % r), speed_ms=speeds[r]) for r in range(self.config.world_size)
        ]
        self.retired: list[RankShell] = []  # shells of rank processes that were started again (respawn)
        self.journal: list[Event] = []  # every event fed, refused ones included
        self.trace: list[tuple[Event, list]] = []  # (event, its commands) for accepted events
        self.work_events = 0  # accepted events other than liveness traffic
        self.commands: list = []
        self.finished: Optional[RunFinished] = None
        self._last_command_id = 0

    # -- feeding the core ---------------------------------------------------------------

    def restart_coordinator(self, incarnation: int) -> None:
        """kill -9 and restart on the journal: the state is rebuilt by replay (it must equal
        the live one), every command not yet handled dies with the process, and the rank
        machines hear the new incarnation on their next frame and send their resync report."""
        rebuilt = replay(self.config, self.journal)
        assert rebuilt == self.state
        self.state = rebuilt
        for r in self.ranks:
            r.inbox.clear()
            r.ack_due = None
            r.seed_due = False
        self.feed(CoordinatorRestarted(now=self.now, incarnation=incarnation))

    def feed(self, ev: Event) -> list:
        if isinstance(ev, CoordinatorRestarted):
            self.coordinator_incarnation += 1
        self.journal.append(ev)
        self.state, cmds = step(self.state, ev)
        self.trace.append((ev, cmds))
        if not isinstance(ev, (Tick, HeartbeatSeen)):
            self.work_events += 1
        self.commands.extend(cmds)
        for c in cmds:
            self._route(c)
        return cmds

    def _route(self, c: Any) -> None:
        if isinstance(c, Send):
            r = self.ranks[c.rank]
            assert not r.forgotten, f"command {c.kind} sent to forgotten rank {c.rank}"
            assert c.control.command_id > self._last_command_id, "command ids must increase"
            self._last_command_id = c.control.command_id
            self.sent_by[c.control.command_id] = self.coordinator_incarnation
            r.received.append(c.control)
            if r.alive and not r.exited:
                r.inbox.append(self._stamped(c.control))
        elif isinstance(c, Reply):
            for r in self.ranks:
                if r.route == c.route:
                    if c.ack.accepted:
                        r.admitted = True
                        if self._seen(r, hello_ack=True) and not r.m.admitted:
                            spec = pb.RunSpec()
                            spec.CopyFrom(c.ack.run)
                            spec.batches_in_metrics = spec.batches_in_metrics and self.carry_batches
                            self._do(r, r.m.handle(Admitted(spec=spec)))
                    else:
                        r.refused = c.ack.reason
        elif isinstance(c, OpenRound):
            self.round_ranks[c.cycle] = set(c.ranks)
        elif isinstance(c, ForgetRank):
            self.ranks[c.rank].forgotten = True
        elif isinstance(c, SeedJoiner):
            self.ranks[c.rank].seed_due = True
        elif isinstance(c, RunFinished):
            self.finished = c

    def _stamped(self, ctl: pb.Control) -> pb.Control:
        """What the coordinator's shell adds on the way out: with ``answer_checkpoints``
        (a checkpoint directory), a ``Checkpoint`` names the path to save to."""
        if not self.answer_checkpoints or ctl.WhichOneof("cmd") != "checkpoint" or ctl.checkpoint.path:
            return ctl
        out = pb.Control()
        out.CopyFrom(ctl)
        out.checkpoint.path = f"ckpt/v{ctl.checkpoint.version}/rank{ctl.checkpoint.target_rank}"
        return out

    def hello(self, rank: int, **over: Any) -> list:
        """Rank ``rank``'s hello (``over`` replaces fields; ``hello_rank=UNPINNED``: it names none)."""
        r = self.ranks[rank] if 0 <= rank < len(self.ranks) else None
        kw = dict(
            now=self.now,
            route=r.route if r else (b"stray-%d" % rank,),
            rank=over.pop("hello_rank", rank),
            world_size=self.config.world_size,
            model_sig=MODEL_SIG,
            dataset_len=self.total,
            host=f"host{rank % 2}",
            pid=1000 + rank,
            incarnation=r.incarnation if r else 0,
        )
        kw.update(over)
        return self.feed(RankHello(**kw))

    def join_all(self) -> None:
        for r in range(self.config.world_size):
            self.hello(r)

    # -- the machine's commands ---------------------------------------------------------

    def _seen(self, r: RankShell, hello_ack: bool = False, incarnation: Optional[int] = None) -> bool:
        inc = self.coordinator_incarnation if incarnation is None else incarnation
        cmds = r.m.handle(IncarnationSeen(incarnation=inc, hello_ack=hello_ack))
        self._do(r, cmds)
        return not any(isinstance(c, Drop) for c in cmds)

    def hear_incarnation(self, rank: int) -> None:
        """The rank hears the coordinator's current incarnation (a beacon, say)."""
        r = self.ranks[rank]
        if r.active:
            self._seen(r)

    def _do(self, r: RankShell, cmds: list) -> None:
        for c in cmds:
            t = type(c)
            if t is SendTiming:
                r.said_step = max(r.said_step, _said_step(c.kind, c.body))
                ev = timing_event(self.now, pb.Timing(rank=r.rank, **{c.kind: c.body}))
                if isinstance(ev, CheckpointDone) and not self.answer_checkpoints:
                    r.saves_due.append(ev)
                else:
                    self.feed(ev)
            elif t is SendMetrics:
                r.said_step = max([r.said_step] + [b.step_count for b in c.metrics.batches])
                for name, value in self.scalars.items():  # what a metrics recorder would add
                    acc = c.metrics.scalars[name]
                    acc.sum, acc.count = value * c.metrics.batches_processed, c.metrics.batches_processed
                r.chunk_due, r.metrics_due = c.metrics.epoch, c.metrics
                if not self.defer_chunks:
                    self.send_chunk(r.rank)
            elif t is TakeSnapshot:
                # The rank says every step before its round frame: the reducer weighs the
                # snapshot by the steps the coordinator heard (its weight's ceiling).
                if c.step_count > r.said_step:
                    raise AssertionError(
                        f"rank {r.rank} snapshots step {c.step_count} for cycle {c.cycle} having reported only "
                        f"{r.said_step}: its round frame would outrun its batches"
                    )
                r.ack_due = (c.cycle, c.step_count)
                self.round_weights.setdefault(c.cycle, {})[r.rank] = c.weight
            elif t is ApplyConsensus:
                self.feed(SyncAcked(now=self.now, rank=r.rank, cycle=c.cycle, step_count=c.ack_step, divergence=0.01))
            elif t is AbandonRounds:
                if r.ack_due is not None and r.ack_due[0] in c.cycles:
                    r.ack_due = None
            elif t is SaveCheckpoint:
                r.saved.append((c.command.version, c.command.cycle, c.params))
                ev = CheckpointDone(now=self.now, rank=r.rank, version=c.command.version, elapsed_ms=1.0)
                if self.answer_checkpoints:
                    self.feed(ev)
                else:
                    r.saves_due.append(ev)
            elif t is RunEval:
                x = c.command
                self.feed(EvalDone(now=self.now, rank=r.rank, schedule_id=x.schedule_id, epoch=x.epoch,
                                   metric=self.eval_metric, error=self.eval_error, final=x.final))  # fmt: skip
            elif t is Exit:
                self.feed(RankExiting(now=self.now, rank=r.rank, param_digest=f"digest-{r.rank}", steps=c.steps))
                r.exited = True
                if self.agent_reports_exit:
                    self.feed(RankExitReported(now=self.now, rank=r.rank, code=0))
            elif t is Drop:
                r.drops[c.reason] = r.drops.get(c.reason, 0) + 1
            elif t is Warn:
                r.warnings.append(c.text)
            elif t in (RunEpochFn, FormGroup):
                pass  # no epoch_fn (the real shell sends nothing then); no process group here
            else:
                raise TypeError(f"the cluster has no shell for {t.__name__}")

    # -- rank behaviour ---------------------------------------------------------------------

    def deliver_one(self, rank: int) -> bool:
        r = self.ranks[rank]
        if not r.active or not r.inbox:
            return False
        ctl = r.inbox.popleft()
        kind = ctl.WhichOneof("cmd")
        if kind in r.deaf or not self._seen(r, incarnation=self.sent_by.get(ctl.command_id)) or not r.m.admitted:
            return True
        before = r.ack_due
        self._do(r, r.m.handle(ControlReceived(control=ctl)))
        if kind == "request_params" and r.ack_due is not before and r.active:
            if self.race_throttle:
                self.train_one(rank)  # a batch lands after the snapshot, before Throttle is read
            if not self.defer_acks:
                self.send_ack(rank)
        return True

    def send_ack(self, rank: int) -> bool:
        """The consensus of the snapshot came back: the machine applies it and acks."""
        r = self.ranks[rank]
        if r.ack_due is None or not r.active:
            return False
        (cycle, _step), r.ack_due = r.ack_due, None
        if not r.m.has_snapshot(cycle):
            return False
        # As the reducer answers: the consensus goes to every contributor, weight-0 ones
        # included, unless the round's whole mass is 0 (then everyone keeps local).
        # Its "arrays" name the cycle, so a save shows which consensus it holds.
        weights = self.round_weights.setdefault(cycle, {})
        empty = set(weights) >= self.round_ranks.get(cycle, set()) and not any(weights.values())
        self._do(r, r.m.handle(ConsensusReady(cycle=cycle, arrays=None if empty else (cycle,))))
        return True

    def send_seed(self, rank: int) -> bool:
        """The seed consensus (the reducer's latest) reaches a joiner, which loads it."""
        r = self.ranks[rank]
        if not r.seed_due or not r.active:
            return False
        r.seed_due, r.seeded = False, True
        self._do(r, r.m.handle(SeedApplied(cycle=self.state.rounds.cycle)))
        return True

    def respawn(self, rank: int, unpinned: bool = False, **over: Any) -> list:
        """The agent starts rank ``rank``'s process again: a new machine, route and
        incarnation (the old shell is kept in ``retired``); it says hello (``unpinned``:
        naming no rank -- the core should give it slot ``rank``)."""
        old = self.ranks[rank]
        n = sum(1 for r in self.retired if r.rank == rank) + 1
        self.retired.append(old)
        self.ranks[rank] = RankShell(rank, (b"relay", b"rank-%d-%d" % (rank, n)), incarnation=1000 * n + rank,
                                     speed_ms=old.speed_ms)  # fmt: skip
        return self.hello(rank, **({"hello_rank": UNPINNED} if unpinned else {}), **over)

    def can_train(self, rank: int) -> bool:
        r = self.ranks[rank]
        return r.active and r.m.admitted and not r.m.throttled and r.m.has_plan() and r.chunk_due is None

    def train_one(self, rank: int, drain: bool = False) -> bool:
        """Train the machine's next batch (and send the chunk's metrics when it runs out).

        ``drain``: the rank reads its inbox between a chunk's last batch and the chunk's
        Metrics, as the worker drains control between a batch and its next action (an
        extension read there revives the chunk: no Metrics then)."""
        if not self.can_train(rank):
            return False
        r = self.ranks[rank]
        act = r.m.next_action(r.clock_ms / 1e3)
        if isinstance(act, TrainBatch) and r.m.spec.join_running and not r.seeded:
            raise AssertionError(f"rank {rank} trains before it holds the seed consensus")
        if isinstance(act, TrainBatch):
            r.clock_ms += r.speed_ms
            step = r.step + 1
            r.trained.append((act.epoch, act.offset, act.count, step))
            loss = 2.0 / (1.0 + 0.05 * step)
            self._do(r, r.m.handle(BatchTrained(epoch=act.epoch, offset=act.offset, samples=act.count,
                                                batch_ms=r.speed_ms, data_ms=1.0, loss=loss)))  # fmt: skip
            if r.m.current is None or not r.m.current.exhausted():
                return True
            while drain and self.deliver_one(rank):
                pass
            if r.m.current is None or not r.m.current.exhausted():
                return True  # revived: its next batch is the next train_one's (next_action takes it)
            act = r.m.next_action(r.clock_ms / 1e3)
        if isinstance(act, SendMetrics):
            self._do(r, [act])
        return True

    def send_chunk(self, rank: int) -> bool:
        r = self.ranks[rank]
        if r.chunk_due is None or not r.active:
            return False
        m, r.chunk_due, r.metrics_due = r.metrics_due, None, None
        for ev in chunk_events(self.now, m):  # (the batches it carries first: protocol 1.3)
            self.feed(ev)
        return True

    def send_saves(self, rank: int) -> bool:
        """The held checkpoint answers of ``rank`` (saved, or refused by the machine) arrive."""
        r = self.ranks[rank]
        if not r.saves_due or not r.active:
            return False
        due, r.saves_due = r.saves_due, []
        for ev in due:
            self.feed(ev)
        return True


    # -- faults and time ----------------------------------------------------------------------

    def kill(self, rank: int, code: int = -9, report: bool = True) -> list:
        r = self.ranks[rank]
        r.alive = False
        r.inbox.clear()
        return self.feed(RankExitReported(now=self.now, rank=rank, code=code)) if report else []

    def silence(self, rank: int) -> None:
        self.ranks[rank].silent = True

    def advance(self, dt: float) -> list:
        self.now += dt
        for r in self.ranks:
            if r.active and r.admitted and self.now - r.last_hb >= 1.0:
                r.last_hb = self.now
                self.feed(HeartbeatSeen(now=self.now, rank=r.rank, step_count=r.step))
        return self.feed(Tick(now=self.now))

    # -- driving ------------------------------------------------------------------------------

    def pump_once(self) -> bool:
        """Every rank drains its inbox, acks, reports, trains a batch; then time moves.

        True if anything but liveness traffic reached the core, or a rank trained (its
        report may wait, coalesced: ``batch_report_ms``). A hang makes no progress, even
        though beacons and heartbeats keep flowing.
        """
        before = self.work_events
        trained = False
        for r in range(len(self.ranks)):
            while self.deliver_one(r):
                pass
            self.send_ack(r)
            self.send_seed(r)
            if not self.hold_chunks:
                self.send_chunk(r)
            trained = self.train_one(r) or trained
        self.advance(self.dt)
        return self.work_events > before or trained

    def run(self, max_iters: int = 20000) -> Optional[RunFinished]:
        """Pump until the run finishes; when stuck, let time pass (silent ranks die).

        Three liveness timeouts without any rank doing anything is a hang: fail fast.
        """
        stuck = 0
        for _ in range(max_iters):
            if self.finished is not None:
                return self.finished
            if self.pump_once():
                stuck = 0
                continue
            stuck += 1
            if stuck > 6:
                break
            self.advance(self.config.liveness_timeout_s / 2)
        raise AssertionError(f"cluster did not finish: gate says {self.state.rounds.gate_reason!r}")

    def run_until(self, predicate, max_iters: int = 20000) -> None:
        for _ in range(max_iters):
            if predicate() or self.finished is not None:
                return
            self.pump_once()
        raise AssertionError("condition never met")

    # -- observing ------------------------------------------------------------------------------

    def out(self, rank: int) -> list[str]:
        """The ordered kinds of control the rank received (heartbeats excluded)."""
        return [c.WhichOneof("cmd") for c in self.ranks[rank].received if c.WhichOneof("cmd") != "coord_heartbeat"]

    def roles_told(self, rank: int) -> list[int]:
        """The epoch roles the rank was told, in order (``role_told``)."""
        return [role for role in map(role_told, self.ranks[rank].received) if role is not None]

    def sends(self, kind: Optional[str] = None) -> list[Send]:
        return [c for c in self.commands if isinstance(c, Send) and (kind is None or c.kind == kind)]

    def of_type(self, cls: type) -> list:
        return [c for c in self.commands if isinstance(c, cls)]


def role_told(ctl: pb.Control) -> Optional[int]:
    """The epoch-callback role a control tells: ``SetEpochCallbackRole``, or a
    ``StartEpoch`` that carries it (a dispatch); None if it tells none."""
    kind = ctl.WhichOneof("cmd")
    if kind == "set_epoch_callback_role":
        return ctl.set_epoch_callback_role.rank
    if kind == "start_epoch" and ctl.start_epoch.HasField("epoch_callback_role"):
        return ctl.start_epoch.epoch_callback_role
    return None


def window_plan(ctl: pb.Control) -> Optional[tuple[str, tuple[int, int, int]]]:
    """The plan a control hands its rank, as ``(how, (epoch, offset, size))``: a
    ``start_epoch`` / ``extend_partition`` frame, or one riding in a round's trigger
    (``request_params.next_plan`` / ``.extend``, protocol 1.2); None if it hands none."""
    kind = ctl.WhichOneof("cmd")
    if kind == "start_epoch":
        p = ctl.start_epoch.plan
    elif kind == "extend_partition":
        p = ctl.extend_partition
    elif kind == "request_params" and ctl.request_params.HasField("next_plan"):
        kind, p = "next_plan", ctl.request_params.next_plan
    elif kind == "request_params" and ctl.request_params.HasField("extend"):
        kind, p = "extend", ctl.request_params.extend
    else:
        return None
    return kind, (p.epoch, p.partition_offset, p.partition_size)


def controls(cmds: list, kind: Optional[str] = None) -> list[tuple[int, pb.Control]]:
    """``(rank, control)`` of the ``Send``s in ``cmds`` (of one kind, if given)."""
    return [(c.rank, c.control) for c in cmds if isinstance(c, Send) and (kind is None or c.kind == kind)]
