"""The one entry point: ``step(state, event) -> (state, commands)``.

Theory of operation
-------------------
``step`` does three things, always in this order:

1. **Validate** the event against the state (``_validate``). An illegal frame raises
   ``RankViolation`` *before anything changes* (h11: an illegal transition changes
   nothing). Late and duplicate frames are not illegal: they are ignored and counted
   in ``state.ignored``.
2. **Apply** the event with its handler (``_HANDLERS``): one small function per event
   type, each delegating to the module that owns the concern. Every frame from an
   addressable rank refreshes its liveness first. A rank that is lost or leaves goes
   through ``forget_rank`` -- the single place that removes a rank from everything.
3. **Settle** (``_settle``): consequences that follow from the state are re-applied
   until none fires (a fixed point, h11's ``_fire_state_triggered_transitions``).
   Each rule makes at most one move per pass, and the first rule that moved restarts
   the pass. The priority, and why:

   a. ``run.check_lost`` -- no ACTIVE rank left ends the run before anything else
      tries to address one;
   a'. ``collective.settle`` -- collective plane only: announce a new process-group
      generation when the ACTIVE set changed or the group failed, so the announcement
      reaches every member before any ``RequestParams`` of that generation;
   b. ``averaging.poll`` -- finish a round whose missing acks were all excused by
      deaths (or fail the run on a reduce stall): a finished round frees the gate;
   c. the gate (``should_average``) -> ``averaging.trigger``: a tail must be folded
      before its epoch's coverage can be complete;
   d. ``metrics.aggregate_ready`` -- aggregate the next epoch once complete;
   e. ``run.advance`` -- form the world, dispatch the next epoch, final round / eval,
      shutdown, finish.

   Every rule is a condition on the state, so most swaps only change how many passes
   a step takes. Two priorities are real: (a) comes first, and (c) precedes (e) so
   that a tail round opens before the run moves to the next epoch or to its end.

``forget_rank`` order (§9.2): membership phase -> ``ForgetRank`` (the shell drops the
route, the reducer drops the rank from an open round) -> the rank's uncommitted
batches are discarded -> the dispatcher's ``reassign`` hands what it never committed
to survivors (Sync: ``ExtendPartition``; Cadence: back into the chunk pool, survivors
woken) -> the callback roles it held move (``_roles.on_death``, while training or
in the final eval) -> a save it owed
fails over (lost only) -> a final eval it owed is resent (``_run.on_rank_gone``).

A ``BatchDone`` also reaches the dispatcher (``on_batch``): Cadence feeds its window
ledger and streams the rank's next chunk when this batch finished the current one.

A coordinator restart (``_resync``) is two more events: ``CoordinatorRestarted`` (fed by
a service rebuilt from its journal) and ``RankResynced`` (a rank's report of what the
crash may have lost; its unknown batches go through ``_on_batch``). After every step,
``_resync.note_sent`` records what ranks still awaiting resync were sent meanwhile.

Time enters only as ``event.now``; ``state.now`` is the latest seen. ``replay`` feeds a
journal of events through ``step`` from ``initial_state``; frames that were refused
(``RankViolation``) are refused again and change nothing, so a journal that recorded
every decoded event replays to the same state and the same commands.
"""

from __future__ import annotations

from typing import Callable, Iterable, Optional

from flodl.wire import pb

from . import _averaging, _checkpointing, _coverage, _dispatch, _membership, _metrics, _roles, _run
from . import _resync
from . import _collective
from ._commands import Command, ForgetRank, Notice
from ._checkpoint import ResumePoint
from ._config import CoreConfig
from ._policy import policy_of
from ._errors import LocalViolation, RankViolation
from ._events import (
    BatchDone,
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
    SyncAcked,
    Tick,
    StoreReady,
    CollectiveFailed,
    ContributionRefused,
    CoordinatorRestarted,
    RankResynced,
)
from ._phases import ACTIVE, FINAL_EVAL, FINISHED, TRAINING
from ._state import CoordinatorState, RankRecord

__all__ = ["initial_state", "step", "replay", "forget_rank"]

# A step moves a bounded number of times (a few rounds, one aggregation, one dispatch):
# hitting this means a rule keeps firing without changing the state -- our bug.
_MAX_SETTLE_PASSES = 256


def initial_state(config: CoreConfig, resume: Optional[ResumePoint] = None) -> CoordinatorState:
    """A fresh coordinator for ``config`` (raises LocalViolation if it cannot run it).

    With ``resume`` (``resume_plan`` of a validated checkpoint meta) the run continues
    from it: done epochs stay done, the resumed epoch trains only its uncovered ranges."""
    st = CoordinatorState(config=config, ranks=[RankRecord(r) for r in range(config.world_size)])
    _collective.setup(st)
    st.roles = _roles.initial_roles(config)
    policy_of(config).dispatcher.setup(st)
    if resume is not None:
        _checkpointing.apply_resume(st, resume)
    return st


def _validate(st: CoordinatorState, ev: Event) -> None:
    rank = getattr(ev, "rank", None)
    if isinstance(ev, RankHello) or rank is None:
        return
    if not 0 <= rank < st.config.world_size:
        raise RankViolation(f"rank {rank} out of range [0, {st.config.world_size})")
    if not st.addressable(rank):
        return  # a late frame from a rank that is gone: ignored, not illegal
    if isinstance(ev, BatchDone) and ev.step_count > st.ranks[rank].last_step:
        _dispatch.check_batch(st, ev)
    elif isinstance(ev, ChunkDone):
        _metrics.check_chunk(st, ev)


def step(state: CoordinatorState, event: Event) -> tuple[CoordinatorState, list[Command]]:
    """Apply ``event``; return the (same, updated) state and the commands to execute."""
    handler = _HANDLERS.get(type(event))
    if handler is None:
        raise LocalViolation(f"not an event: {type(event).__name__}")
    out: list[Command] = []
    if state.run.phase is FINISHED and not isinstance(event, RankHello):
        state.count_ignored("event after the run finished")
        return state, out
    _validate(state, event)
    if event.now > state.now:
        state.now = event.now
    handler(state, event, out)
    _settle(state, out)
    _resync.note_sent(state, out)  # what ranks awaiting resync may not know yet
    return state, out


def replay(
    config: CoreConfig,
    events: Iterable[Event],
    *,
    record: Optional[list[Command]] = None,
    resume: Optional[ResumePoint] = None,
) -> CoordinatorState:
    """Rebuild the state from a journal; commands are appended to ``record`` if given."""
    st = initial_state(config, resume)
    for ev in events:
        try:
            _, cmds = step(st, ev)
        except RankViolation:
            continue
        if record is not None:
            record.extend(cmds)
    return st


def forget_rank(st: CoordinatorState, rank: int, trigger: str, reason: str, out: list[Command]) -> None:
    """Remove a lost (``trigger="lost"``) or leaving (``"leave"``) rank from everything."""
    rec = st.ranks[rank]
    was_active = rec.phase is ACTIVE
    _membership.transition(rec, trigger)
    rec.reason = reason
    out.append(ForgetRank(rank, reason))
    if not was_active:  # a JOINING slot reopens; nothing was assigned to it
        rec.route, rec.incarnation = (), 0
        _membership.on_slot_reopened(st, rank, reason)
        return
    discarded = _coverage.discard(st.coverage, rank)
    policy_of(st.config).dispatcher.reassign(st, rank, out)
    kind = "rank_lost" if trigger == "lost" else "rank_left"
    out.append(Notice(kind, {"rank": rank, "reason": reason, "discarded_samples": discarded}))
    if st.run.phase is TRAINING or st.run.phase is FINAL_EVAL:  # roles matter no more once ending
        _roles.on_death(st, rank)
    if trigger == "lost":
        _checkpointing.on_rank_gone(st, rank, out)
    _run.on_rank_gone(st, rank, out)


def _settle(st: CoordinatorState, out: list[Command]) -> None:
    policy = policy_of(st.config)
    dispatcher, gate = policy.dispatcher, policy.gate
    for _ in range(_MAX_SETTLE_PASSES):
        if st.run.phase is FINISHED:
            return
        if _run.check_lost(st, out):
            continue
        if _collective.settle(st, out):  # (a') re-form the group before any RequestParams
            continue
        verdict = _averaging.poll(st, out, dispatcher)
        if verdict == "finished":
            continue
        if verdict == "stalled":
            _on_stall(st, out)
            continue
        fire, why = gate(st)
        st.rounds.gate_reason = st.reasons["open_round"] = why
        if fire:
            _averaging.trigger(st, out, dispatcher)
            continue
        if _metrics.aggregate_ready(st, out):
            continue
        if _run.advance(st, out, dispatcher):
            continue
        return
    raise LocalViolation("step did not reach a fixed point")


def _on_stall(st: CoordinatorState, out: list[Command]) -> None:
    rs = st.rounds
    reason = f"reduce stall: round {rs.cycle} pending > {st.config.reduce_stall_s:g}s"
    if st.run.phase is TRAINING or st.run.phase is FINAL_EVAL:
        _run.fail(st, out, reason, pb.SAVE_REASON_REDUCE_STALL)
    else:
        out.append(Notice("reduce_stall", {"cycle": rs.cycle, "detail": reason}))


# -- handlers: one per event type ------------------------------------------------------


def _from_rank(st: CoordinatorState, ev: Event) -> bool:
    """Refresh liveness; False (and counted) if the rank is not addressable."""
    rank = ev.rank  # type: ignore[attr-defined]
    if not st.addressable(rank):
        st.count_ignored(f"{type(ev).__name__} from a rank that is not in the run")
        return False
    _membership.touch(st, rank, ev.now)
    return True


def _on_tick(st: CoordinatorState, ev: Tick, out: list[Command]) -> None:
    for rank, reason in _membership.stale_ranks(st, ev.now):
        forget_rank(st, rank, "lost", reason, out)
    _membership.beacon(st, ev.now, out)


def _on_hello(st: CoordinatorState, ev: RankHello, out: list[Command]) -> None:
    _membership.on_hello(st, ev, out)


def _on_batch(st: CoordinatorState, ev: BatchDone, out: list[Command]) -> None:
    if not _from_rank(st, ev):
        return
    rec = st.ranks[ev.rank]
    if ev.step_count <= rec.last_step:
        st.count_ignored("duplicate BatchDone")
        return
    rec.last_step = ev.step_count
    rec.batches += 1
    rec.samples += ev.samples
    _dispatch.record_batch(st, ev)
    _coverage.record_batch(st.coverage, ev.rank, ev.epoch, ev.offset, ev.samples, ev.step_count, rec.folded_step)
    policy_of(st.config).dispatcher.on_batch(st, ev, out)


def _on_ack(st: CoordinatorState, ev: SyncAcked, out: list[Command]) -> None:
    if _from_rank(st, ev):
        _averaging.on_ack(st, ev, out, policy_of(st.config).dispatcher)


def _on_contribution_refused(st: CoordinatorState, ev: ContributionRefused, out: list[Command]) -> None:
    # The shell's verdict on the rank's round frame, not a frame from the rank: no liveness.
    if not st.addressable(ev.rank):
        st.count_ignored("ContributionRefused for a rank that is not in the run")
        return
    _averaging.on_refused(st, ev)


def _on_chunk(st: CoordinatorState, ev: ChunkDone, out: list[Command]) -> None:
    if _from_rank(st, ev):
        _metrics.on_chunk(st, ev)


def _on_exiting(st: CoordinatorState, ev: RankExiting, out: list[Command]) -> None:
    if _from_rank(st, ev):
        rec = st.ranks[ev.rank]
        rec.param_digest = ev.param_digest
        forget_rank(st, ev.rank, "leave", "exited cleanly", out)


def _on_liveness_only(st: CoordinatorState, ev: Event, out: list[Command]) -> None:
    _from_rank(st, ev)


def _on_eval(st: CoordinatorState, ev: EvalDone, out: list[Command]) -> None:
    if _from_rank(st, ev):
        _run.on_eval_done(st, ev, out)


def _on_checkpoint_done(st: CoordinatorState, ev: CheckpointDone, out: list[Command]) -> None:
    if _from_rank(st, ev):
        _checkpointing.on_done(st, ev, out)


def _on_intent(st: CoordinatorState, ev: IntentRaised, out: list[Command]) -> None:
    if _from_rank(st, ev):
        _run.on_intent(st, ev, out)


def _on_exit_report(st: CoordinatorState, ev: RankExitReported, out: list[Command]) -> None:
    if not st.addressable(ev.rank):
        st.count_ignored("exit report for a rank that is not in the run")
        return
    trigger, reason = _membership.exit_reason(st, ev.rank, ev.code)
    forget_rank(st, ev.rank, trigger, reason, out)


def _on_send_failed(st: CoordinatorState, ev: SendFailed, out: list[Command]) -> None:
    if not st.addressable(ev.rank):
        st.count_ignored("send failure for a rank that is not in the run")
        return
    forget_rank(st, ev.rank, "lost", f"unroutable (send of {ev.what or 'a command'} failed)", out)


def _on_stop(st: CoordinatorState, ev: StopRequested, out: list[Command]) -> None:
    _run.on_stop(st, ev, out)


def _on_epoch_fn(st: CoordinatorState, ev: EpochFnElapsed, out: list[Command]) -> None:
    if _from_rank(st, ev):
        _roles.on_epoch_fn_elapsed(st, ev)


def _on_store_ready(st: CoordinatorState, ev: StoreReady, out: list[Command]) -> None:
    if _from_rank(st, ev):
        _collective.on_store_ready(st, ev, out)


def _on_collective_failed(st: CoordinatorState, ev: CollectiveFailed, out: list[Command]) -> None:
    if _from_rank(st, ev):
        _collective.on_failed(st, ev, out)


def _on_restarted(st: CoordinatorState, ev: CoordinatorRestarted, out: list[Command]) -> None:
    _resync.on_restarted(st, ev, out)


def _on_resynced(st: CoordinatorState, ev: RankResynced, out: list[Command]) -> None:
    if _from_rank(st, ev):
        _resync.on_resynced(st, ev, out, ingest=_on_batch, dispatcher=policy_of(st.config).dispatcher)


_HANDLERS: dict[type, Callable[[CoordinatorState, Event, list[Command]], None]] = {
    Tick: _on_tick,
    RankHello: _on_hello,
    BatchDone: _on_batch,
    SyncAcked: _on_ack,
    ChunkDone: _on_chunk,
    RankExiting: _on_exiting,
    HeartbeatSeen: _on_liveness_only,
    EvalDone: _on_eval,
    CheckpointDone: _on_checkpoint_done,
    IntentRaised: _on_intent,
    RankExitReported: _on_exit_report,
    SendFailed: _on_send_failed,
    StopRequested: _on_stop,
    EpochFnElapsed: _on_epoch_fn,
    StoreReady: _on_store_ready,
    CollectiveFailed: _on_collective_failed,
    ContributionRefused: _on_contribution_refused,
    CoordinatorRestarted: _on_restarted,
    RankResynced: _on_resynced,
}
