"""Averaging (Sync policy, bus plane): when a round opens, and when it is done.

Theory of operation
-------------------
A round has two phases (``_phases.ROUND``)::

    IDLE --trigger--> PENDING --finish--> IDLE
                      PENDING --stall---> IDLE   (the run then ends: ReduceStall)
                      PENDING --abandon-> IDLE   (the coordinator restarted: ``_resync``)

Gate (``should_average``, §5.2 for Sync): fires when no round is pending, the run is
training, at least one rank is ACTIVE, and every ACTIVE rank either has stepped since
its window was last folded, or is *idle* (has reported its whole assignment, so it
cannot step any more) -- and at least one rank has stepped (``any_mover``). The idle
clause is ours: committed coverage needs the tail of an epoch folded even when
partitions differ by one batch. The verdict comes with a reason, like torchft's
``quorum_compute``; the last one is kept in ``rounds.gate_reason``.

Trigger (§5.3 CPU path): ``cycle += 1``; ``OpenRound(cycle, ranks)`` tells the reducer
whom to expect; the dispatcher's ``on_trigger`` (Cadence: every idle participant gets
its next window, so it trains while the round is open: inside its ``RequestParams`` where
that window is its one command, else as a ``StartEpoch`` before it -- ``_carried_plans``);
``RequestParams{cycle}`` to each participant, then -- unless the
dispatcher is progressive -- ``Throttle`` to each (Sync's barrier: a rank stops training
until ``Update``; a progressive policy paces ranks by the chunks it hands out instead).

Acks: a ``SyncAcked`` for the open cycle from a participant folds its window: steps up
to ``step_count`` are folded (``folded_step``), their batches are committed in the
coverage ledger, and ``step_count - previous folded`` is added to the round's window.
An ack for another cycle, from a non-participant, or a second ack is ignored (counted).

Refused contributions (bus): ``ContributionRefused`` (the shell's reducer would not sum the
rank's frame: non-finite, malformed, a forged weight, too far) marks the participant
``refused``; the round completes without its work and the rank, sent the consensus,
resets to it. Its ack then *discards* the window instead of folding it: steps up to
``step_count`` count as folded but add nothing to the round's window, the batches are
discarded in the coverage ledger (not committed) and the dispatcher's ``give_back`` hands
their positions out again (Sync: ``ExtendPartition``; Cadence/Async: back into the pool).
The rank stays ACTIVE and keeps getting work.

Finish (``finish_due``/``finish``, §5.4-5.5): once every participant still ACTIVE has acked (lost ranks
are excused -- the reducer was told by ``ForgetRank``), ``version += 1``,
``global_step += window``; the dispatcher's ``on_round_finished`` runs the policy's
feedback and returns each rank's folded next chunk; ``Update{version, cycle,
next_plan?, global_step, samples_committed}`` to each surviving participant (the run's
progress, for the ranks' LR schedules: protocol 1.0 sent it as ``SetGlobalStep``); the step
then elects roles, makes a checkpoint deferred to this round
(``_checkpointing.on_round_finished``), and calls the dispatcher's ``after_round`` (wake
idle ranks). A round pending longer than ``reduce_stall_s`` is a stall (``stall_due``):
the step ends the run with ``ShutdownWithSave(REDUCE_STALL)``.

Steps are never "reset": the unfolded count is ``last_step - folded_step`` per rank,
so a batch that lands between a snapshot and its finish is simply folded next time.

The gate and the dispatcher are the policy's (``_policy``): the step passes the dispatcher in.
"""

from __future__ import annotations

from itertools import repeat
from typing import Any, Callable, Optional

from flodl.wire import LEN, VARINT, pb, tag, varint

from . import _coverage
from ._carried_plans import NO_PLAN, carry_lone_plans, request_params, request_params_wire
from ._commands import Command, Notice, OpenRound, command_id_field
from ._dispatch import SYNC, Dispatcher
from ._errors import LocalViolation
from ._events import ContributionRefused, SyncAcked
from ._phases import (
    ACTIVE,
    IDLE,
    PENDING,
    ROUND,
    TRAINING,
    next_phase,
)
from ._state import CoordinatorState, RoundState

__all__ = [
    "should_average",
    "trigger",
    "on_ack",
    "on_refused",
    "finish_due",
    "finish",
    "stall_due",
    "stall",
    "abandon",
    "waiting_for",
]

def _transition(rs: RoundState, trigger_name: str) -> None:
    rs.phase = next_phase(ROUND, rs.phase, trigger_name, f"round {rs.cycle}")


def should_average(st: CoordinatorState) -> tuple[bool, str]:
    """Sync gate: (verdict, reason)."""
    if st.run.phase is not TRAINING:
        return False, f"run is {st.run.phase!r}"
    if st.rounds.phase is PENDING:
        return False, f"round {st.rounds.cycle} pending"
    if not st.alive_count():
        return False, "no active rank"
    # Asked first, in O(1): with nobody moved there is no blocker to look for -- and at an
    # epoch's end, when every rank is idle, looking walks all of them on every pass.
    if not st.any_unfolded():
        return False, "no rank has stepped since the last average"
    dispatcher = SYNC  # this is Sync's gate (``_policy.SYNC_POLICY``)
    # The lowest ACTIVE rank that has not stepped and still has work (the rank index
    # keeps the ranks without unfolded steps: the gate never walks the movers).
    blocker = st.index.lowest_still(lambda r: not dispatcher.idle(st, r))
    if blocker is not None:
        return False, f"rank {blocker} has not stepped since the last average"
    return True, "every active rank stepped or has no work left"


def trigger(st: CoordinatorState, out: list[Command], dispatcher: Dispatcher) -> None:
    rs = st.rounds
    _transition(rs, "trigger")
    rs.cycle += 1
    rs.ranks = tuple(st.alive_ranks())
    rs.acked = {}
    rs.divergence = {}
    rs.window = {}
    rs.window_steps = 0
    rs.refused = {}
    rs.opened_at = st.now
    st.index.open_round(rs.ranks)
    recs = st.ranks  # (``unfolded``, inline: a round opens for every rank)
    steps = tuple([max(0, recs[r].last_step - recs[r].folded_step) for r in rs.ranks])
    out.append(OpenRound(rs.cycle, rs.ranks, steps))
    planned: list[Command] = []
    dispatcher.on_trigger(st, list(rs.ranks), planned)
    # A rank's lone next window rides in its RequestParams (protocol 1.2: ``_carried_plans``).
    kept, carried = carry_lone_plans(planned, rs.ranks)
    out.extend(kept)
    # Built when sent: a round asks every rank (``CoordinatorState.send_built``).
    if not carried:
        st.send_built_each(out, rs.ranks, "request_params", _request_params, (rs.cycle,))
    else:
        cycle, get = rs.cycle, carried.get
        args = [(cycle, *get(r, NO_PLAN)) for r in rs.ranks]
        st.send_built_zip(out, list(rs.ranks), "request_params", request_params, args, wire=request_params_wire)
    if not dispatcher.progressive:
        st.send_built_each(out, rs.ranks, "throttle", _throttle)


def _request_params(ctl: pb.Control, cycle: int) -> None:
    ctl.request_params.cycle = cycle


def _throttle(ctl: pb.Control) -> None:
    ctl.throttle.SetInParent()


def _update(ctl: pb.Control, version: int, cycle: int, report_at_step: int, plan: Optional[pb.EpochPlan],
            global_step: int, committed: int) -> None:  # fmt: skip
    upd = ctl.update
    upd.version, upd.cycle = version, cycle
    upd.report_at_step = report_at_step
    upd.global_step, upd.samples_committed = global_step, committed  # (what SetGlobalStep said, protocol 1.0)
    if plan is not None:
        upd.next_plan.CopyFrom(plan)


_UPDATE_FIELDS = pb.Control.Update.DESCRIPTOR.fields_by_name
_UPDATE_TAG = tag(pb.Control.DESCRIPTOR.fields_by_name["update"].number, LEN)
_VERSION, _CYCLE, _AT, _GSTEP, _COMMITTED = (
    tag(_UPDATE_FIELDS[name].number, VARINT)
    for name in ("version", "cycle", "report_at_step", "global_step", "samples_committed")
)
_PLAN = tag(_UPDATE_FIELDS["next_plan"].number, LEN)


def _update_wire(command_id: int, version: int, cycle: int, report_at_step: int, plan: Optional[pb.EpochPlan],
                 global_step: int, committed: int) -> bytes:  # fmt: skip
    """``_update``'s Control as protobuf serialises it (fields in number order, proto3's
    zeros left out, the two optional fields always set), written without building it: a
    round answers every rank (tests/unit/core/test_send_wire.py holds it to protobuf's)."""
    parts = [_VERSION, varint(version)] if version else []
    if plan is not None:
        p = plan.SerializeToString()
        parts += (_PLAN, varint(len(p)), p)
    if cycle:
        parts += (_CYCLE, varint(cycle))
    if report_at_step:
        parts += (_AT, varint(report_at_step))
    parts += (_GSTEP, varint(global_step), _COMMITTED, varint(committed))
    body = b"".join(parts)
    return b"".join((command_id_field(command_id), _UPDATE_TAG, varint(len(body)), body))


def on_refused(st: CoordinatorState, ev: ContributionRefused) -> None:
    """The reducer refused the rank's contribution to the open round: its ack will name
    the window it discarded (``on_ack``)."""
    rs = st.rounds
    if rs.phase is not PENDING or ev.cycle != rs.cycle or ev.rank not in st.index.participants or ev.rank in rs.acked:
        st.count_ignored("ContributionRefused for a round that is not open")
        return
    rs.refused.setdefault(ev.rank, ev.reason)


def on_ack(st: CoordinatorState, ev: SyncAcked, out: list[Command], dispatcher: Dispatcher) -> None:
    rs = st.rounds
    # The index's participants: the set of ``rs.ranks`` (a tuple: a scan per ack made a
    # round of N ranks O(N^2)).
    if rs.phase is not PENDING or ev.cycle != rs.cycle or ev.rank not in st.index.participants:
        st.count_ignored("SyncAcked for a round that is not open")
        return
    if ev.rank in rs.acked:
        st.count_ignored("duplicate SyncAcked")
        return
    rec = st.ranks[ev.rank]
    rs.acked[ev.rank] = ev.step_count
    st.index.ack(ev.rank)
    if ev.rank in rs.refused:
        _discard_window(st, ev, out, dispatcher)
        return
    folded = max(0, ev.step_count - rec.folded_step)
    rs.window[ev.rank] = folded
    rs.window_steps += folded
    rec.folded_step = max(rec.folded_step, ev.step_count)
    _coverage.commit(st.coverage, ev.rank, ev.step_count)
    if ev.divergence is not None:
        rs.divergence[ev.rank] = ev.divergence
        rec.divergence = ev.divergence


def _discard_window(st: CoordinatorState, ev: SyncAcked, out: list[Command], dispatcher: Dispatcher) -> None:
    """A refused rank reset to the consensus: the window up to its ack is thrown away.

    Its steps up to ``step_count`` count as folded (the rank starts counting afresh from
    the consensus), but nothing is committed and the round gets no steps from it: the
    batches are ``discarded`` in the coverage ledger and their positions go back to the
    dispatcher (``give_back``) to be trained again -- by anyone, the rank included."""
    rs, rec = st.rounds, st.ranks[ev.rank]
    rs.window[ev.rank] = 0
    rec.folded_step = max(rec.folded_step, ev.step_count)
    lost = _coverage.discard_upto(st.coverage, ev.rank, ev.step_count)
    if lost:
        dispatcher.give_back(st, ev.rank, lost, out)
    out.append(
        Notice(
            "window_discarded",
            {
                "rank": ev.rank,
                "cycle": ev.cycle,
                "reason": rs.refused[ev.rank],
                "discarded_samples": sum(n for _, _, n in lost),
            },
        )
    )


def waiting_for(st: CoordinatorState) -> list[int]:
    """Participants of the open round that are still ACTIVE and have not acked, ascending."""
    return sorted(st.index.waiting) if st.rounds.phase is PENDING else []


def _few(ranks: set[int], shown: int = 8) -> str:
    """``[0, 3, 5]``, or just how many once there are more than ``shown`` (a reason is
    rebuilt on every event: it must not walk the world; ``/status`` lists them all)."""
    return str(sorted(ranks)) if len(ranks) <= shown else f"{len(ranks)} ranks"


def finish_due(st: CoordinatorState) -> tuple[bool, str]:
    """Every participant still ACTIVE has acked the open round (the ``finish_round`` rule)."""
    rs = st.rounds
    if rs.phase is not PENDING:
        return False, "no round pending"
    waiting = st.index.waiting
    if waiting:
        return False, f"round {rs.cycle} waits for {_few(waiting)}"
    return True, f"round {rs.cycle} acked"


def stall_due(st: CoordinatorState) -> tuple[bool, str]:
    """The open round, still waiting, has been pending longer than ``reduce_stall_s``."""
    rs = st.rounds
    if rs.phase is not PENDING or not st.index.waiting:
        return False, "no round waiting"
    if st.now - rs.opened_at > st.config.reduce_stall_s:
        return True, f"reduce stall: round {rs.cycle} pending > {st.config.reduce_stall_s:g}s"
    return False, f"round {rs.cycle} pending {st.now - rs.opened_at:g}s"


def stall(st: CoordinatorState) -> None:
    """The round stalled: it closes (the step then ends the run)."""
    _transition(st.rounds, "stall")
    st.index.close_round()


def abandon(st: CoordinatorState) -> Optional[int]:
    """The coordinator restarted: an open round is abandoned; returns its cycle (or None)."""
    rs = st.rounds
    if rs.phase is not PENDING:
        return None
    _transition(rs, "abandon")
    st.index.close_round()
    return rs.cycle


def finish(st: CoordinatorState, out: list[Command], dispatcher: Dispatcher) -> None:
    """Close the acked round: an ``Update`` to each surviving participant, with the run's
    global step and committed samples (protocol 1.0's ``SetGlobalStep``). The step then
    elects roles, makes a deferred checkpoint, and calls the dispatcher's ``after_round``,
    in that order."""
    rs = st.rounds
    _transition(rs, "finish")
    st.index.close_round()
    rs.open_s += max(0.0, st.now - rs.opened_at)
    rs.version += 1
    rs.global_step += rs.window_steps
    active = st.index.phases[ACTIVE]  # (the index follows every phase write; all alive, as a rule: one C pass)
    alive = list(rs.ranks) if active.issuperset(rs.ranks) else [r for r in rs.ranks if r in active]
    plans = dispatcher.on_round_finished(st, alive, out)
    # Built when sent (``CoordinatorState.send_built``): a round answers every rank. The
    # plans are the dispatcher's fresh messages, held by nothing else; the window's end
    # is read now (it moves with the next trigger).
    ends = dispatcher.window_end_steps(st, alive)
    committed = _coverage.committed_samples(st.coverage)  # the ranks' LR schedules follow it
    args = list(zip(repeat(rs.version), repeat(rs.cycle), ends, map(plans.get, alive), repeat(rs.global_step),
                    repeat(committed)))  # fmt: skip
    st.send_built_zip(out, alive, "update", _update, args, wire=_update_wire)  # (zipped: a round answers thousands)
