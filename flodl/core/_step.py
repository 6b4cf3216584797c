"""The one entry point: ``step(state, event) -> (state, commands)``.

Theory of operation
-------------------
``step`` does three things, always in this order:

1. **Validate** the event against the state (``_validate``). An illegal frame raises
   ``RankViolation`` *before anything changes* (h11: an illegal transition changes
   nothing). Late and duplicate frames are not illegal: they are ignored and counted
   in ``state.ignored``.
2. **Apply** the event with its row of ``HANDLERS`` (event type -> ``Handler(apply,
   validate, touches_liveness, ...)``): one small function per event type, each
   delegating to the modules that own the concern. A frame from an addressable rank
   refreshes its liveness first (``touches_liveness``); a rank event from a rank that is
   not in the run is ignored and counted. A rank that is lost or leaves goes through
   ``forget_rank`` -- the single place that removes a rank from everything.
3. **Settle** (``_settle``): the rows of ``RULES`` are re-applied until none fires (a
   fixed point, h11's ``_fire_state_triggered_transitions``). Each row is ``(name,
   due(st, policy) -> (bool, reason), act(st, out, policy))``; the first row that is due
   acts and restarts the pass, and every row's last reason is kept in
   ``st.reasons[name]`` (``/status`` says why each thing has not happened). Concern
   modules never call each other's actions: everything that must happen in order is
   composed here. The rows, in priority order, and why:

   ============  ================================================  =====================
   row           due                                               why here
   ============  ================================================  =====================
   fail          the first of ``FAILURES``: ``max_failure``        nothing may address a
                 reached, no ACTIVE rank, collective rendezvous     rank after this
                 exhausted (``cs.exhausted``)
   reform_group  ``_collective.due``: the ACTIVE set changed, a     a generation is
                 member failed, the store host timed out, a        announced before any
                 restart                                           ``RequestParams`` in it
   finish_round  every participant still ACTIVE acked: Update      a finished round
                 (global step in it), the Fastest election (once   frees the gate; roles
                 calibrated), a deferred checkpoint,                are elected before
                 ``after_round``                                    the checkpoint picks
                                                                   its rank
   stall         the open round waited > ``reduce_stall_s``:       only while some
                 the run fails (REDUCE_STALL)                       participant still owes
   seed_joiners  a rank admitted mid-run waits, no round is open,   the boundary between
                 a consensus exists: ``SeedJoiner``; collective     two rounds: before
                 plane: a generation that includes it is due        the next one opens
   open_round    ``policy.gate``, or the final tail (the last        a tail must fold
                 epoch aggregated, some rank has unfolded steps);    before its epoch's
                 never while a collective generation seeds joiners  coverage completes
   aggregate     the next epoch is complete: ``EpochAggregated``,  the checkpoint comes
                 its checkpoint, an eval intent served              before the next
                                                                   epoch's dispatch (FIFO)
   advance       ``_run.next_move``: form, dispatch the next       last
                 epoch, final eval, shutdown, finish
   ============  ================================================  =====================

   Most swaps would only change how many passes a step takes. Real priorities: ``fail``
   comes first; ``reform_group`` precedes any round; ``open_round`` precedes ``advance``
   so that a tail round opens before the run moves to its end. When the run becomes
   FINISHED (an act or a handler), the step emits ``RunFinished`` with the summary.

``forget_rank`` order (§9.2): membership phase -> ``ForgetRank`` (the shell drops the
route, the reducer drops the rank from an open round) -> the rank's uncommitted
batches are discarded -> the dispatcher's ``reassign`` hands what it never committed
to survivors (Sync: ``ExtendPartition``; Cadence: back into the chunk pool, survivors
woken) -> the callback roles it held move (``_roles.on_death``, while training or
in the final eval) -> a save it owed
fails over (lost only) -> a final eval it owed is resent (``_run.on_rank_gone``).

A ``BatchDone`` also reaches the dispatcher (``on_batch``): Cadence feeds its window
ledger and streams the rank's next chunk when this batch finished the current one.

Sync, a rank joined mid-epoch (``_repartition``): a member's ``PartitionTrimmed`` (its
answer to the ``TrimPartition`` a finished round sent it) hands what it gave back to the
joiner; a resync report settles a trim whose answer a restart lost, before the lost
positions are resent.

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

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional

from flodl.wire import pb

from . import _averaging, _checkpointing, _coverage, _dispatch, _membership, _metrics, _roles, _run
from . import _formation, _repartition, _resync
from . import _collective
from .cadence import _feedback
from . import _summary
from ._commands import Command, ForgetRank, Notice, RunFinished
from ._checkpoint import ResumePoint
from ._config import CoreConfig
from ._policy import Policy, policy_of
from ._errors import LocalViolation, RankViolation
from ._events import (
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
    SyncAcked,
    Tick,
    StoreReady,
    CollectiveFailed,
    ContributionRefused,
    CoordinatorRestarted,
    RankResynced,
    JoinerSeeded,
    PartitionTrimmed,
    UNPLACED,
)
from ._phases import ACTIVE, FINAL_EVAL, FINISHED, FORMING, JOINING, TRAINING
from ._state import CoordinatorState, RankRecord

__all__ = ["initial_state", "step", "replay", "forget_rank", "RULES", "HANDLERS", "FAILURES"]

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


def _validate(st: CoordinatorState, ev: Event, h: "Handler") -> None:
    rank = getattr(ev, "rank", None)
    if not h.checks_rank or rank is None or (h.unplaced_ok and rank == UNPLACED):
        return
    if not 0 <= rank < st.config.world_size:
        raise RankViolation(f"rank {rank} out of range [0, {st.config.world_size})")
    if not st.addressable(rank):
        return  # a late frame from a rank that is gone: ignored, not illegal
    if h.validate is not None:
        h.validate(st, ev)


def _admit(st: CoordinatorState, ev: Event, h: "Handler") -> bool:
    """A rank's frame refreshes its liveness; False (and counted) if the rank is not in the run."""
    if h.touches_liveness:
        rank = ev.rank  # type: ignore[attr-defined]
        if not st.addressable(rank):
            st.count_ignored(f"{type(ev).__name__} from a rank that is not in the run")
            return False
        _membership.touch(st, rank, ev.now)
    elif h.not_in_run and not st.addressable(ev.rank):  # type: ignore[attr-defined]
        st.count_ignored(h.not_in_run)
        return False
    return True


def _handle(st: CoordinatorState, ev: Event, out: list[Command]) -> None:
    h = HANDLERS[type(ev)]
    if _admit(st, ev, h):
        h.apply(st, ev, out)


def _finished(st: CoordinatorState, out: list[Command]) -> None:
    """The run just became FINISHED: ``RunFinished`` with the summary, last."""
    out.append(RunFinished(bool(st.run.ok), st.run.reason, _summary.summary(st, policy_of(st.config).summarise)))


def step(state: CoordinatorState, event: Event) -> tuple[CoordinatorState, list[Command]]:
    """Apply ``event``; return the (same, updated) state and the commands to execute."""
    h = HANDLERS.get(type(event))
    if h is None:
        raise LocalViolation(f"not an event: {type(event).__name__}")
    out: list[Command] = []
    if state.run.phase is FINISHED:
        if not h.after_finish:
            state.count_ignored("event after the run finished")
            return state, out
    _validate(state, event, h)
    if event.now > state.now:
        state.now = event.now
    was_finished = state.run.phase is FINISHED
    if _admit(state, event, h):
        h.apply(state, event, out)
    if not was_finished and state.run.phase is FINISHED:
        _finished(state, out)
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
        if rec.joined_at is not None:  # a joiner of the running world, lost before it was seeded
            rec.joined_at, rec.seeding = None, False
            _collective.on_joiner_gone(st, rank)
            out.append(Notice("rank_lost", {"rank": rank, "reason": reason, "discarded_samples": 0, "joining": True}))
            return
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


def _fail(st: CoordinatorState, out: list[Command], reason: str, save_reason: int) -> None:
    """End the run: the save-on-failure first (``checkpoint_on_failure``), then
    ``ShutdownWithSave`` to every addressable rank (``_run.fail``)."""
    name = pb.SaveReason.Name(save_reason)
    _checkpointing.on_failure(st, out, name.lower().removeprefix("save_reason_"))
    _run.fail(st, out, reason, save_reason)


# -- RULES: the consequences of the state, in priority order (module doc) ----------------


@dataclass(frozen=True, slots=True)
class Rule:
    name: str
    due: Callable[[CoordinatorState, Policy], tuple[bool, str]]
    act: Callable[[CoordinatorState, list[Command], Policy], None]


def _exhausted(st: CoordinatorState) -> Optional[tuple[str, int]]:
    cs = st.collective
    return (cs.exhausted, pb.SAVE_REASON_REDUCE_STALL) if cs is not None and cs.exhausted else None


# What ends the run, first hit wins: (reason, save reason) or None.
FAILURES: tuple[Callable[[CoordinatorState], Optional[tuple[str, int]]], ...] = (_run.failure, _exhausted)


def _failure(st: CoordinatorState) -> Optional[tuple[str, int]]:
    for f in FAILURES:  # a plain loop: asked on every pass of every step
        hit = f(st)
        if hit is not None:
            return hit
    return None


def _fail_due(st: CoordinatorState, policy: Policy) -> tuple[bool, str]:
    hit = _failure(st)
    return (True, hit[0]) if hit is not None else (False, "")


def _fail_act(st: CoordinatorState, out: list[Command], policy: Policy) -> None:
    hit = _failure(st)
    assert hit is not None
    _fail(st, out, *hit)


def _finish_round(st: CoordinatorState, out: list[Command], policy: Policy) -> None:
    _averaging.finish(st, out, policy.dispatcher)  # Update (with the global step)
    if _feedback.calibrated(st):  # once: the Fastest roles go to the fastest rank ...
        _roles.on_calibration(st)
    _checkpointing.on_round_finished(st, out)  # ... before a save deferred to this round picks its rank
    policy.dispatcher.after_round(st, out)


def _stall(st: CoordinatorState, out: list[Command], policy: Policy) -> None:
    _, reason = _averaging.stall_due(st)
    _averaging.stall(st)
    if st.run.phase is TRAINING or st.run.phase is FINAL_EVAL:
        _fail(st, out, reason, pb.SAVE_REASON_REDUCE_STALL)
    else:
        out.append(Notice("reduce_stall", {"cycle": st.rounds.cycle, "detail": reason}))


def _seed_joiners(st: CoordinatorState, out: list[Command], policy: Policy) -> None:
    asked = _membership.ask_seeds(st, out)  # bus: SeedJoiner each
    _collective.include(st, asked)  # collective: a generation that includes them is due


def _open_due(st: CoordinatorState, policy: Policy) -> tuple[bool, str]:
    held = _collective.seeding(st)
    if held:  # every member's next all-reduce would wait for a joiner not in the round
        st.rounds.gate_reason = held
        return False, held
    fire, why = policy.gate(st)
    st.rounds.gate_reason = why
    if fire:
        return True, why
    if _run.tail_due(st):
        return True, "the final tail: commit it before anything ends"
    return False, why


def _open_round(st: CoordinatorState, out: list[Command], policy: Policy) -> None:
    _averaging.trigger(st, out, policy.dispatcher)


def _aggregate(st: CoordinatorState, out: list[Command], policy: Policy) -> None:
    epoch = _metrics.aggregate_next(st, out)
    _checkpointing.on_epoch_aggregated(st, epoch, out)  # before the next epoch's dispatch
    _run.serve_eval_intent(st, epoch, out)
    policy.dispatcher.on_epoch_aggregated(st, epoch, out)  # the callbacks just asked for


def _advance_due(st: CoordinatorState, policy: Policy) -> tuple[bool, str]:
    move, why = _run.next_move(st)
    return (True, f"{move}: {why}") if move is not None else (False, why)


def _advance(st: CoordinatorState, out: list[Command], policy: Policy) -> None:
    move, _ = _run.next_move(st)
    assert move is not None
    if move == "form":
        _membership.form_all(st)  # a VACANT slot of an elastic world stays open capacity
        _run.form(st, out)
    elif move == "fail_formation":
        reason = _run.formation_failure(st)
        _run.shutdown_admitted(st, out, reason)
        _membership.refuse_deferred(st, reason, out)
        _run.fail_formation(st, out, reason)
    elif move == "dispatch":
        policy.dispatcher.dispatch_epoch(st, _run.next_epoch(st), out)
    else:
        _run.advance(st, out, move)


RULES: tuple[Rule, ...] = (
    Rule("fail", _fail_due, _fail_act),
    Rule("reform_group", lambda st, p: _collective.due(st), lambda st, out, p: _collective.announce(st, out)),
    Rule("finish_round", lambda st, p: _averaging.finish_due(st), _finish_round),
    Rule("stall", lambda st, p: _averaging.stall_due(st), _stall),
    Rule("seed_joiners", lambda st, p: _membership.seed_due(st), _seed_joiners),
    Rule("open_round", _open_due, _open_round),
    Rule("aggregate", lambda st, p: _metrics.next_ready(st), _aggregate),
    Rule("advance", _advance_due, _advance),
)


def _settle(st: CoordinatorState, out: list[Command]) -> None:
    policy = policy_of(st.config)
    for _ in range(_MAX_SETTLE_PASSES):
        if st.run.phase is FINISHED:
            return
        for rule in RULES:
            fire, why = rule.due(st, policy)
            st.reasons[rule.name] = why
            if fire:
                rule.act(st, out, policy)
                if st.run.phase is FINISHED:
                    _finished(st, out)
                    return
                break
        else:
            return
    raise LocalViolation("step did not reach a fixed point")


# -- HANDLERS: one row per event type ------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Handler:
    """``apply(st, ev, out)``; ``validate(st, ev)`` raises ``RankViolation`` before anything
    changes (only for an addressable rank's frame); ``touches_liveness``: a frame from the
    rank (refreshes its liveness; from a rank not in the run: ignored, counted);
    ``not_in_run``: for a rank event that is not its frame, the count when the rank is not
    in the run; ``checks_rank``: the rank is range-checked (``unplaced_ok``: but for
    ``UNPLACED``); ``after_finish``: still handled once the run finished."""

    apply: Callable[[CoordinatorState, Any, list[Command]], None]
    validate: Optional[Callable[[CoordinatorState, Any], None]] = None
    touches_liveness: bool = False
    not_in_run: str = ""
    checks_rank: bool = True
    after_finish: bool = False
    unplaced_ok: bool = False  # rank UNPLACED (a process that holds no slot) is not range-checked


def _check_batch(st: CoordinatorState, ev: BatchDone) -> None:
    if ev.step_count > st.ranks[ev.rank].last_step:
        _dispatch.check_batch(st, ev)


def _on_tick(st: CoordinatorState, ev: Tick, out: list[Command]) -> None:
    for rank, reason in _membership.stale_ranks(st, ev.now):
        forget_rank(st, rank, "lost", reason, out)
    _membership.beacon(st, ev.now, out)


def _ingest_batch(st: CoordinatorState, ev: BatchDone, out: list[Command], *, advance_last_step: bool,
                  more: bool = False) -> None:  # fmt: skip
    """The ledgers of one batch. ``advance_last_step`` False: a batch older than the rank's
    latest known step (its frame was lost, later ones were not: ``_resync``). ``more``:
    later batches of the rank's frame follow (``Dispatcher.on_batch``)."""
    rec = st.ranks[ev.rank]
    if advance_last_step:
        rec.advance_step(ev.step_count)
    # (wait_ms is sane by then: the wire's translation zeroes a hostile one)
    rec.count_batch(ev.samples, ev.batch_ms + ev.data_ms, ev.wait_ms)
    _dispatch.record_batch(st, ev)
    _coverage.record_batch(st.coverage, ev.rank, ev.epoch, ev.offset, ev.samples, ev.step_count, rec.folded_step)
    if not advance_last_step:
        _coverage.keep_step_order(st.coverage, ev.rank)
    policy_of(st.config).dispatcher.on_batch(st, ev, out, more=more)


def _on_batch(st: CoordinatorState, ev: BatchDone, out: list[Command], more: bool = False) -> None:
    if ev.step_count <= st.ranks[ev.rank].last_step:
        st.count_ignored("duplicate BatchDone")
        return
    _ingest_batch(st, ev, out, advance_last_step=True, more=more)


# A frame of batches holds at most this many: the rank sends up to 64 (flodl.rank), a
# peer that sends more is refused, not looped over.
MAX_BATCHES_PER_FRAME = 1024


def _check_batches(st: CoordinatorState, ev: BatchesDone) -> None:
    """Every batch of the frame must be one a ``BatchDone`` could say, in step order:
    checked against the state before any of them changes it (a frame is refused whole)."""
    if not 0 < len(ev.batches) <= MAX_BATCHES_PER_FRAME:
        raise RankViolation(f"rank {ev.rank}: a batches frame of {len(ev.batches)} batches "
                            f"(1 to {MAX_BATCHES_PER_FRAME})")  # fmt: skip
    prev = -1
    for b in ev.batches:
        if b.step_count <= prev:
            raise RankViolation(f"rank {ev.rank}: batches out of step order ({b.step_count} after {prev})")
        prev = b.step_count
        _check_batch(st, b)


def _on_batch_frame(st: CoordinatorState, ev: BatchDone, out: list[Command]) -> None:
    st.ranks[ev.rank].batch_frames += 1
    _on_batch(st, ev, out)


def _on_batches(st: CoordinatorState, ev: BatchesDone, out: list[Command]) -> None:
    st.ranks[ev.rank].batch_frames += 1
    last = len(ev.batches) - 1
    for i, b in enumerate(ev.batches):
        _on_batch(st, b, out, more=i < last)


def _on_exiting(st: CoordinatorState, ev: RankExiting, out: list[Command]) -> None:
    st.ranks[ev.rank].param_digest = ev.param_digest
    forget_rank(st, ev.rank, "leave", "exited cleanly", out)


def _on_exit_report(st: CoordinatorState, ev: RankExitReported, out: list[Command]) -> None:
    """An agent saw a process end: a loss of an admitted rank; before the world forms,
    also whether its slot can still be filled (``_formation``)."""
    if ev.rank == UNPLACED:
        _formation.on_unplaced_exit(st, ev, _membership.exit_reason(st, -1, ev.code)[1], out)
        return
    addressable = st.addressable(ev.rank)
    if not addressable and st.run.phase is not FORMING:
        st.count_ignored("exit report for a rank that is not in the run")
        return
    if _membership.stale_exit_report(st, ev.rank, ev.restart_count):
        return
    trigger, reason = _membership.exit_reason(st, ev.rank, ev.code)
    if addressable:
        forget_rank(st, ev.rank, trigger, reason, out)
    _formation.on_exit(st, ev, reason, out)  # (FORMING only: the slot is VACANT now)


def _on_send_failed(st: CoordinatorState, ev: SendFailed, out: list[Command]) -> None:
    forget_rank(st, ev.rank, "lost", f"unroutable (send of {ev.what or 'a command'} failed)", out)


def _on_rank_refused(st: CoordinatorState, ev: RankRefused, out: list[Command]) -> None:
    """Told why and to stop, then lost: a member's work goes to the others as a dead
    rank's does, and the run, however it ends, is not ok (``_run.advance``); a joiner's
    slot reopens, as for a refused hello."""
    st.send_last_word(out, ev.rank, shutdown=pb.Control.Shutdown(reason=ev.reason))
    if st.ranks[ev.rank].phase is ACTIVE:  # (a joiner refused trained nothing: its slot reopens)
        st.run.refused[ev.rank] = ev.reason
    forget_rank(st, ev.rank, "lost", f"refused: {ev.reason}", out)


def _on_stop(st: CoordinatorState, ev: StopRequested, out: list[Command]) -> None:
    if _run.stoppable(st):
        _checkpointing.on_failure(st, out, "graceful_shutdown")
    _run.on_stop(st, ev, out)


def _on_restarted(st: CoordinatorState, ev: CoordinatorRestarted, out: list[Command]) -> None:
    _resync.begin_restart(st)
    for r in st.addressable_ranks():  # a liveness grace: they need time to reconnect
        _membership.touch(st, r, ev.now)
    abandoned = _averaging.abandon(st)
    policy_of(st.config).on_restarted(st, abandoned)
    _collective.on_restarted(st)  # re-formed by the reform_group rule
    _membership.reseed_after_restart(st)  # a seed in flight died with the old process
    joining = any(rec.phase is JOINING for rec in st.ranks)
    spec = _membership.run_spec(st, st.cohort_len or 0) if joining else None
    _resync.await_reports(st, ev, out, abandoned, spec)


def _on_resynced(st: CoordinatorState, ev: RankResynced, out: list[Command]) -> None:
    """The phases of ``_resync`` (its module doc), composed."""
    if not _resync.awaited(st, ev):
        return
    behind = _resync.journal_behind(st, ev, out)
    if behind:
        if st.run.phase in (TRAINING, FINAL_EVAL):
            _fail(st, out, behind, pb.SAVE_REASON_GRACEFUL_SHUTDOWN)
        return
    _resync.fold_swallowed_ack(st, ev)
    lost = _resync.lost_positions(st, ev)  # before ingesting
    lost = _repartition.on_resynced(st, ev, lost, out)  # a trim whose answer the crash lost
    recovered = 0
    for bev in _resync.unknown_batches(st, ev):
        try:
            _dispatch.check_batch(st, bev)
        except RankViolation:
            st.count_ignored("Resync batch outside the rank's assignment")
            continue
        if bev.step_count > st.ranks[ev.rank].last_step:
            _handle(st, bev, out)
        else:
            _ingest_batch(st, bev, out, advance_last_step=False)
        recovered += 1
    resent = _resync.resend_lost(st, ev.rank, lost, out)
    chunks = 0
    for cev in _resync.unknown_chunks(st, ev):
        try:
            _metrics.check_chunk(st, cev)
        except RankViolation:
            st.count_ignored("Resync chunk of an epoch never dispatched")
            continue
        _metrics.on_chunk(st, cev)
        chunks += 1
    _resync.conclude(st, ev, out, recovered, chunks, resent, policy_of(st.config).release_throttle)


def _on_seeded(st: CoordinatorState, ev: JoinerSeeded, out: list[Command]) -> None:
    """A joiner holds the consensus: a member now; the dispatcher gives it work."""
    if not _membership.on_seeded(st, ev.rank, ev.cycle):
        return
    _collective.on_seeded(st, ev.rank)
    rec = st.ranks[ev.rank]
    waited = st.now - st.run.joins[-1]["admitted_at"]
    out.append(Notice("rank_joined", {"rank": ev.rank, "host": rec.host, "cycle": ev.cycle, "refill": rec.refill,
                                      "waited_s": round(waited, 3), "members": st.alive_ranks()}))  # fmt: skip
    rec.refill = False
    policy_of(st.config).dispatcher.on_join(st, ev.rank, out)


def _on_collective_failed(st: CoordinatorState, ev: CollectiveFailed, out: list[Command]) -> None:
    """Re-form the group (``_collective.on_failed``); joiners whose seed broadcast failed
    too often are refused, so that the members average again without them."""
    _collective.on_failed(st, ev, out)
    for rank, reason in _collective.joiners_to_drop(st):
        st.send_last_word(out, rank, shutdown=pb.Control.Shutdown(reason=reason))
        forget_rank(st, rank, "lost", reason, out)


def _nothing(st: CoordinatorState, ev: Event, out: list[Command]) -> None:
    """A frame that only proves the rank is alive."""


HANDLERS: dict[type, Handler] = {
    Tick: Handler(_on_tick),
    RankHello: Handler(lambda st, ev, out: _membership.on_hello(st, ev, out), checks_rank=False, after_finish=True),
    BatchDone: Handler(_on_batch_frame, _check_batch, touches_liveness=True),
    BatchesDone: Handler(_on_batches, _check_batches, touches_liveness=True),
    SyncAcked: Handler(lambda st, ev, out: _averaging.on_ack(st, ev, out, policy_of(st.config).dispatcher),
                       touches_liveness=True),  # fmt: skip
    ChunkDone: Handler(lambda st, ev, out: _metrics.on_chunk(st, ev), _metrics.check_chunk, touches_liveness=True),
    RankExiting: Handler(_on_exiting, touches_liveness=True),
    HeartbeatSeen: Handler(_nothing, touches_liveness=True),
    EvalDone: Handler(_run.on_eval_done, touches_liveness=True),
    CheckpointDone: Handler(_checkpointing.on_done, touches_liveness=True),
    IntentRaised: Handler(_run.on_intent, touches_liveness=True),
    # Admitted by its handler: before the world forms a report for a VACANT slot says
    # whether it can still come, and an unpinned process may hold no slot (UNPLACED).
    RankExitReported: Handler(_on_exit_report, unplaced_ok=True),
    SendFailed: Handler(_on_send_failed, not_in_run="send failure for a rank that is not in the run"),
    RankRefused: Handler(_on_rank_refused, not_in_run="RankRefused for a rank that is not in the run"),
    StopRequested: Handler(_on_stop),
    EpochFnElapsed: Handler(lambda st, ev, out: _roles.on_epoch_fn_elapsed(st, ev), touches_liveness=True),
    StoreReady: Handler(_collective.on_store_ready, touches_liveness=True),
    CollectiveFailed: Handler(_on_collective_failed, touches_liveness=True),
    # The shell's verdict on the rank's round frame, not a frame from the rank: no liveness.
    ContributionRefused: Handler(lambda st, ev, out: _averaging.on_refused(st, ev),
                                 not_in_run="ContributionRefused for a rank that is not in the run"),  # fmt: skip
    CoordinatorRestarted: Handler(_on_restarted),
    RankResynced: Handler(_on_resynced, touches_liveness=True),
    JoinerSeeded: Handler(_on_seeded, touches_liveness=True),
    PartitionTrimmed: Handler(_repartition.on_trimmed, _repartition.check_trimmed, touches_liveness=True),
}
