"""The rank's half of the protocol as a machine: events in, commands out, no I/O.

Theory of operation
-------------------
``RankMachine`` holds everything a rank *decides* (docs/protocol.md, "Rank life
cycle"); the shell (``flodl_worker.rank`` with torch and a socket, ``flodl.sim`` in
virtual time, the core tests' scripted cluster) owns the model, the clock and the
transport. The shell feeds events (``handle``) and executes the commands returned, in
order; between steps it asks ``next_action(now)`` what to do next. Nothing here reads a
clock: the only time is the ``now`` the shell passes to ``next_action`` (a chunk's
``epoch_ms``), in whatever unit-of-seconds clock the shell keeps.

1. Plans. ``StartEpoch``/``Update.next_plan`` queue a ``Chunk`` (FIFO; two outstanding
   plans are kept, with a warning: reference hazard 11); ``ExtendPartition`` appends a
   segment to the last plan queued of its epoch (the rest of a window, sent right behind
   its plan), else to the chunk in training of its epoch, else is a chunk of its own. A plan
   beyond the epoch is dropped (``bad_plan``). ``next_action`` pops the next chunk,
   hands out batches (``TrainBatch``) that never straddle a segment, and answers
   ``SendMetrics`` when a chunk runs out -- even while throttled: reporting is not
   training. A batch handed out and not yet trained is *in hand*: still held, so a
   resync report sent meanwhile (a shell that handles frames while its device works,
   like the simulator) neither loses nor doubles it. ``WAIT_PLAN`` / ``WAIT_THROTTLE`` tell the shell to block (servicing
   frames, heartbeating) until ``has_plan`` / ``not throttled``.
   From the first ``WAIT_PLAN`` of a rank that has trained until it pops its next chunk
   it is *waiting for a plan*; that time (by the ``now`` the shell passes) goes out as
   the next batch's ``wait_ms``: the coordinator's window growth amortises it, and the
   summary shows it. A throttle's wait is not a plan wait (the policy holds the rank).
   ``TrimPartition{epoch, keep}`` (Sync, a rank joined mid-epoch): of the positions of
   ``epoch`` still held, in training order (the batch in hand first: it cannot be given
   back), the first ``keep`` stay and the rest leave the plans; the answer
   ``timing.partition_trimmed`` names exactly what left and what stayed, so the
   coordinator hands the joiner only positions this rank will never train.
2. Throttle. ``Throttle`` stops training until ``Update`` (or Shutdown).
3. Credit. Every ``BatchTrained`` adds one local step and one step of credit
   (``steps_since_avg``). ``RequestParams{cycle}`` snapshots n = the credit and the
   step count, weight = n**gamma (0 when n <= 0: the idle guard): ``TakeSnapshot``.
   ``ConsensusReady(cycle, arrays)``: with arrays, the snapshot's n is taken off the
   credit (steps trained during the round keep theirs, reference hazard 13) and its
   step count becomes the *folded step*, which the ack names (it commits the rank's
   batches up to it); without (its work is not in a consensus), credit and folded
   step stay and the ack names the last folded step. Either way: ``ApplyConsensus``.
4. Checkpoints (``Checkpoint{version, path, cycle}`` for this rank). ``cycle`` 0:
   save what the rank holds now. c > 0: the consensus of cycle c -- saved right after
   it is applied (*armed* when the command comes first), or at once if c is the last
   applied cycle: the machine *holds* that consensus (the opaque arrays of the last
   ``ConsensusReady`` with this rank's work in it) until the next one lands, so it can
   be saved even after steps since. Older cycles are refused by name; an armed cycle
   that a newer consensus skipped is refused as "never reached this rank".
5. Resync (``flodl_worker.resync`` has the story). The coordinator's incarnation comes
   from the ``hello_ack``; a frame of another one means it restarted: *before* that
   frame is handled, ``AbandonRounds`` (the pending snapshots' rounds died with it; the
   credit stays) and one ``timing.resync`` with the batches reported since the last
   folded step, the positions held untrained, the metrics of epochs not seen
   aggregated, ``last_command_id``, steps, ``throttled``, ``idle``. A frame of an
   incarnation already left behind: ``Drop("stale_incarnation")``. A rank admitted by an
   answer to a *repeated* hello reports too: its first ``hello_ack`` (and its first
   plan) may have died with a coordinator that restarted, whose successor acks it as a
   member awaiting resync; found by the simulator's restart campaign (seed 20, sync).
6. ``ExecuteEval`` for this rank: ``RunEval``; ``EpochAggregated`` on the rank
   ``SetEpochCallbackRole`` (or a ``StartEpoch``'s ``epoch_callback_role``) named: ``RunEpochFn``; ``Rendezvous`` on the collective
   plane: ``FormGroup``; ``Shutdown``/``ShutdownWithSave``: ``Exit`` (the machine then
   ignores everything).

Rules that decide (what is dropped, what is armed, what the ack commits, what the
report says) live in this file; the shells only move bytes and tensors.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Union

from flodl.wire import pb

from ._events import (
    AbandonRounds,
    Admitted,
    ApplyConsensus,
    BatchTrained,
    HeartbeatDue,
    Command,
    ConsensusReady,
    ControlReceived,
    Drop,
    Event,
    Exit,
    FormGroup,
    IncarnationSeen,
    RunEpochFn,
    RunEval,
    SaveCheckpoint,
    SeedApplied,
    SendMetrics,
    SendTiming,
    Sentinel,
    TakeSnapshot,
    TrainBatch,
    WAIT_PLAN,
    WAIT_THROTTLE,
    Warn,
)
from ._plans import Chunk

__all__ = ["RankMachine", "Snapshot", "gamma_mass", "INFORMATIONAL"]

# Controls a bus-plane rank only needs to hear (hearing them already reset liveness).
INFORMATIONAL = frozenset(
    {"coord_heartbeat", "declare_dead", "eval_broadcast", "stage_advisory", "save_consensus_model",
     "arm_consensus_eval"}  # fmt: skip
)


# A frame of batch reports holds at most this many (a bound on its size, ~50 bytes each).
MAX_BATCHES_PER_REPORT = 64


def gamma_mass(n: int, gamma: float) -> float:
    """Contribution mass n**gamma with the idle guard: 0 when n <= 0 (never 0**0 = 1)."""
    if n <= 0:
        return 0.0
    return float(n) if gamma == 1.0 else float(n) ** gamma


@dataclass(frozen=True, slots=True)
class Snapshot:
    n: int  # credit (steps since the last applied average) at the snapshot
    step_count: int  # local step counter at the snapshot
    weight: float


class RankMachine:
    """One rank's protocol state. ``rank``: its global rank (targets of evals,
    checkpoints, the epoch-callback role)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.spec: pb.RunSpec | None = None
        self.exited = False
        # Plans and throttle.
        self.plans: deque[Chunk] = deque()
        self.current: Chunk | None = None
        self.in_hand: TrainBatch | None = None  # handed out by next_action, not trained yet
        self.chunk_seq = 0
        self.throttled = False
        # Steps and credit.
        self.local_step = 0
        self.steps_since_avg = 0
        self.folded_step = 0  # snapshot step of the last consensus holding this rank's work
        self.global_step = 0
        self.samples_committed = 0  # run-wide, at the last SetGlobalStep (LR schedules)
        self.snapshots: dict[int, Snapshot] = {}
        # Checkpoint duty: the last consensus applied, and the local step right after it.
        self.applied_cycle = 0
        self.applied_at_step = 0
        self.armed: dict[int, pb.Control.Checkpoint] = {}
        self.held: tuple[int, list] | None = None  # (cycle, consensus arrays) of the last applied round
        self.epoch_role: int | None = None
        # Resync.
        self.incarnation: int | None = None  # the coordinator's, from hello_ack
        self.left_behind: set[int] = set()
        self.last_command_id = 0
        self.unfolded: list[pb.Timing.Batch] = []  # reported, not yet folded (step order)
        # Batch reports not sent yet (RunSpec.batch_report_ms), and the training ms they cover.
        self.unsent: list[pb.Timing.Batch] = []
        self.unsent_ms = 0.0
        self.held_for_metrics = False  # unsent holds a chunk's last batches, for its Metrics (protocol 1.3)
        self.report_at = 0  # Update.report_at_step: the step that ends this rank's window
        # Plan wait: since when the trained rank has had nothing to train (None: it has),
        # and the wait not yet told -- the next batch's ``wait_ms``.
        self.waiting_since: float | None = None
        self.wait_ms = 0.0
        self.finished: list[pb.Metrics] = []  # chunks of epochs not seen aggregated
        self.restarts = 0
        # Elastic membership: admitted into a running world, no seed consensus loaded yet.
        self.awaiting_seed = False

    # -- queries ------------------------------------------------------------------------

    @property
    def admitted(self) -> bool:
        return self.spec is not None

    def has_plan(self) -> bool:
        return self.current is not None or bool(self.plans)

    def accepts_seed(self) -> bool:
        """Would a seed consensus be loaded now? Only by a joiner that has not trained yet
        (a repeat after a coordinator restart is confirmed again; a seed for a rank that
        trains would throw its steps away)."""
        return self.spec is not None and bool(self.spec.join_running) and self.local_step == 0

    def has_snapshot(self, cycle: int) -> bool:
        return cycle in self.snapshots

    def is_restart(self, incarnation: int) -> bool:
        """Would a frame of ``incarnation`` be a coordinator restart (``IncarnationSeen``)?"""
        return self.incarnation is not None and incarnation != self.incarnation and incarnation not in self.left_behind

    def held_positions(self) -> list[pb.EpochPlan]:
        """What this rank was handed and has not trained: the batch being trained (a shell
        that handles frames while its device works), the current chunk, then the queue."""
        b = self.in_hand
        held = [pb.EpochPlan(epoch=b.epoch, partition_offset=b.offset, partition_size=b.count)] if b else []
        chunks = ([self.current] if self.current is not None else []) + list(self.plans)
        held += [
            pb.EpochPlan(epoch=ch.epoch, partition_offset=off, partition_size=size)
            for ch in chunks
            for off, size in ch.held()
        ]
        return held

    # -- the entry points ---------------------------------------------------------------

    def handle(self, ev: Event) -> list[Command]:
        """Consume one event; return the commands for the shell, in order."""
        if self.exited:
            return []
        fn = _HANDLERS.get(type(ev))
        if fn is None:
            raise TypeError(f"RankMachine cannot handle {type(ev).__name__}")
        out: list[Command] = []
        fn(self, ev, out)
        if self.unsent:
            # Whatever this rank says next, its batches are said first: the coordinator
            # weighs a snapshot, commits an ack and reads a trim by the batches it heard.
            at = next((i for i, c in enumerate(out) if type(c) not in _SILENT), None)
            if at is None and self.held_for_metrics and self.current is not None and not self.current.exhausted():
                # An extension came before the Metrics could go and revived the chunk: its
                # Metrics is a chunk away now, the held batches go at once (the round may wait on them).
                at = len(out)
            if at is not None:
                out[at:at] = self._unsent_report()
        return out

    def next_action(self, now: float) -> Union[TrainBatch, SendMetrics, Sentinel]:
        """What to do between steps: a batch to train, a finished chunk's metrics to
        send, or ``WAIT_PLAN`` / ``WAIT_THROTTLE`` (block, servicing frames). A joiner
        trains nothing before it holds the seed consensus."""
        if self.awaiting_seed:
            return WAIT_PLAN
        if self.current is None:
            if not self.plans:
                if self.waiting_since is None and self.local_step > 0:  # not before its first plan
                    self.waiting_since = now
                return WAIT_PLAN
            self.current = self.plans.popleft()
            self.current.started = now
            if self.waiting_since is not None:
                self.wait_ms += max(0.0, now - self.waiting_since) * 1e3
                self.waiting_since = None
        cur = self.current
        if cur.exhausted():
            self.current = None
            m = self._metrics(cur, now)
            if self.unsent and self.spec is not None and self.spec.batches_in_metrics:
                # The batches not reported yet go in this frame, first (protocol 1.3): the
                # coordinator takes them as the report that used to come just before it.
                sent = pb.Metrics()
                sent.CopyFrom(m)  # (``finished`` keeps the chunk's own, for a resync report)
                sent.batches.extend(self._take_unsent())
                return SendMetrics(metrics=sent)
            return SendMetrics(metrics=m)
        if self.throttled:
            return WAIT_THROTTLE
        assert self.spec is not None
        offset, count = cur.take(self.spec.batch_size)  # type: ignore[misc]
        self.in_hand = TrainBatch(epoch=cur.epoch, offset=offset, count=count)
        return self.in_hand

    def upcoming(self, n: int) -> list[tuple[int, int, int]]:
        """The next ``n`` batches ``(epoch, offset, count)`` that ``next_action`` will hand
        out if no plan arrives in between (plans only ever queue behind): read-only, for
        the shell's data prefetch."""
        if self.spec is None or n <= 0:
            return []
        out: list[tuple[int, int, int]] = []
        chunks = ([self.current] if self.current is not None else []) + list(self.plans)
        for ch in chunks:
            for off, size in ch.held():
                while size > 0 and len(out) < n:
                    count = min(self.spec.batch_size, size)
                    out.append((ch.epoch, off, count))
                    off, size = off + count, size - count
                if len(out) >= n:
                    return out
        return out

    # -- admission and batches ----------------------------------------------------------

    def _admitted(self, ev: Admitted, out: list[Command]) -> None:
        self.spec = ev.spec
        self.global_step = max(ev.global_step, ev.spec.global_step)  # the run's progress at admission
        self.samples_committed = ev.spec.samples_committed
        self.awaiting_seed = bool(ev.spec.join_running)
        if ev.hello_resent and self.incarnation is not None:
            # The first answer may have been lost with a coordinator that restarted: this
            # one then comes from the new process, which already counts the rank as a
            # member awaiting its resync -- and the plan it sent before dying is gone.
            # The rank cannot tell, so it reports (a coordinator that did not restart
            # ignores a report it is not awaiting).
            self._report(self.incarnation, out)

    def _seed(self, ev: SeedApplied, out: list[Command]) -> None:
        """The seed is loaded: say so (the coordinator then makes this rank a member).
        A repeat (the coordinator restarted and asked again) is confirmed again."""
        if not self.accepts_seed():
            out.append(Drop(reason="unexpected_seed", detail=f"seed of cycle {ev.cycle} for a rank that is not joining"))
            return
        self.awaiting_seed = False
        out.append(SendTiming(kind="seeded", body=pb.Timing.Seeded(cycle=ev.cycle)))

    def _batch(self, ev: BatchTrained, out: list[Command]) -> None:
        self.in_hand = None
        self.local_step += 1
        self.steps_since_avg += 1
        cur = self.current
        if cur is not None:
            cur.batches += 1
            cur.samples += ev.samples
            cur.loss_sum += ev.loss
            cur.compute_ms += ev.batch_ms
            cur.data_ms += ev.data_ms
        batch = pb.Timing.Batch(
            batch_ms=ev.batch_ms, data_ms=ev.data_ms, step_count=self.local_step, batch_loss=ev.loss, lr=ev.lr,
            samples=ev.samples, epoch=ev.epoch, offset=ev.offset, wait_ms=self.wait_ms,
        )  # fmt: skip
        self.wait_ms = 0.0
        self.unfolded.append(batch)  # until folded: a restarted coordinator may ask for it
        self.unsent.append(batch)
        self.unsent_ms += ev.batch_ms + ev.data_ms
        assert self.spec is not None
        window_run = 0 < self.report_at <= self.local_step  # the next round waits for this step
        if window_run:
            self.report_at = 0
        if (
            cur is not None
            and cur.exhausted()
            and self.spec.batches_in_metrics
            and len(self.unsent) < MAX_BATCHES_PER_REPORT
        ):
            self.held_for_metrics = True
            return  # they ride in the chunk's Metrics, next_action's next answer (protocol 1.3)
        if (
            window_run
            or self.unsent_ms >= self.spec.batch_report_ms
            # A stretched interval spanning many batches: report_batches of them and the
            # interval as set (RunSpec.report_floor_ms) are enough.
            or (0 < self.spec.report_batches <= len(self.unsent) and self.unsent_ms >= self.spec.report_floor_ms)
            or len(self.unsent) >= MAX_BATCHES_PER_REPORT
            or cur is None
            or cur.exhausted()  # the plan ran out: the coordinator plans the next one by it
            # One batch left and nothing queued: reported now, the next plan can reach the
            # rank while it trains that batch, not after it ran dry (a turnaround idle).
            or (not self.plans and cur.last_batch_left(self.spec.batch_size))
            or self.throttled
        ):
            out.extend(self._unsent_report())

    def _heartbeat_due(self, ev: HeartbeatDue, out: list[Command]) -> None:
        if self.unsent:  # reported a little early, it is the heartbeat: one frame, not two
            out.extend(self._unsent_report())
            return
        out.append(SendTiming(kind="heartbeat", body=pb.Timing.Heartbeat(step_count=self.local_step)))

    def _take_unsent(self) -> list[pb.Timing.Batch]:
        """The batches not reported yet, now reported (or in a resync report): none held."""
        unsent, self.unsent, self.unsent_ms, self.held_for_metrics = self.unsent, [], 0.0, False
        return unsent

    def _unsent_report(self) -> list[Command]:
        """The batches not reported yet, as one frame (one ``batch`` frame when alone)."""
        unsent = self._take_unsent()
        if len(unsent) == 1:
            return [SendTiming(kind="batch", body=unsent[0])]
        return [SendTiming(kind="batches", body=pb.Timing.BatchRun(batch=unsent))]

    def _metrics(self, chunk: Chunk, now: float) -> pb.Metrics:
        m = pb.Metrics(
            rank=self.rank,
            epoch=chunk.epoch,
            chunk_seq=chunk.seq,
            avg_loss=chunk.loss_sum / chunk.batches if chunk.batches else 0.0,
            batches_processed=chunk.batches,
            samples_processed=chunk.samples,
            epoch_ms=(now - chunk.started) * 1e3,
            compute_only_ms=chunk.compute_ms,
            data_starve_ms=chunk.data_ms,
            share_complete_ms=chunk.compute_ms + chunk.data_ms,
        )
        self.finished.append(m)  # until its epoch is aggregated (the resync report)
        return m

    # -- control ------------------------------------------------------------------------

    def _control(self, ev: ControlReceived, out: list[Command]) -> None:
        c = ev.control
        which = c.WhichOneof("cmd")
        if c.command_id > self.last_command_id:
            self.last_command_id = c.command_id
        if which is None:
            out.append(Drop(reason="malformed", detail="control with no command"))
            return
        fn = _CONTROL.get(which)
        if fn is not None:
            fn(self, c, out)
        elif which in INFORMATIONAL:
            pass
        else:  # sync_now (the NCCL-inline variant), rendezvous on the bus plane
            out.append(Drop(reason="unsupported_control", detail=f"{which} (collective plane) is not supported by this rank"))

    def _request_params(self, c: pb.Control, out: list[Command]) -> None:
        assert self.spec is not None
        rp = c.request_params
        # Protocol 1.2: the next window, where it rides in the trigger, is taken first, as
        # the StartEpoch or ExtendPartition it stands for would have been (sent before it).
        if rp.HasField("next_plan"):
            self._queue(rp.next_plan, "RequestParams.next_plan", out)
        elif rp.HasField("extend"):
            self._extend_by(rp.extend, "RequestParams.extend", out)
        cycle, n = rp.cycle, self.steps_since_avg
        snap = Snapshot(n=n, step_count=self.local_step, weight=gamma_mass(n, self.spec.gamma))
        self.snapshots[cycle] = snap
        out.append(TakeSnapshot(cycle=cycle, n=snap.n, step_count=snap.step_count, weight=snap.weight))

    def _start_epoch(self, c: pb.Control, out: list[Command]) -> None:
        if c.start_epoch.HasField("epoch_callback_role"):  # a dispatch tells the role with the plan
            self.epoch_role = c.start_epoch.epoch_callback_role
        self._queue(c.start_epoch.plan, "StartEpoch", out)

    def _update(self, c: pb.Control, out: list[Command]) -> None:
        u = c.update
        self.report_at = u.report_at_step
        if u.HasField("global_step"):  # the round's global step (protocol 1.1; 1.0 sent SetGlobalStep)
            self.global_step, self.samples_committed = u.global_step, u.samples_committed
        if c.update.HasField("next_plan"):
            self._queue(c.update.next_plan, "Update.next_plan", out)
        self.throttled = False

    def _throttle(self, c: pb.Control, out: list[Command]) -> None:
        self.throttled = True
        out.extend(self._unsent_report() if self.unsent else ())  # it waits now: nothing may wait with it

    def _queue(self, plan: pb.EpochPlan, source: str, out: list[Command]) -> None:
        self._add_chunk(plan.epoch, plan.partition_offset, plan.partition_size, source, out)

    def _add_chunk(self, epoch: int, offset: int, size: int, source: str, out: list[Command]) -> None:
        assert self.spec is not None
        total = self.spec.total_samples
        if offset + size > total:
            out.append(Drop(reason="bad_plan", detail=f"{source} [{offset}, {offset + size}) exceeds {total} samples"))
            return
        if self.plans:
            # Reference hazard 11: two outstanding plans usually mean a coordinator bug.
            # Keep both (dropping one would strand its samples), but say so.
            out.append(Warn(text=f"{source} arrived while another plan is still queued; keeping both (FIFO)"))
        self.chunk_seq += 1
        self.plans.append(Chunk(epoch=int(epoch), seq=self.chunk_seq, segments=deque([[int(offset), int(size)]])))

    def _extend(self, c: pb.Control, out: list[Command]) -> None:
        self._extend_by(c.extend_partition, "ExtendPartition", out)

    def _extend_by(self, m: pb.Control.ExtendPartition, source: str, out: list[Command]) -> None:
        # The plan it extends: the last one queued (Cadence sends a window's further
        # ranges right behind its plan), else the one in training (Sync hands a dead
        # rank's remainder to the survivors' partitions); of its epoch.
        last = self.plans[-1] if self.plans else None
        target = last if last is not None and last.epoch == m.epoch else self.current
        if target is not None and target.epoch == m.epoch:
            assert self.spec is not None
            if m.partition_offset + m.partition_size > self.spec.total_samples:
                out.append(Drop(reason="bad_plan", detail=f"{source} beyond the epoch"))
                return
            target.segments.append([int(m.partition_offset), int(m.partition_size)])
        else:  # no plan of its epoch: the extension is a chunk of its own
            self._add_chunk(m.epoch, m.partition_offset, m.partition_size, source, out)

    def _trim(self, c: pb.Control, out: list[Command]) -> None:
        m = c.trim_partition
        epoch, budget = int(m.epoch), int(m.keep)
        b = self.in_hand
        if b is not None and b.epoch == epoch:
            budget -= b.count  # on the device: kept whatever the command says
        released: list[pb.Span] = []
        chunks = ([self.current] if self.current is not None else []) + list(self.plans)
        for ch in chunks:
            if ch.epoch != epoch:
                continue
            for seg in ch.segments:
                stay = max(0, min(budget, seg[1]))
                budget -= stay
                if seg[1] > stay:
                    released.append(pb.Span(offset=seg[0] + stay, size=seg[1] - stay))
                    seg[1] = stay
        # A queued plan left with nothing is no plan: it would report an empty chunk.
        self.plans = deque(ch for ch in self.plans if not (ch.epoch == epoch and ch.exhausted()))
        kept = sum(p.partition_size for p in self.held_positions() if p.epoch == epoch)
        body = pb.Timing.PartitionTrimmed(command_id=c.command_id, epoch=epoch, kept=kept, released=released)
        out.append(SendTiming(kind="partition_trimmed", body=body))

    def _execute_eval(self, c: pb.Control, out: list[Command]) -> None:
        if c.execute_eval.target_rank == self.rank:
            out.append(RunEval(command=c.execute_eval))

    def _set_global_step(self, c: pb.Control, out: list[Command]) -> None:
        # A 1.0 coordinator's round (1.1 carries it in the Update): still understood.
        self.global_step = c.set_global_step.global_step
        self.samples_committed = c.set_global_step.samples_committed

    def _shutdown(self, c: pb.Control, out: list[Command]) -> None:
        self.exited = True
        out.append(Exit(reason=str(c.WhichOneof("cmd")), steps=self.local_step))

    def _set_role(self, c: pb.Control, out: list[Command]) -> None:
        self.epoch_role = c.set_epoch_callback_role.rank

    def _epoch_aggregated(self, c: pb.Control, out: list[Command]) -> None:
        done = c.epoch_aggregated.metrics.epoch
        self.finished = [m for m in self.finished if m.epoch > done]
        if self.epoch_role == self.rank:
            out.append(RunEpochFn(metrics=c.epoch_aggregated.metrics))

    def _rendezvous(self, c: pb.Control, out: list[Command]) -> None:
        assert self.spec is not None
        if self.spec.plane == pb.PLANE_COLLECTIVE:
            out.append(FormGroup(command=c.rendezvous))
        else:
            out.append(Drop(reason="unsupported_control", detail="rendezvous (collective plane) is not supported by this rank"))

    # -- consensus ----------------------------------------------------------------------

    def _consensus(self, ev: ConsensusReady, out: list[Command]) -> None:
        snap = self.snapshots.pop(ev.cycle, None)
        if snap is None:
            out.append(Drop(reason="unknown_cycle", detail=f"consensus for cycle {ev.cycle}, which this rank never snapshotted"))
            return
        acked = self.folded_step
        if ev.arrays is not None:
            self.steps_since_avg = max(0, self.steps_since_avg - snap.n)
            self.folded_step = acked = snap.step_count
            # Folded: no longer reported in a resync (pruned here, once per round, not per batch).
            self.unfolded = [b for b in self.unfolded if b.step_count > acked]
        out.append(ApplyConsensus(cycle=ev.cycle, arrays=ev.arrays, ack_step=acked, moved=self.local_step != snap.step_count))
        # Held until the next consensus: a later Checkpoint{cycle} saves exactly it.
        self.held = (ev.cycle, list(ev.arrays)) if ev.arrays is not None else None
        self.applied_cycle, self.applied_at_step = ev.cycle, self.local_step
        for c in sorted(k for k in self.armed if k <= ev.cycle):
            m = self.armed.pop(c)
            if c == ev.cycle:
                out.append(SaveCheckpoint(command=m, params=self.held[1] if self.held is not None else None))
            else:
                self._refuse(m, f"the consensus of cycle {c} never reached this rank", out)

    # -- checkpoints ----------------------------------------------------------------------

    def _checkpoint(self, c: pb.Control, out: list[Command]) -> None:
        m = c.checkpoint
        if m.target_rank != self.rank:
            return
        if not m.path:
            self._refuse(m, "no path in the Checkpoint command (the coordinator has no checkpoint_dir)", out)
        elif m.cycle == 0:
            out.append(SaveCheckpoint(command=m))
        elif m.cycle > self.applied_cycle:
            armed = pb.Control.Checkpoint()
            armed.CopyFrom(m)
            self.armed[m.cycle] = armed
        elif m.cycle == self.applied_cycle and self.held is not None and self.held[0] == m.cycle:
            out.append(SaveCheckpoint(command=m, params=self.held[1]))
        elif m.cycle == self.applied_cycle and self.local_step == self.applied_at_step:
            out.append(SaveCheckpoint(command=m))
        else:
            moved = self.local_step - self.applied_at_step
            self._refuse(
                m,
                f"the consensus of cycle {m.cycle} is no longer held (last applied cycle "
                f"{self.applied_cycle}, {moved} step(s) since)",
                out,
            )

    def _refuse(self, m: pb.Control.Checkpoint, error: str, out: list[Command]) -> None:
        out.append(Warn(text=f"checkpoint v{m.version} not saved: {error}"))
        res = pb.Timing.CheckpointResult(version=m.version, elapsed_ms=0.0, error=error, cycle=m.cycle)
        out.append(SendTiming(kind="checkpoint_result", body=res))

    # -- coordinator restarts -------------------------------------------------------------

    def _incarnation(self, ev: IncarnationSeen, out: list[Command]) -> None:
        inc = ev.incarnation
        if self.incarnation is None:
            if ev.hello_ack:
                self.incarnation = inc
            return
        if inc == self.incarnation:
            return
        if inc in self.left_behind:
            out.append(Drop(reason="stale_incarnation", detail=f"a frame of coordinator incarnation {inc}, which restarted"))
            return
        self.left_behind.add(self.incarnation)
        self.incarnation = inc
        self.restarts += 1
        if self.spec is not None:
            self._report(inc, out)

    def _report(self, inc: int, out: list[Command]) -> None:
        dropped = tuple(sorted(self.snapshots))
        self.snapshots.clear()  # their rounds died with the old coordinator's reducer
        out.append(AbandonRounds(cycles=dropped))
        batches = [b for b in self.unfolded if b.step_count > self.folded_step]
        self._take_unsent()  # they are in the report
        held = self.held_positions()
        report = pb.Timing.Resync(
            coordinator_incarnation=inc,
            last_command_id=self.last_command_id,
            local_step=self.local_step,
            folded_step=self.folded_step,
            throttled=self.throttled,
            idle=not held,
            batches=batches,
            held=held,
            chunks=self.finished,
        )
        out.append(SendTiming(kind="resync", body=report))
        out.append(Warn(text=(
            f"the coordinator restarted (incarnation {inc:x}): resync sent ({len(batches)} unfolded batches, "
            f"{sum(p.partition_size for p in held)} samples held, {len(dropped)} snapshot(s) dropped, "
            f"throttled={self.throttled})"
        )))  # fmt: skip


# Commands after which nothing leaves the rank (the rest send a frame, train, save or exit).
_SILENT = frozenset({Drop, Warn, AbandonRounds})

_HANDLERS: dict[type, Callable[[RankMachine, Any, list], None]] = {
    Admitted: RankMachine._admitted,
    IncarnationSeen: RankMachine._incarnation,
    ControlReceived: RankMachine._control,
    ConsensusReady: RankMachine._consensus,
    BatchTrained: RankMachine._batch,
    HeartbeatDue: RankMachine._heartbeat_due,
    SeedApplied: RankMachine._seed,
}

# Control command -> handler (informational kinds: INFORMATIONAL; anything else is dropped).
_CONTROL: dict[str, Callable[[RankMachine, pb.Control, list], None]] = {
    "request_params": RankMachine._request_params,
    "start_epoch": RankMachine._start_epoch,
    "update": RankMachine._update,
    "throttle": RankMachine._throttle,
    "extend_partition": RankMachine._extend,
    "trim_partition": RankMachine._trim,
    "execute_eval": RankMachine._execute_eval,
    "set_global_step": RankMachine._set_global_step,
    "checkpoint": RankMachine._checkpoint,
    "shutdown": RankMachine._shutdown,
    "shutdown_with_save": RankMachine._shutdown,
    "set_epoch_callback_role": RankMachine._set_role,
    "epoch_aggregated": RankMachine._epoch_aggregated,
    "rendezvous": RankMachine._rendezvous,
}
