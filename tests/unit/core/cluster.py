"""Cluster: the real core against N scripted in-memory ranks (h11's ConnectionPair).

Each ``ScriptedRank`` behaves like the rank runtime of docs/protocol.md, minus torch:

* ``StartEpoch`` / ``ExtendPartition`` queue position ranges; ``train_one`` trains one
  batch (``batch_size`` positions, or what is left of the current range) and reports
  ``BatchDone``; when the queue runs dry it reports ``ChunkDone`` (or leaves it due,
  with ``defer_chunks``, for a test to send with ``send_chunk``).
* ``RequestParams{cycle}``: the rank snapshots its step count; the reducer is simulated
  -- the consensus comes straight back, so the rank answers ``SyncAcked{cycle,
  step_count = the snapshot's}`` (or leaves it due, with ``defer_acks``, for a test to
  send with ``send_ack``). With ``race_throttle`` the rank trains one more batch between
  the snapshot and reading ``Throttle``: that batch is folded only by the next round.
* ``Throttle`` stops training until ``Update``; an ``Update`` carrying ``next_plan``
  (Cadence's atomic dispatch) queues that range like a ``StartEpoch``; ``ExecuteEval``
  for this rank answers ``EvalDone``; ``Shutdown``/``ShutdownWithSave`` answers
  ``RankExiting``.

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
    BatchDone,
    ChunkDone,
    CoreConfig,
    EvalDone,
    Event,
    ForgetRank,
    HeartbeatSeen,
    RankExiting,
    RankExitReported,
    RankHello,
    Reply,
    RunFinished,
    Send,
    SyncAcked,
    Tick,
    initial_state,
    step,
)
from flodl.wire import pb

MODEL_SIG = b"\x5a" * 8


@dataclass
class ScriptedRank:
    rank: int
    route: tuple[bytes, ...]
    incarnation: int = 0
    speed_ms: float = 10.0
    inbox: deque = field(default_factory=deque)
    received: list = field(default_factory=list)
    work: deque = field(default_factory=deque)  # [epoch, offset, size] still to train
    step: int = 0
    throttled: bool = False
    alive: bool = True  # the process runs
    silent: bool = False  # sends nothing, processes nothing (hung)
    admitted: bool = False
    refused: Optional[str] = None
    forgotten: bool = False
    exited: bool = False
    chunk_seq: dict = field(default_factory=dict)  # epoch -> ChunkDones sent
    window: dict = field(default_factory=dict)  # epoch -> [batches, samples, loss_sum]
    chunk_due: Optional[int] = None  # epoch whose ChunkDone is due
    ack_due: Optional[tuple] = None  # (cycle, step at the snapshot) whose SyncAcked is due
    last_hb: float = 0.0
    trained: list = field(default_factory=list)  # (epoch, offset, samples, step)
    deaf: set = field(default_factory=set)  # control kinds this rank ignores (fault injection)

    @property
    def active(self) -> bool:
        return self.alive and not self.silent and not self.exited and not self.forgotten


class Cluster:
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
        defer_acks: bool = False,
        race_throttle: bool = False,
        agent_reports_exit: bool = False,
        dt: float = 0.01,
        **cfg: Any,
    ) -> None:
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
        self.defer_acks = defer_acks
        self.race_throttle = race_throttle
        self.hold_chunks = False  # pump_once leaves due ChunkDones unsent while True
        self.agent_reports_exit = agent_reports_exit
        speeds = speeds or [10.0 * (1 + r) for r in range(self.config.world_size)]
        self.ranks = [
            ScriptedRank(r, (b"relay", b"rank-%d" % r), speed_ms=speeds[r]) for r in range(self.config.world_size)
        ]
        self.journal: list[Event] = []  # every event fed, refused ones included
        self.trace: list[tuple[Event, list]] = []  # (event, its commands) for accepted events
        self.work_events = 0  # accepted events other than liveness traffic
        self.commands: list = []
        self.finished: Optional[RunFinished] = None
        self._last_command_id = 0

    # -- feeding the core ---------------------------------------------------------------

    def feed(self, ev: Event) -> list:
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
            r.received.append(c.control)
            if r.alive and not r.exited:
                r.inbox.append(c.control)
        elif isinstance(c, Reply):
            for r in self.ranks:
                if r.route == c.route:
                    if c.ack.accepted:
                        r.admitted = True
                    else:
                        r.refused = c.ack.reason
        elif isinstance(c, ForgetRank):
            self.ranks[c.rank].forgotten = True
        elif isinstance(c, RunFinished):
            self.finished = c

    def hello(self, rank: int, **over: Any) -> list:
        r = self.ranks[rank] if 0 <= rank < len(self.ranks) else None
        kw = dict(
            now=self.now,
            route=r.route if r else (b"stray-%d" % rank,),
            rank=rank,
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

    # -- rank behaviour ---------------------------------------------------------------------

    def deliver_one(self, rank: int) -> bool:
        """The rank handles the next control in its inbox; False if nothing to do."""
        r = self.ranks[rank]
        if not r.active or not r.inbox:
            return False
        ctl = r.inbox.popleft()
        kind = ctl.WhichOneof("cmd")
        if kind in r.deaf:
            pass
        elif kind == "start_epoch":
            p = ctl.start_epoch.plan
            r.work.append([p.epoch, p.partition_offset, p.partition_size])
        elif kind == "extend_partition":
            e = ctl.extend_partition
            r.work.append([e.epoch, e.partition_offset, e.partition_size])
        elif kind == "request_params":
            r.ack_due = (ctl.request_params.cycle, r.step)  # the snapshot
            if self.race_throttle:
                self.train_one(rank)  # a batch lands after the snapshot, before Throttle is read
            if not self.defer_acks:
                self.send_ack(rank)
        elif kind == "throttle":
            r.throttled = True
        elif kind == "update":
            r.throttled = False
            if ctl.update.HasField("next_plan"):  # Cadence: the next window, atomically
                p = ctl.update.next_plan
                r.work.append([p.epoch, p.partition_offset, p.partition_size])
        elif kind == "execute_eval" and ctl.execute_eval.target_rank == rank:
            x = ctl.execute_eval
            self.feed(
                EvalDone(now=self.now, rank=rank, schedule_id=x.schedule_id, epoch=x.epoch,
                         metric=self.eval_metric, error=self.eval_error, final=x.final)
            )
        elif kind in ("shutdown", "shutdown_with_save"):
            self._exit(rank)
        return True

    def _exit(self, rank: int) -> None:
        r = self.ranks[rank]
        self.feed(RankExiting(now=self.now, rank=rank, param_digest=f"digest-{rank}", steps=r.step))
        r.exited = True
        if self.agent_reports_exit:
            self.feed(RankExitReported(now=self.now, rank=rank, code=0))

    def send_ack(self, rank: int) -> bool:
        """The consensus came back: apply it and ack the snapshot's step count."""
        r = self.ranks[rank]
        if r.ack_due is None or not r.active:
            return False
        (cycle, step), r.ack_due = r.ack_due, None
        self.feed(SyncAcked(now=self.now, rank=rank, cycle=cycle, step_count=step, divergence=0.01))
        return True

    def can_train(self, rank: int) -> bool:
        r = self.ranks[rank]
        return r.active and not r.throttled and bool(r.work) and r.chunk_due is None

    def train_one(self, rank: int) -> bool:
        """Train one batch; report it (and the ChunkDone when the work runs out)."""
        if not self.can_train(rank):
            return False
        r = self.ranks[rank]
        epoch, offset, size = r.work[0]
        n = min(self.config.batch_size, size)
        if size - n == 0:
            r.work.popleft()
        else:
            r.work[0] = [epoch, offset + n, size - n]
        if n > 0:
            r.step += 1
            loss = 2.0 / (1.0 + 0.05 * r.step)
            r.trained.append((epoch, offset, n, r.step))
            w = r.window.setdefault(epoch, [0, 0, 0.0])
            w[0], w[1], w[2] = w[0] + 1, w[1] + n, w[2] + loss
            self.feed(
                BatchDone(now=self.now, rank=rank, batch_ms=r.speed_ms, data_ms=1.0, step_count=r.step,
                          loss=loss, samples=n, epoch=epoch, offset=offset)
            )
        if not r.work or r.work[0][0] != epoch:
            r.chunk_due = epoch
            if not self.defer_chunks:
                self.send_chunk(rank)
        return True

    def send_chunk(self, rank: int) -> bool:
        r = self.ranks[rank]
        if r.chunk_due is None or not r.active:
            return False
        epoch, r.chunk_due = r.chunk_due, None
        batches, samples, loss_sum = r.window.pop(epoch, [0, 0, 0.0])
        seq = r.chunk_seq.get(epoch, 0)
        r.chunk_seq[epoch] = seq + 1
        self.feed(
            ChunkDone(now=self.now, rank=rank, epoch=epoch, chunk_seq=seq, batches=batches, samples=samples,
                      avg_loss=loss_sum / batches if batches else 0.0, epoch_ms=batches * r.speed_ms,
                      scalars=(("acc", 0.5 * batches, batches),))
        )
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

        True if anything but liveness traffic reached the core (a hang makes no progress,
        even though beacons and heartbeats keep flowing).
        """
        before = self.work_events
        for r in range(len(self.ranks)):
            while self.deliver_one(r):
                pass
            self.send_ack(r)
            if not self.hold_chunks:
                self.send_chunk(r)
            self.train_one(r)
        self.advance(self.dt)
        return self.work_events > before

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

    def sends(self, kind: Optional[str] = None) -> list[Send]:
        return [c for c in self.commands if isinstance(c, Send) and (kind is None or c.kind == kind)]

    def of_type(self, cls: type) -> list:
        return [c for c in self.commands if isinstance(c, cls)]


def controls(cmds: list, kind: Optional[str] = None) -> list[tuple[int, pb.Control]]:
    """``(rank, control)`` of the ``Send``s in ``cmds`` (of one kind, if given)."""
    return [(c.rank, c.control) for c in cmds if isinstance(c, Send) and (kind is None or c.kind == kind)]
