"""Run phase: forming the world, advancing epochs, the final eval, and the end (§11.3).

Theory of operation
-------------------
The run's phase moves by this table (``TRANSITIONS``)::

    FORMING --form--> TRAINING --final_eval--> FINAL_EVAL --shutdown--> SHUTTING_DOWN
                      TRAINING --shutdown---------------------------->  SHUTTING_DOWN
    SHUTTING_DOWN --finish--> FINISHED        (ok: every rank left or died)
    FORMING/TRAINING/FINAL_EVAL --stop--> STOPPING --finish--> FINISHED (not ok)
    TRAINING/FINAL_EVAL --fail--> FINISHED    (all ranks lost, reduce stall)

``advance`` is one rule of the step's fixed point; each call makes at most one move
and says whether it did:

* FORMING: when every slot is JOINING the world forms (all ACTIVE).
* TRAINING, no round pending: dispatch the next epoch once the previous one has
  aggregated (epoch 0 right after forming). After the last epoch: if an ACTIVE rank
  still has unfolded steps, open a final round first (even with one rank left, so the
  tail is committed); then, if ``final_eval``, send ``ExecuteEval{schedule_id=2**64-1,
  epoch=num_epochs, final=True}`` to the eval role (lowest alive rank) only; else
  ``Shutdown`` to every ACTIVE rank.
* FINAL_EVAL: once the target answered (an error skips the accuracy) or is gone,
  ``Shutdown`` to every ACTIVE rank.
* SHUTTING_DOWN: once no rank is addressable, ``RunFinished(ok=True, "completed")``.
* STOPPING: once no rank is addressable, or ``liveness_timeout_s`` after the stop,
  ``RunFinished(ok=False, "stopped: ...")``.

``check_lost``: in TRAINING or FINAL_EVAL, once the DEAD ranks reach ``max_failure``
(``_max_failure``; checked first) the run fails with ``ShutdownWithSave(
MAX_FAILURE_EXCEEDED)`` to the survivors; with no ACTIVE rank left, with
``ShutdownWithSave(ALL_RANKS_LOST)`` (to whoever is still addressable: nobody). Both end
in ``RunFinished(ok=False)``. ``fail`` is also how a reduce stall ends the run. With
``checkpoint_on_failure``, ``fail`` and ``on_stop`` first ask the role rank to save what
it holds (``_checkpointing.on_failure``).

The summary (``summary``) is JSON-safe; its shape is documented on the function.
"""

from __future__ import annotations

from typing import Any

from flodl.wire import pb

from . import _averaging, _checkpointing, _coverage, _feedback, _membership
from ._commands import Command, Notice, RunFinished
from ._dispatch import Dispatcher, role_rank
from ._errors import LocalViolation
from ._max_failure import max_failure_limit
from ._events import EvalDone, StopRequested
from ._state import (
    ACTIVE,
    DEAD,
    FINAL_EVAL,
    FINISHED,
    FORMING,
    JOINING,
    PENDING,
    SHUTTING_DOWN,
    STOPPING,
    TRAINING,
    CoordinatorState,
    FinalEval,
)

__all__ = [
    "TRANSITIONS",
    "FINAL_SCHEDULE_ID",
    "advance",
    "check_lost",
    "fail",
    "on_eval_done",
    "on_stop",
    "summary",
]

FINAL_SCHEDULE_ID = 2**64 - 1  # u64::MAX in the original: "the run's closing eval"

TRANSITIONS: dict[tuple[Any, str], Any] = {
    (FORMING, "form"): TRAINING,
    (TRAINING, "final_eval"): FINAL_EVAL,
    (TRAINING, "shutdown"): SHUTTING_DOWN,
    (FINAL_EVAL, "shutdown"): SHUTTING_DOWN,
    (SHUTTING_DOWN, "finish"): FINISHED,
    (FORMING, "stop"): STOPPING,
    (TRAINING, "stop"): STOPPING,
    (FINAL_EVAL, "stop"): STOPPING,
    (STOPPING, "finish"): FINISHED,
    (TRAINING, "fail"): FINISHED,
    (FINAL_EVAL, "fail"): FINISHED,
}


def _transition(st: CoordinatorState, trigger: str) -> None:
    new = TRANSITIONS.get((st.run.phase, trigger))
    if new is None:
        raise LocalViolation(f"run: no transition from {st.run.phase!r} on {trigger!r}")
    st.run.phase = new


def _form(st: CoordinatorState, out: list[Command]) -> None:
    for rec in st.ranks:
        _membership.transition(rec, "form")
    _transition(st, "form")
    st.run.formed_at = st.now
    hosts = [rec.host for rec in st.ranks]
    out.append(Notice("world_formed", {"world_size": len(st.ranks), "total_samples": st.total_samples, "hosts": hosts}))


def _begin_shutdown(st: CoordinatorState, out: list[Command]) -> None:
    _transition(st, "shutdown")
    for r in st.alive_ranks():
        st.send(out, r, shutdown=pb.Control.Shutdown(reason="completed"))
    out.append(Notice("shutdown", {"epochs_completed": len(st.metrics.history), "global_step": st.rounds.global_step}))


def _finish(st: CoordinatorState, out: list[Command], ok: bool, reason: str) -> None:
    _transition(st, "finish" if st.run.phase in (SHUTTING_DOWN, STOPPING) else "fail")
    st.run.ok, st.run.reason = ok, reason
    out.append(RunFinished(ok, reason, summary(st)))


def fail(st: CoordinatorState, out: list[Command], reason: str, save_reason: int) -> None:
    """End the run now: ``ShutdownWithSave`` to every addressable rank, then RunFinished.

    With ``checkpoint_on_failure`` the role rank is first asked to save what it holds."""
    name = pb.SaveReason.Name(save_reason)
    _checkpointing.on_failure(st, out, name.lower().removeprefix("save_reason_"))
    targets = st.addressable_ranks()
    for r in targets:
        st.send(out, r, shutdown_with_save=pb.Control.ShutdownWithSave(reason=save_reason, detail=reason))
    out.append(Notice("shutdown_with_save", {"reason": name, "detail": reason, "ranks": targets}))
    _finish(st, out, False, reason)


def check_lost(st: CoordinatorState, out: list[Command]) -> bool:
    """Fail the run when ``max_failure`` dead ranks are reached (checked first) or no
    ACTIVE rank is left."""
    if st.run.phase not in (TRAINING, FINAL_EVAL):
        return False
    limit = max_failure_limit(st.config.max_failure, st.config.world_size)
    dead = sum(1 for rec in st.ranks if rec.phase is DEAD)
    if limit is not None and dead > 0 and dead >= limit:
        reason = f"max_failure exceeded: {dead} dead rank(s), limit {limit} ({st.config.max_failure})"
        fail(st, out, reason, pb.SAVE_REASON_MAX_FAILURE_EXCEEDED)
        return True
    if st.alive_ranks():
        return False
    fail(st, out, "all ranks lost", pb.SAVE_REASON_ALL_RANKS_LOST)
    return True


def _advance_training(st: CoordinatorState, out: list[Command], dispatcher: Dispatcher) -> bool:
    if st.rounds.phase is PENDING:
        return False
    last = st.metrics.last_aggregated
    nxt = 0 if last is None else last + 1
    if nxt < st.config.num_epochs:
        if st.dispatch.last_dispatched is None or st.dispatch.last_dispatched < nxt:
            dispatcher.dispatch_epoch(st, nxt, out)
            return True
        return False
    if any(st.unfolded(r) > 0 for r in st.alive_ranks()):
        _averaging.trigger(st, out)  # the final tail: commit it before anything ends
        return True
    target = role_rank(st)
    if st.config.final_eval and target is not None:
        _transition(st, "final_eval")
        st.run.final_eval = FinalEval(target=target, sent_at=st.now)
        ev = pb.Control.ExecuteEval(
            schedule_id=FINAL_SCHEDULE_ID, epoch=st.config.num_epochs, target_rank=target, final=True
        )
        st.send(out, target, execute_eval=ev)
        return True
    _begin_shutdown(st, out)
    return True


def advance(st: CoordinatorState, out: list[Command], dispatcher: Dispatcher) -> bool:
    """Make the run's next move if one is due; True if it made one."""
    ph = st.run.phase
    if ph is FORMING:
        if all(rec.phase is JOINING for rec in st.ranks):
            _form(st, out)
            return True
        return False
    if ph is TRAINING:
        return _advance_training(st, out, dispatcher)
    if ph is FINAL_EVAL:
        fe = st.run.final_eval
        if fe is not None and (fe.answered or st.ranks[fe.target].phase is not ACTIVE):
            _begin_shutdown(st, out)
            return True
        return False
    if ph is SHUTTING_DOWN and not st.addressable_ranks():
        _finish(st, out, True, "completed")
        return True
    if ph is STOPPING:
        late = st.run.deadline is not None and st.now >= st.run.deadline
        if late or not st.addressable_ranks():
            _finish(st, out, False, f"stopped: {st.run.stop_reason}")
            return True
    return False


def on_eval_done(st: CoordinatorState, ev: EvalDone, out: list[Command]) -> None:
    fe = st.run.final_eval
    is_final = ev.final or ev.schedule_id == FINAL_SCHEDULE_ID
    if st.run.phase is not FINAL_EVAL or fe is None or not is_final or ev.rank != fe.target or fe.answered:
        st.count_ignored("EvalDone not awaited")
        return
    fe.answered = True
    fe.error = ev.error
    fe.accuracy = None if ev.error else ev.metric
    out.append(Notice("final_eval", {"rank": ev.rank, "accuracy": fe.accuracy, "error": ev.error}))


def on_stop(st: CoordinatorState, ev: StopRequested, out: list[Command]) -> None:
    if st.run.phase not in (FORMING, TRAINING, FINAL_EVAL):
        st.count_ignored("StopRequested while already ending")
        return
    _checkpointing.on_failure(st, out, "graceful_shutdown")
    _transition(st, "stop")
    st.run.stop_reason = ev.reason
    st.run.deadline = ev.now + st.config.liveness_timeout_s
    for r in st.addressable_ranks():
        st.send(out, r, shutdown=pb.Control.Shutdown(reason=f"stopped: {ev.reason}"))


def summary(st: CoordinatorState) -> dict[str, Any]:
    """The run summary (JSON-safe)::

    {world_size, policy, total_samples, epochs_completed, averages, averaging_s, global_step,
     accuracy: float|None, wall_s, discarded_samples,
     ranks: [{rank, host, phase, reason, samples, batches, steps, param_digest}],
     coverage: [{epoch, expected, trained, duplicates, missing, discarded}],
     epochs: [{epoch, avg_loss, epoch_ms, per_rank_throughput}]}

    Cadence adds ``elche: {anchor, anchor_rank, counts, phase, calibration_count, guard,
    last_verdict, exposed_sync_s}`` and, on each ``epochs`` row, ``averages``: the rounds finished while
    that epoch was being trained. The Sync shape is exactly the one above.
    """
    fe = st.run.final_eval
    cov = _coverage.summary(st.coverage)
    ranks = [
        {
            "rank": rec.rank,
            "host": rec.host,
            "phase": repr(rec.phase),
            "reason": rec.reason,
            "samples": rec.samples,
            "batches": rec.batches,
            "steps": rec.last_step,
            "param_digest": rec.param_digest,
        }
        for rec in st.ranks
    ]
    out = {
        "world_size": st.config.world_size,
        "policy": st.config.policy,
        "total_samples": st.total_samples,
        "epochs_completed": len(st.metrics.history),
        "averages": st.rounds.version,
        "averaging_s": st.rounds.open_s,
        "global_step": st.rounds.global_step,
        "accuracy": fe.accuracy if fe is not None else None,
        "wall_s": (st.now - st.run.formed_at) if st.run.formed_at is not None else 0.0,
        "discarded_samples": sum(c["discarded"] for c in cov),
        "ranks": ranks,
        "coverage": cov,
        "epochs": [dict(row) for row in st.metrics.history],
    }
    cad = st.cadence
    if cad is not None:
        out["elche"] = _feedback.summary(cad)
        for row in out["epochs"]:
            row["averages"] = cad.averages.get(row["epoch"], 0)
    return out
