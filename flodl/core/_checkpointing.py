"""Checkpoint decisions: when to save, who saves, failover, and resuming a run.

Theory of operation
-------------------
The core decides; the shell does the I/O (``flodl_coordinator.checkpointing``). A save is
two commands emitted together: ``Checkpoint{version, target_rank, cycle}`` to the
checkpoint role (``st.roles.checkpoint_role``, elected by ``_roles``; the lowest alive
rank if it is gone) and ``StageCheckpoint(version, meta)`` with
``_checkpoint.checkpoint_meta`` of that instant (the shell stages the meta). The record is ``CheckpointState``.

* ``on_epoch_aggregated`` (regular, ``checkpoint_every = N > 0``): right after epoch
  ``e`` aggregated, when ``(e + 1) % N == 0``. The epoch's coverage is complete, so
  every batch of it was folded; steps past the last snapshot (Cadence and Async already
  train the next epoch, ``cadence._boundary``) are in neither the consensus nor the meta.
  The cycle named is the last finished round's. While a round is open the save is
  *deferred* to its finish (``on_round_finished``, at its cycle): acks of the open round
  may already have committed batches only its consensus holds (that is often what
  completed the epoch), so no finished consensus matches this instant's coverage. Under
  Cadence the ranks train on while a round is open and after it, so the rank keeps the
  last consensus it applied (``flodl_worker.checkpoint_duty``) and saves that; a rank
  that no longer holds the cycle answers an error and the failover below applies.
  *One checkpoint per asked epoch.* Epochs shorter than a window (Cadence streams
  the boundary; ``run_ahead`` folds up to two windows in a round) can aggregate at one
  consensus. There is nothing new to save for the later one, so it gets no second
  ``Checkpoint``, only its own ``StageCheckpoint`` of the same version and cycle
  (``_also_epoch``); the shell commits it as a second directory sharing the save's
  file. Likewise a round during which several epochs aggregated saves once at its
  finish, with one meta per epoch. Each meta is *of its epoch* (``checkpoint_meta``'s
  ``through``: it resumes at ``epoch + 1``) and records what the weights hold of later
  epochs -- all of one aggregated at the same consensus -- so a resume skips exactly that.
  A pending checkpoint intent (``IntentRaised("checkpoint")``) makes the next
  aggregation save too, when checkpoints are configured (``configured``); otherwise it
  is dropped with ``Notice("intent_dropped")``.
* ``on_done`` (``CheckpointDone``): success clears the pending save, smooths its cost
  and makes the saver the checkpoint role; an error resends
  the same ``{version, cycle}`` to the lowest alive rank not yet tried, and gives up
  (``Notice("checkpoint_abandoned")``) when none is left; the rank asked becomes the
  checkpoint role. ``on_rank_gone`` does the
  same when the asked rank is lost before answering. Failover happens while the run
  trains (or runs its final eval); once it is ending, an unanswered save is given up.
* ``on_failure`` (``checkpoint_on_failure``): before ``ShutdownWithSave`` (failure) or
  the operator stop's ``Shutdown``, ``Checkpoint{cycle=0}`` -- the weights the rank holds
  -- with the meta's ``reason``.
* ``apply_resume(state, point)``: a fresh state continues from a ``ResumePoint``:
  counters, history, done epochs' coverage rows, Cadence averages / ElChe / guard, and
  the coverage of every epoch the checkpoint has samples of (the resume epoch and any
  later one) opened with its covered positions pre-committed. The dispatchers then hand
  out only ``resume_holes[e]`` for those epochs (none for an epoch the weights hold
  whole: it aggregates as soon as the run reaches it).
"""

from __future__ import annotations

from typing import Optional

from flodl.wire import pb

from . import _coverage, _roles
from ._checkpoint import ResumePoint, checkpoint_meta
from ._commands import Command, Notice, StageCheckpoint
from ._events import CheckpointDone
from .cadence._guards import make_guard
from ._phases import ACTIVE, FINAL_EVAL, IDLE, TRAINING
from ._state import CoordinatorState, EpochCoverage

__all__ = [
    "on_epoch_aggregated",
    "on_round_finished",
    "on_done",
    "on_rank_gone",
    "on_failure",
    "apply_resume",
]


def _role(st: CoordinatorState) -> Optional[int]:
    """The checkpoint role (``_roles``) if it is alive, else the lowest alive rank."""
    role = st.roles.checkpoint_role
    if role is not None and st.ranks[role].phase is ACTIVE:
        return role
    return _roles.lowest_alive_except(st, ())


def _save(
    st: CoordinatorState, out: list[Command], rank: int, version: int, cycle: int, reason: str,
    through: Optional[int] = None,
) -> None:
    ck = st.checkpoints
    ck.last_version, ck.last_cycle = version, cycle
    ck.last_epoch = st.metrics.last_aggregated if through is None else through
    ck.pending[version] = (cycle, (rank,))
    st.send(out, rank, checkpoint=pb.Control.Checkpoint(version=version, target_rank=rank, cycle=cycle))
    out.append(StageCheckpoint.of(version, checkpoint_meta(st, version, reason=reason, cycle=cycle, through=through)))


def _also_epoch(st: CoordinatorState, out: list[Command], epoch: int, through: Optional[int] = None) -> bool:
    """``epoch`` aggregated at the consensus already saved for an earlier epoch: no new
    save (the same weights), only its own meta for that save -- the shell commits a
    second checkpoint sharing the first one's ``model.pt``. False if this epoch has its
    meta already, or the save of this consensus is not this run's (a resume)."""
    ck, rs = st.checkpoints, st.rounds
    if ck.last_cycle is None or ck.last_version != rs.version or ck.last_epoch == epoch:
        return False
    ck.last_epoch = epoch
    meta = checkpoint_meta(st, rs.version, reason="checkpoint", cycle=ck.last_cycle, through=through)
    out.append(StageCheckpoint.of(rs.version, meta))
    return True


def configured(st: CoordinatorState) -> bool:
    """Whether this run saves checkpoints at all (a cadence, or saves on failure)."""
    return st.config.checkpoint_every > 0 or st.config.checkpoint_on_failure


def on_epoch_aggregated(st: CoordinatorState, epoch: int, out: list[Command]) -> bool:
    """A checkpoint after ``epoch`` if one is due (regular, or a pending checkpoint
    intent); True if one was asked. An intent in a run without checkpoints is dropped
    with ``Notice("intent_dropped")``."""
    every, ck, rs, ro = st.config.checkpoint_every, st.checkpoints, st.rounds, st.roles
    intent = ro.pending_checkpoint_intent
    if intent:
        ro.pending_checkpoint_intent = False
        if not configured(st):
            out.append(Notice("intent_dropped", {"kind": "checkpoint", "epoch": epoch, "detail": "checkpoints are not configured"}))
            intent = False
    regular = every > 0 and (epoch + 1) % every == 0 and ck.armed_epoch != epoch
    if not (regular or intent):
        return False
    if regular:
        ck.armed_epoch = epoch
    if rs.phase is not IDLE:
        # A round is open: the acks it has had already committed batches (maybe the
        # ones that completed this epoch) that only *its* consensus holds, and the ranks
        # may have applied that consensus already. Neither the last finished cycle (it
        # lacks those batches) nor the open one (not finished) matches the coverage of
        # this instant: save at the open round's finish, at its cycle, with the meta of
        # that moment (``on_round_finished``).
        ck.deferred = "checkpoint"
        if epoch not in ck.deferred_epochs:
            ck.deferred_epochs.append(epoch)
        return True
    if rs.version == ck.last_version or rs.version in ck.pending:
        # Nothing trained since the last save: when that was an earlier epoch's (two
        # epochs aggregated at one consensus), this epoch still gets its own checkpoint.
        return _also_epoch(st, out, epoch)
    role = _role(st)
    if role is None:
        return False  # nobody to save it
    _save(st, out, role, rs.version, rs.cycle, "checkpoint")
    return True


def on_round_finished(st: CoordinatorState, out: list[Command]) -> None:
    """A round just finished (``_averaging._finish``, after its ``Update`` commands, before any
    later ``RequestParams``): take the checkpoint deferred to it, at its cycle. The
    role rank has applied this consensus and holds it until its next one
    (``flodl_worker.checkpoint_duty``)."""
    ck, rs = st.checkpoints, st.rounds
    reason, ck.deferred = ck.deferred, None
    epochs, ck.deferred_epochs = ck.deferred_epochs, []
    if reason is None:
        return
    # Every epoch that aggregated while the round was open gets its own checkpoint of
    # this one consensus: one save, one meta per epoch, each as of its epoch.
    role = _role(st)
    rest = epochs[1:]
    if rs.version == ck.last_version or rs.version in ck.pending:
        rest = epochs  # this consensus is saved already (for an earlier epoch)
    elif role is None:
        return
    else:
        _save(st, out, role, rs.version, rs.cycle, reason, through=epochs[0] if epochs else None)
    for e in rest:
        _also_epoch(st, out, e, through=e)


def _failover(st: CoordinatorState, version: int, out: list[Command], why: str) -> None:
    cycle, tried = st.checkpoints.pending[version]
    nxt = _roles.lowest_alive_except(st, tried) if st.run.phase in (TRAINING, FINAL_EVAL) else None
    if nxt is None:
        del st.checkpoints.pending[version]
        st.checkpoints.given_up += 1
        st.checkpoints.abandoned.append(version)
        out.append(Notice("checkpoint_abandoned", {"version": version, "tried": list(tried), "detail": why}))
        return
    st.checkpoints.pending[version] = (cycle, tried + (nxt,))
    _roles.set_checkpoint_role(st, nxt)
    st.send(out, nxt, checkpoint=pb.Control.Checkpoint(version=version, target_rank=nxt, cycle=cycle))
    out.append(Notice("checkpoint_retry", {"version": version, "rank": nxt, "detail": why}))


def on_done(st: CoordinatorState, ev: CheckpointDone, out: list[Command]) -> None:
    rec = st.checkpoints.pending.get(ev.version)
    if rec is None or rec[1][-1] != ev.rank:
        st.count_ignored("CheckpointDone not awaited")
        return
    if ev.error is None:
        del st.checkpoints.pending[ev.version]
        _roles.absorb_cost(st, "checkpoint", ev.elapsed_ms)
        _roles.set_checkpoint_role(st, ev.rank)
        return
    _failover(st, ev.version, out, f"rank {ev.rank}: {ev.error}")


def on_rank_gone(st: CoordinatorState, rank: int, out: list[Command]) -> None:
    """The rank asked to save was lost before answering: ask the next one. (A rank
    that leaves cleanly answered first: its result precedes its exit on the wire.)"""
    for version, (_, tried) in sorted(st.checkpoints.pending.items()):
        if tried[-1] == rank:
            _failover(st, version, out, f"rank {rank} lost before saving")


def on_failure(st: CoordinatorState, out: list[Command], reason: str) -> None:
    """The run ends early (``reason`` in ``SAVE_REASONS``): save what the role rank holds."""
    if not st.config.checkpoint_on_failure or st.run.formed_at is None:
        return
    role = _role(st)
    version = st.rounds.version
    if role is None or version == st.checkpoints.last_version:
        return
    _save(st, out, role, version, 0, reason)


# -- resume ------------------------------------------------------------------------------


def apply_resume(st: CoordinatorState, point: ResumePoint) -> None:
    """Make the fresh ``st`` continue from ``point`` (see the module docstring)."""
    st.metrics.last_aggregated = point.last_aggregated_epoch
    st.rounds.version = point.version
    st.rounds.global_step = point.global_step
    hist = point.history if isinstance(point.history, dict) else {}
    st.metrics.history = [dict(row) for row in hist.get("epochs", [])]
    for row in hist.get("coverage", []):
        ec = EpochCoverage(int(row["epoch"]), int(row["expected"]), bytearray())
        ec.trained, ec.duplicates, ec.discarded = int(row["trained"]), int(row["duplicates"]), int(row["discarded"])
        ec.unique = ec.expected - int(row["missing"])
        ec.frozen = True
        st.coverage.epochs[ec.epoch] = ec
    ck = st.checkpoints
    ck.last_version = point.version
    # Every epoch the checkpoint has samples of (the resume epoch, and later ones the
    # weights already hold a part -- or all -- of) is opened with those positions
    # committed; only its holes are dispatched, so nothing the weights hold is trained twice.
    for epoch, size in point.expected:
        if epoch < point.epoch or epoch >= st.config.num_epochs:
            continue
        _coverage.open_epoch(st.coverage, epoch, size)
        ec = st.coverage.epochs[epoch]
        for off, n in point.covered_in(epoch):
            ec.committed[off : off + n] = b"\x01" * n
            ec.unique += n
            ec.trained += n
        ck.resume_holes[epoch] = tuple(point.uncovered(epoch))
    cad = st.cadence
    if cad is not None:
        cad.averages = {e: n for e, n in point.averages_per_epoch}
        el_state = (point.policy_state or {}).get("elche")
        if el_state:
            cad.elche.restore_from_state(el_state)
            cad.guard = make_guard(st.config.guard, history=el_state.get("trend_history") or ())
