"""A simulated rank: the real rank machine (``flodl.rank``) in virtual time.

``SimRank`` is the shell the simulator gives each ``RankMachine``, as
``flodl_worker.rank`` is the torch one: it delivers the coordinator's frames as
machine events and carries out the machine's commands -- a ``TrainBatch`` takes
``ms_per_batch * (1 ± jitter)`` of virtual time, a ``TakeSnapshot`` contributes to the
world's simulated reducer, an ``ApplyConsensus`` acks, every ``SendTiming`` /
``SendMetrics`` becomes the core event the coordinator's shell would decode from it
(``to_event``: the coordinator's own translation, ``flodl.core.timing_event``). There are no
tensors: a consensus is the marker ``INCLUDED`` (or None: keep local).

Faults are wrappers around the machine, not part of it: ``fail_at`` kills the process
(the agent reports the exit), ``hang_at`` silences it.
"""

from __future__ import annotations

from dataclasses import fields
from typing import TYPE_CHECKING, Any

from flodl.core import (
    BatchDone,
    BatchesDone,
    CheckpointDone,
    EvalDone,
    RankExiting,
    RankExitReported,
    RankHello,
    RankResynced,
    SyncAcked,
    timing_event,
)
from flodl.core import chunk_events
from flodl.rank import (
    WAIT_PLAN,
    WAIT_THROTTLE,
    AbandonRounds,
    Admitted,
    ApplyConsensus,
    BatchTrained,
    ConsensusReady,
    ControlReceived,
    Drop,
    Exit,
    FormGroup,
    HeartbeatDue,
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

if TYPE_CHECKING:  # pragma: no cover
    from ._world import _World

__all__ = ["SimRank", "INCLUDED", "to_event"]

INCLUDED: tuple = ()  # the consensus "arrays" of a simulated round: this rank's work is in it
HELLO_RESEND_S = 5.0  # flodl_worker.rank's


def _fields(ev) -> tuple[type, dict]:
    """(class, fields but ``now``) of a core event: the world stamps ``now`` on arrival."""
    return type(ev), {f.name: getattr(ev, f.name) for f in fields(ev) if f.name != "now"}


def to_event(rank: int, kind: str, body: Any) -> tuple[type, dict]:
    """The core event for ``timing.<kind> = body`` from ``rank``: the coordinator's own
    translation (``flodl.core.timing_event``) of the frame the real rank would send."""
    return _fields(timing_event(0.0, pb.Timing(rank=rank, **{kind: body})))


def metrics_events(m: pb.Metrics) -> list[tuple[type, dict]]:
    """The core events of a chunk's Metrics frame: the batches it carries, then its
    ``ChunkDone`` (the coordinator's own translation, ``flodl.core.chunk_events``)."""
    return [_fields(ev) for ev in chunk_events(0.0, m)]


class SimRank:
    def __init__(self, world: "_World", rank: int, ms: float, generation: int = 0):
        self.w, self.rank, self.ms = world, rank, ms
        self.generation = generation  # 0: the first process; n: its n-th restart
        self.route = (b"sim%d" % rank,) if generation == 0 else (b"sim%d-%d" % (rank, generation),)
        self.seed_held = False  # a joiner's seed consensus arrived
        self.hellos = 0  # hellos sent
        self.m = RankMachine(rank)
        self.training = False  # a batch is on the (virtual) device
        self.busy_until = 0.0  # when the batch on the device ends
        self.alive = True
        self.silent = False
        self.drops: dict[str, int] = {}
        # When a heartbeat is due: a timing frame sent by then is it (as flodl_worker.rank).
        self.next_beat = world.now + world.cfg.heartbeat_s
        self.said_step = 0  # the last step this process reported (its round frames may not outrun it)

    # -- inbound (frames of the coordinator, in link order) -----------------------------

    def _seen(self, incarnation: int, hello_ack: bool = False) -> bool:
        cmds = self.m.handle(IncarnationSeen(incarnation=incarnation, hello_ack=hello_ack))
        self._do(cmds)
        return not any(type(c) is Drop for c in cmds)

    def on_hello_ack(self, ack: pb.HelloAck, incarnation: int) -> None:
        if not self.alive or not self._seen(incarnation, hello_ack=True):
            return
        if ack.accepted and not self.m.admitted:
            self._do(self.m.handle(Admitted(spec=ack.run, hello_resent=self.hellos > 1)))

    def on_seed(self, cycle: int, incarnation: int) -> None:
        """The seed consensus (``RoundHeader.seed``) reached this joiner."""
        if not self.alive or not self._seen(incarnation) or not self.m.admitted:
            return
        self.seed_held = True
        self._do(self.m.handle(SeedApplied(cycle=cycle)))
        self._maybe_train()

    def on_control(self, ctl: pb.Control, incarnation: int) -> None:
        if not self.alive or not self._seen(incarnation) or not self.m.admitted:
            return
        self._do(self.m.handle(ControlReceived(control=ctl)))
        self._maybe_train()

    def on_consensus(self, cycle: int, arrays: Any, incarnation: int) -> None:
        if not self.alive or not self._seen(incarnation):
            return
        self._do(self.m.handle(ConsensusReady(cycle=cycle, arrays=arrays)))
        self._maybe_train()

    # -- the machine's commands ---------------------------------------------------------

    def _timing(self, cls, kw: dict) -> None:
        """A timing frame; once a heartbeat is due, this one is it (``heartbeat``)."""
        w = self.w
        if cls is BatchDone:
            self.said_step = max(self.said_step, kw["step_count"])
        elif cls is BatchesDone and kw["batches"]:
            self.said_step = max(self.said_step, kw["batches"][-1].step_count)
        elif cls is RankResynced:
            self.said_step = max(self.said_step, kw["local_step"])
        w.to_core(cls, kw)
        if self.m.admitted and w.now >= self.next_beat:
            self.next_beat = w.now + w.cfg.heartbeat_s

    def _do(self, cmds: list) -> None:
        w = self.w
        for c in cmds:
            t = type(c)
            if t is SendTiming:
                cls, kw = to_event(self.rank, c.kind, c.body)
                self._timing(cls, kw)
            elif t is SendMetrics:
                *batches, (cls, kw) = metrics_events(c.metrics)
                for b_cls, b_kw in batches:  # (its chunk's last batches: a timing frame's part)
                    self._timing(b_cls, b_kw)
                w.to_core(cls, kw)
            elif t is TakeSnapshot:
                if c.step_count > self.said_step:  # the reducer bounds its weight by the steps heard
                    w.violations.append(f"rank {self.rank} (process {self.generation}) snapshots step {c.step_count} "
                                        f"for cycle {c.cycle} having reported {self.said_step}")  # fmt: skip
                w.reducer_contribute(self.rank, c.cycle, c.weight)
            elif t is ApplyConsensus:
                self._timing(SyncAcked, dict(rank=self.rank, cycle=c.cycle, step_count=c.ack_step, divergence=0.0))
            elif t is RunEval:
                ev = c.command
                self._timing(EvalDone, dict(rank=self.rank, schedule_id=ev.schedule_id, epoch=ev.epoch, metric=0.5,
                                            final=ev.final))  # fmt: skip
            elif t is SaveCheckpoint:
                self._timing(CheckpointDone, dict(rank=self.rank, version=c.command.version))
            elif t is Exit:
                w.to_core(RankExiting, dict(rank=self.rank, param_digest="sim", steps=c.steps))
                self.alive = False
            elif t is Drop:
                self.drops[c.reason] = self.drops.get(c.reason, 0) + 1
            elif t in (AbandonRounds, Warn, RunEpochFn, FormGroup):
                pass  # no tensors to drop, no log, no epoch_fn, bus plane only
            else:
                raise TypeError(f"the simulator has no shell for {t.__name__}")

    # -- training ---------------------------------------------------------------------

    def _maybe_train(self) -> None:
        if self.training or not self.alive:
            return
        while True:
            act = self.m.next_action(self.w.now)
            if act is WAIT_PLAN or act is WAIT_THROTTLE:
                return
            if type(act) is SendMetrics:
                self._do([act])
                continue
            break
        if self.m.spec is not None and self.m.spec.join_running and not self.seed_held:
            self.w.violations.append(f"rank {self.rank} (process {self.generation}) trained before its seed arrived")
        self.training = True
        j = self.w.cfg.jitter
        dt = self.ms / 1000.0 * self.w.rng.uniform(1 - j, 1 + j)
        self.busy_until = self.w.now + dt
        self.w.at(self.busy_until, self._batch_done, act, dt)

    def _batch_done(self, act: TrainBatch, dt: float) -> None:
        self.training = False
        if not self.alive:
            return
        ev = BatchTrained(epoch=act.epoch, offset=act.offset, samples=act.count, batch_ms=dt * 1000, loss=1.0)
        self._do(self.m.handle(ev))
        if self._fault():
            return
        self._beat_if_due()  # (the real rank looks between steps: after its report, which may have been it)
        self._maybe_train()

    def _fault(self) -> bool:
        cfg, step = self.w.cfg, self.m.local_step
        if self.generation == 0 and cfg.fail_at.get(self.rank) == step:
            self.alive = False
            self.w.agent_report(RankExitReported, dict(rank=self.rank, code=-9))
            self.w.reducer_drop(self.rank)
            if cfg.respawn_after_s is not None:
                self.w.at(self.w.now + cfg.respawn_after_s, self.w.respawn, self.rank)
            return True
        if cfg.hang_at.get(self.rank) == step:
            self.alive = False
            self.silent = True
            self.w.reducer_drop(self.rank)
            return True
        return False

    def hello(self) -> None:
        """Send the hello, again every ``HELLO_RESEND_S`` until admitted (a coordinator
        that restarted may have lost it; the core answers a repeat idempotently)."""
        if self.alive and not self.m.admitted:
            self.hellos += 1
            self.w.to_core(RankHello, dict(route=self.route, rank=self.rank, world_size=len(self.w.ranks),
                                           model_sig=b"\x01" * 32, dataset_len=self.w.cfg.total_samples,
                                           incarnation=self.rank + 1 + 1000 * self.generation))  # fmt: skip
            self.w.at(self.w.now + HELLO_RESEND_S, self.hello)

    def heartbeat(self) -> None:
        """Once admitted and due, as ``flodl_worker.rank`` does (a rank that reports its
        batches sends none of its own: its reports are its liveness): a process not admitted yet (a
        restart whose hello waits while its dead predecessor still holds the slot) must not
        keep that predecessor alive -- the coordinator's shell would drop its frame (its
        route does not own the rank), the simulated core would credit it to the rank."""
        if self.alive:
            w = self.w
            if not self.m.admitted:
                w.at(w.now + w.cfg.heartbeat_s, self.heartbeat)
                return
            if self.training:  # mid-batch: looked at once the batch is done (``_batch_done``)
                w.at(self.busy_until, self.heartbeat)  # (after the batch's end: it was queued first)
                return
            self._beat_if_due()
            w.at(self.next_beat, self.heartbeat)

    def _beat_if_due(self) -> None:
        w = self.w
        if self.m.admitted and w.now >= self.next_beat:  # no timing frame went out since one was due
            self._do(self.m.handle(HeartbeatDue()))  # its unreported batches, or a heartbeat (``_timing``)
