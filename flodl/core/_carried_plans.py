"""A round's trigger carries each rank's next window inside its ``RequestParams`` (protocol 1.2).

Under Cadence most participants of a round get exactly one command besides the trigger:
their next window, a ``StartEpoch`` or an ``ExtendPartition`` sent just before it. Two
frames per rank at the moment every rank is waiting on the coordinator: at 256 paced
ranks, 480 frames a trigger where 256 say the same. ``carry_lone_plans`` takes that one
plan out of the step's commands so the ``RequestParams`` can carry it
(``RequestParams.next_plan`` / ``extend``); the rank applies it first, as it would have
applied the frame before (``flodl.rank``).

Only a rank's *lone* plan is carried: a rank with any other command of the step (two
ranges, a plan telling the epoch role, anything else) keeps them all as they were, in
their order, so no rank sees its commands reordered. Skipping the carried command's id
leaves a gap in the ids a rank sees, which nothing reads as a loss (ids only grow).
"""

from __future__ import annotations

from typing import Optional

from flodl.wire import LEN, VARINT, pb, tag, varint

from ._commands import Command, Send, command_id_field
from ._dispatch import _plan_wire

__all__ = ["carry_lone_plans", "request_params", "request_params_wire", "NO_PLAN"]

# What a RequestParams carries: (kind, epoch, offset, size); kind "" = nothing.
Carried = tuple[str, int, int, int]
NO_PLAN: Carried = ("", 0, 0, 0)


def carry_lone_plans(planned: list[Command], ranks: tuple[int, ...]) -> tuple[list[Command], dict[int, Carried]]:
    """``planned`` less each rank's lone plan, and those plans by rank (of ``ranks``)."""
    count: dict[int, int] = {}
    for c in planned:
        if type(c) is Send:
            count[c.rank] = count.get(c.rank, 0) + 1
    members = set(ranks)
    carried: dict[int, Carried] = {}
    kept: list[Command] = []
    for c in planned:
        if type(c) is Send and count[c.rank] == 1 and c.rank in members:
            plan = _lone_plan(c)
            if plan is not None:
                carried[c.rank] = plan
                continue
        kept.append(c)
    return kept, carried


def _lone_plan(c: Send) -> Optional[Carried]:
    recipe = c.recipe
    if recipe is not None:  # a dispatch's StartEpoch (``_dispatch.send_plan``): (epoch, offset, size, role)
        kind, args = recipe
        if kind == "start_epoch" and args[3] is None:  # a plan telling the role goes as it is
            return ("next_plan", args[0], args[1], args[2])
        return None
    ctl = c.control
    which = ctl.WhichOneof("cmd")
    if which == "extend_partition":
        m = ctl.extend_partition
        return ("extend", m.epoch, m.partition_offset, m.partition_size)
    if which == "start_epoch" and not ctl.start_epoch.HasField("epoch_callback_role"):
        p = ctl.start_epoch.plan
        return ("next_plan", p.epoch, p.partition_offset, p.partition_size)
    return None


def request_params(ctl: pb.Control, cycle: int, kind: str, epoch: int, offset: int, size: int) -> None:
    """A ``RequestParams{cycle}``, carrying a window where ``kind`` names one."""
    rp = ctl.request_params
    rp.cycle = cycle
    if kind == "next_plan":
        p = rp.next_plan
        p.epoch, p.partition_offset, p.partition_size = epoch, offset, size
    elif kind == "extend":
        m = rp.extend
        m.epoch, m.partition_offset, m.partition_size = epoch, offset, size


_RP_FIELDS = pb.Control.RequestParams.DESCRIPTOR.fields_by_name
_CYCLE = tag(_RP_FIELDS["cycle"].number, VARINT)
_CARRIED_TAG = {k: tag(_RP_FIELDS[k].number, LEN) for k in ("next_plan", "extend")}
_RP_TAG = tag(pb.Control.DESCRIPTOR.fields_by_name["request_params"].number, LEN)


def request_params_wire(command_id: int, cycle: int, kind: str, epoch: int, offset: int, size: int) -> bytes:
    """``request_params``'s Control as protobuf serialises it, written without building it
    (a round sends one to every rank; tests/unit/core/test_carried_plans.py). ExtendPartition's
    fields are EpochPlan's (same numbers, same types), so one writer serves both."""
    parts = [_CYCLE, varint(cycle)] if cycle else []
    if kind:
        plan = _plan_wire(epoch, offset, size)
        parts += (_CARRIED_TAG[kind], varint(len(plan)), plan)
    body = b"".join(parts)
    return b"".join((command_id_field(command_id), _RP_TAG, varint(len(body)), body))
