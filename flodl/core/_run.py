"""Run phase: forming the world, advancing epochs, the final eval, and the end (§11.3).

Theory of operation
-------------------
The run's phase moves by this table (``_phases.RUN``)::

    FORMING --form--> TRAINING --final_eval--> FINAL_EVAL --shutdown--> SHUTTING_DOWN
                      TRAINING --shutdown---------------------------->  SHUTTING_DOWN
    SHUTTING_DOWN --finish--> FINISHED        (ok: every rank left or died)
    FORMING/TRAINING/FINAL_EVAL --stop--> STOPPING --finish--> FINISHED (not ok)
    TRAINING/FINAL_EVAL --fail--> FINISHED    (all ranks lost, reduce stall)
    FORMING --fail--> FINISHED                (form_timeout_s passed, quorum unmet; or
                                              it can no longer be met: ``_formation``)

``next_move`` is the ``due`` of the step's ``advance`` rule: it names the run's next
move, if one is due (the step makes it: ``advance`` for the run's own moves; forming,
a failed formation and a dispatch it composes with ``_membership`` and the dispatcher):

* FORMING (the join window, ``_forming_move``): when every slot is JOINING the world
  forms (the admitted ranks ACTIVE). With ``min_ranks`` (the quorum) below the capacity,
  the world also forms once the quorum is in and ``join_timeout_s`` has passed since the
  run's first event; the slots still VACANT stay open capacity. When ``form_timeout_s``
  (> 0; ``max_join_timeout_s``) has passed without the quorum, the run fails instead,
  naming each missing slot and why (``formation_report``: its last refusal, how it was
  lost, or "never said hello"); the admitted ranks get ``Shutdown``. It fails at once,
  before that, when processes that ended for good leave fewer possible slots than the
  quorum (``_formation.hopeless``: a script that fails at import is not a 300 s wait).
* TRAINING, no round pending: dispatch the next epoch once the previous one has
  aggregated (epoch 0 right after forming). After the last epoch: while an ACTIVE rank
  still has unfolded steps (``tail_due``), nothing: the step's ``open_round`` rule opens a
  final round first (even with one rank left, so the tail is committed); then, if ``final_eval``, send ``ExecuteEval{schedule_id=2**64-1,
  epoch=num_epochs, final=True}`` to the eval role (``st.roles.eval_role``; the lowest
  alive rank if it is gone) only; else ``Shutdown`` to every ACTIVE rank.
* FINAL_EVAL: an error answer, or the target's death (``on_rank_gone``), resends the
  final eval to the eval role / the next alive rank not yet tried
  (``Notice("final_eval_retry")``). Once the target answered (an error with nobody left
  to try skips the accuracy) or is gone with nobody left, ``Shutdown`` to every ACTIVE
  rank.
* SHUTTING_DOWN: once no rank is addressable, FINISHED (ok, "completed").
* STOPPING: once no rank is addressable, or ``liveness_timeout_s`` after the stop,
  FINISHED (not ok, "stopped: ...").

The step emits ``RunFinished`` (with the summary) whenever the phase becomes FINISHED.

``failure`` (a row of the step's ``FAILURES``): in TRAINING or FINAL_EVAL, once the DEAD ranks reach ``max_failure``
(``_max_failure``; checked first) the run fails with ``ShutdownWithSave(
MAX_FAILURE_EXCEEDED)`` to the survivors; with no ACTIVE rank left, with
``ShutdownWithSave(ALL_RANKS_LOST)`` (to whoever is still addressable: nobody). Both end
FINISHED, not ok. ``fail`` is also how a reduce stall ends the run. With
``checkpoint_on_failure``, the step first asks the role rank to save what it holds
(``_checkpointing.on_failure``), before ``fail`` and before ``on_stop``.

Intents (``on_intent``) set flags served at the next aggregation: a checkpoint intent
by ``_checkpointing``, an eval intent by ``serve_eval_intent`` (a non-final
``ExecuteEval{schedule_id=epoch}`` to the eval role; its answer lands in ``evals``).

The run summary is ``_summary``'s.
"""

from __future__ import annotations

from typing import Optional

from flodl.wire import pb

from . import _formation, _roles
from ._commands import FINAL_SCHEDULE_ID, Command, Notice
from ._max_failure import max_failure_limit
from ._events import EvalDone, IntentRaised, StopRequested
from ._phases import (
    ACTIVE,
    DEAD,
    FINAL_EVAL,
    FINISHED,
    FORMING,
    JOINING,
    PENDING,
    RUN,
    SHUTTING_DOWN,
    STOPPING,
    TRAINING,
    next_phase,
)
from ._state import CoordinatorState, FinalEval

__all__ = [
    "next_move",
    "advance",
    "failure",
    "tail_due",
    "next_epoch",
    "form",
    "formation_failure",
    "shutdown_admitted",
    "fail_formation",
    "fail",
    "stoppable",
    "on_eval_done",
    "on_intent",
    "on_rank_gone",
    "serve_eval_intent",
    "on_stop",
]

def _transition(st: CoordinatorState, trigger: str) -> None:
    st.run.phase = next_phase(RUN, st.run.phase, trigger, "run")


def form(st: CoordinatorState, out: list[Command]) -> None:
    """The world forms (the step has moved every slot to ACTIVE first)."""
    _transition(st, "form")
    st.run.formed_at = st.now
    members = st.alive_ranks()
    st.run.formed_with = tuple(members)
    hosts = [st.ranks[r].host for r in members]
    sig = (st.cohort_sig or b"").hex()  # what an operator pins as model_signature
    body = {"world_size": len(members), "total_samples": st.total_samples, "hosts": hosts, "model_signature": sig,
            "report_interval_ms": st.config.report_interval_ms}  # (batch_report_ms, stretched for many ranks)
    if st.config.elastic:
        body.update(ranks=members, capacity=len(st.ranks), quorum=st.config.quorum)
    out.append(Notice("world_formed", body))


def formation_report(st: CoordinatorState) -> str:
    """Who is missing from a world that has not formed, and why (one line)."""
    missing = [
        f"rank {rec.rank}: {st.run.not_admitted.get(rec.rank, 'never said hello')}"
        for rec in st.ranks
        if rec.phase is not JOINING
    ]
    admitted = [rec.rank for rec in st.ranks if rec.phase is JOINING]
    return f"{'; '.join(missing)} (admitted: {admitted or 'none'})"


def formation_failure(st: CoordinatorState) -> str:
    """Why the run fails when ``form_timeout_s`` passed with slots still empty (an
    elastic world: with its quorum unmet)."""
    cfg = st.config
    lost = _formation.hopeless(st)
    if lost is not None:
        return f"{lost} (admitted: {[rec.rank for rec in st.ranks if rec.phase is JOINING] or 'none'})"
    if cfg.elastic:
        admitted = sum(1 for rec in st.ranks if rec.phase is JOINING)
        return (
            f"the world did not form within {cfg.form_timeout_s:g}s (max_join_timeout_s): quorum unmet, "
            f"{admitted} of min_ranks {cfg.quorum} admitted: {formation_report(st)}"
        )
    return f"the world did not form within {cfg.form_timeout_s:g}s: {formation_report(st)}"


def shutdown_admitted(st: CoordinatorState, out: list[Command], reason: str) -> None:
    """The world did not form: the admitted ranks are told to leave (plain Shutdown:
    there is nothing to save yet). The step then refuses the deferred hellos."""
    for r in st.addressable_ranks():
        st.send(out, r, shutdown=pb.Control.Shutdown(reason=reason))


def fail_formation(st: CoordinatorState, out: list[Command], reason: str) -> None:
    """End the run that did not form, naming the missing slots (``formation_failure``)."""
    out.append(Notice("formation_failed", {"detail": reason}))
    _transition(st, "fail")
    st.run.ok, st.run.reason = False, reason


def _begin_shutdown(st: CoordinatorState, out: list[Command]) -> None:
    _transition(st, "shutdown")
    for r in st.addressable_ranks():  # a joiner not seeded yet leaves too
        st.send(out, r, shutdown=pb.Control.Shutdown(reason="completed"))
    out.append(Notice("shutdown", {"epochs_completed": len(st.metrics.history), "global_step": st.rounds.global_step}))


def _finish(st: CoordinatorState, ok: bool, reason: str) -> None:
    """The run is FINISHED; the step emits ``RunFinished`` with the summary."""
    _transition(st, "finish" if st.run.phase in (SHUTTING_DOWN, STOPPING) else "fail")
    st.run.ok, st.run.reason = ok, reason


def fail(st: CoordinatorState, out: list[Command], reason: str, save_reason: int) -> None:
    """End the run now: ``ShutdownWithSave`` to every addressable rank; FINISHED.

    The step asks for the save-on-failure first (``_checkpointing.on_failure``)."""
    name = pb.SaveReason.Name(save_reason)
    targets = st.addressable_ranks()
    for r in targets:
        st.send(out, r, shutdown_with_save=pb.Control.ShutdownWithSave(reason=save_reason, detail=reason))
    out.append(Notice("shutdown_with_save", {"reason": name, "detail": reason, "ranks": targets}))
    _finish(st, False, reason)


def failure(st: CoordinatorState) -> Optional[tuple[str, int]]:
    """(reason, save reason) when ``max_failure`` dead ranks are reached (checked first)
    or no ACTIVE rank is left, in TRAINING or FINAL_EVAL; else None."""
    if st.run.phase not in (TRAINING, FINAL_EVAL):
        return None
    dead = st.index.count(DEAD)
    limit = max_failure_limit(st.config.max_failure, st.config.world_size) if dead > 0 else None
    if limit is not None and dead >= limit:
        reason = f"max_failure exceeded: {dead} dead rank(s), limit {limit} ({st.config.max_failure})"
        return reason, pb.SAVE_REASON_MAX_FAILURE_EXCEEDED
    if st.alive_count():
        return None
    return "all ranks lost", pb.SAVE_REASON_ALL_RANKS_LOST


def next_epoch(st: CoordinatorState) -> int:
    last = st.metrics.last_aggregated
    return 0 if last is None else last + 1


def tail_due(st: CoordinatorState) -> bool:
    """After the last epoch aggregated, an ACTIVE rank still has unfolded steps: a final
    round must commit them before anything ends (the step's ``open_round`` rule)."""
    if st.run.phase is not TRAINING or st.rounds.phase is PENDING or next_epoch(st) < st.config.num_epochs:
        return False
    return st.any_unfolded()


def _forming_move(st: CoordinatorState) -> tuple[Optional[str], str]:
    """The join window (reference §1.8): a full world forms at once; with the quorum in,
    the world forms once ``join_timeout_s`` passed; the hard cap ``form_timeout_s``
    (``max_join_timeout_s``) passing with the quorum unmet fails the run."""
    cfg = st.config
    admitted = st.index.count(JOINING)  # O(1): this runs on every event while forming
    if admitted == len(st.ranks):
        return "form", "every slot joined"
    if st.run.forming_since is None:
        st.run.forming_since = st.now
    waited = st.now - st.run.forming_since
    if admitted >= cfg.quorum and waited >= cfg.join_timeout_s:
        return "form", f"quorum {cfg.quorum} met ({admitted} of {len(st.ranks)}), join window closed"
    lost = _formation.hopeless(st)
    if lost is not None:
        return "fail_formation", lost
    limit = cfg.form_timeout_s
    if limit > 0 and waited > limit:
        return "fail_formation", "form_timeout_s passed"
    if admitted >= cfg.quorum:
        return None, f"quorum met ({admitted} of {len(st.ranks)}): the join window is open"
    return None, "waiting for every slot" if not cfg.elastic else f"waiting for the quorum ({admitted} of {cfg.quorum})"


def _training_move(st: CoordinatorState) -> tuple[Optional[str], str]:
    if st.rounds.phase is PENDING:
        return None, f"round {st.rounds.cycle} pending"
    nxt = next_epoch(st)
    if nxt < st.config.num_epochs:
        if st.dispatch.last_dispatched is None or st.dispatch.last_dispatched < nxt:
            return "dispatch", f"epoch {nxt} is next"
        return None, f"epoch {nxt} training"
    if st.any_unfolded():
        return None, "the final tail round first"
    if st.config.final_eval and _eval_target(st, ()) is not None:
        return "final_eval", "every epoch aggregated"
    return "shutdown", "every epoch aggregated"


def start_final_eval(st: CoordinatorState, out: list[Command]) -> None:
    target = _eval_target(st, ())
    assert target is not None
    _transition(st, "final_eval")
    st.run.final_eval = FinalEval(target=target, sent_at=st.now)
    _send_final_eval(st, out, target)


def _eval_target(st: CoordinatorState, tried: tuple[int, ...]) -> Optional[int]:
    """The eval role if it is alive and untried, else the lowest alive untried rank."""
    role = st.roles.eval_role
    if role is not None and st.ranks[role].phase is ACTIVE and role not in tried:
        return role
    return _roles.lowest_alive_except(st, tried)


def _send_final_eval(st: CoordinatorState, out: list[Command], target: int) -> None:
    fe = st.run.final_eval
    fe.target, fe.tried = target, fe.tried + (target,)
    ev = pb.Control.ExecuteEval(
        schedule_id=FINAL_SCHEDULE_ID, epoch=st.config.num_epochs, target_rank=target, final=True
    )
    st.send(out, target, execute_eval=ev)


def _retry_final_eval(st: CoordinatorState, out: list[Command], why: str) -> bool:
    """Resend the final eval to the next candidate; False (nothing sent) if none is left."""
    fe = st.run.final_eval
    nxt = _eval_target(st, fe.tried)
    if nxt is None:
        return False
    out.append(Notice("final_eval_retry", {"rank": nxt, "tried": list(fe.tried), "detail": why}))
    _send_final_eval(st, out, nxt)
    return True


def next_move(st: CoordinatorState) -> tuple[Optional[str], str]:
    """The run's next move, if one is due, and why (the step's ``advance`` rule):
    "form", "fail_formation", "dispatch", "final_eval", "shutdown", "finish" or
    "finish_stopped"; None when none is due. In FORMING the first look starts the
    ``form_timeout_s`` clock (``forming_since``)."""
    ph = st.run.phase
    if ph is FORMING:
        return _forming_move(st)
    if ph is TRAINING:
        return _training_move(st)
    if ph is FINAL_EVAL:
        fe = st.run.final_eval
        if fe is not None and (fe.answered or st.ranks[fe.target].phase is not ACTIVE):
            return "shutdown", "the final eval is done"
        return None, "final eval pending"
    if ph is SHUTTING_DOWN:
        return ("finish", "every rank left") if not st.index.addressable_count() else (None, "ranks still leaving")
    if ph is STOPPING:
        late = st.run.deadline is not None and st.now >= st.run.deadline
        if late or not st.index.addressable_count():
            return "finish_stopped", "stopped"
        return None, "ranks still leaving"
    return None, f"run is {ph!r}"


def advance(st: CoordinatorState, out: list[Command], move: str) -> None:
    """Make one of the run's own moves (the step composes "form", "fail_formation" and
    "dispatch", which involve other records)."""
    if move == "final_eval":
        start_final_eval(st, out)
    elif move == "shutdown":
        _begin_shutdown(st, out)
    elif move == "finish":
        refused = st.run.refused
        if refused:  # trained without them: complete, but not the world that was asked for
            first = min(refused)
            _finish(st, False, f"rank(s) {sorted(refused)} refused mid-run: {refused[first]}")
        else:
            _finish(st, True, "completed")
    elif move == "finish_stopped":
        _finish(st, False, f"stopped: {st.run.stop_reason}")
    else:
        raise ValueError(move)


def on_eval_done(st: CoordinatorState, ev: EvalDone, out: list[Command]) -> None:
    fe = st.run.final_eval
    is_final = ev.final or ev.schedule_id == FINAL_SCHEDULE_ID
    pend = st.roles.pending_evals.get(ev.schedule_id)
    if not is_final and pend is not None and pend[1] == ev.rank:
        _on_intent_eval_done(st, ev, out)
        return
    if st.run.phase is not FINAL_EVAL or fe is None or not is_final or ev.rank != fe.target or fe.answered:
        st.count_ignored("EvalDone not awaited")
        return
    _roles.absorb_cost(st, "eval", ev.elapsed_ms)
    if ev.error and _retry_final_eval(st, out, f"rank {ev.rank}: {ev.error}"):
        return
    fe.answered = True
    fe.error = ev.error
    fe.accuracy = None if ev.error else ev.metric
    out.append(Notice("final_eval", {"rank": ev.rank, "accuracy": fe.accuracy, "error": ev.error}))


def _on_intent_eval_done(st: CoordinatorState, ev: EvalDone, out: list[Command]) -> None:
    ro = st.roles
    epoch, target = ro.pending_evals.pop(ev.schedule_id)
    _roles.absorb_cost(st, "eval", ev.elapsed_ms)
    if ev.error:
        out.append(Notice("eval_failed", {"rank": ev.rank, "epoch": epoch, "error": ev.error}))
        return
    ro.evals.append({"epoch": epoch, "metric": ev.metric})
    out.append(Notice("eval", {"rank": ev.rank, "epoch": epoch, "metric": ev.metric}))


def on_rank_gone(st: CoordinatorState, rank: int, out: list[Command]) -> None:
    """A rank left or was lost: if it owed the final eval, resend it to the (new) eval
    role; with nobody left to ask, ``advance`` shuts the run down without accuracy.
    A non-final eval it owed is forgotten."""
    ro = st.roles
    for sid in [s for s, (_, r) in ro.pending_evals.items() if r == rank]:
        del ro.pending_evals[sid]
    fe = st.run.final_eval
    if st.run.phase is FINAL_EVAL and fe is not None and not fe.answered and fe.target == rank:
        _retry_final_eval(st, out, f"rank {rank} gone before answering")


def on_intent(st: CoordinatorState, ev: IntentRaised, out: list[Command]) -> None:
    """``IntentRaised``: "eval" / "checkpoint" are served at the next aggregation."""
    ro = st.roles
    if ev.kind == "eval":
        ro.pending_eval_intent = True
    elif ev.kind == "checkpoint":
        ro.pending_checkpoint_intent = True
    else:
        st.count_ignored(f"IntentRaised of unknown kind {ev.kind!r}")


def serve_eval_intent(st: CoordinatorState, epoch: int, out: list[Command]) -> None:
    """After ``epoch`` aggregated: a pending eval intent becomes a non-final
    ``ExecuteEval{schedule_id=epoch, epoch, target=eval role}``."""
    ro = st.roles
    if not ro.pending_eval_intent:
        return
    ro.pending_eval_intent = False
    target = _eval_target(st, ())
    if target is None:
        return
    ro.pending_evals[epoch] = (epoch, target)
    st.send(out, target, execute_eval=pb.Control.ExecuteEval(schedule_id=epoch, epoch=epoch, target_rank=target))


def stoppable(st: CoordinatorState) -> bool:
    return st.run.phase in (FORMING, TRAINING, FINAL_EVAL)


def on_stop(st: CoordinatorState, ev: StopRequested, out: list[Command]) -> None:
    """(The step asks for the save-on-failure first.)"""
    if not stoppable(st):
        st.count_ignored("StopRequested while already ending")
        return
    _transition(st, "stop")
    st.run.stop_reason = ev.reason
    st.run.deadline = ev.now + st.config.liveness_timeout_s
    for r in st.addressable_ranks():
        st.send(out, r, shutdown=pb.Control.Shutdown(reason=f"stopped: {ev.reason}"))
