"""Dispatch: who trains which positions of each epoch (Sync: equal partitions).

Theory of operation
-------------------
An epoch is the permutation ``flodl.shuffle.epoch_permutation(seed, epoch, total)``;
the coordinator never shuffles, it hands out *position ranges* (§8.1-8.3).

* Geometry: ``epoch_samples`` slices a pass into ``splits`` epochs (the remainder goes
  one extra pick to the first slices); we run with one slice per pass.
* Sync partitions: ``equal_sizes`` -- ``total // n`` each, the first ``total % n``
  ranks one more -- laid out contiguously in rank order. Partitions are computed over
  the ranks alive when the epoch is first dispatched (a rank lost in an earlier epoch
  gets no share, so nothing is skipped) and cached per epoch: dispatching the same
  epoch again reuses the same plans. A rank whose share is 0 gets no ``StartEpoch``.
* The *assignment* of a rank in an epoch is its plan followed by any extensions, in
  the order sent. A ``BatchDone`` must lie inside the rank's assignment of its current
  epoch (``check_batch``), else it is a ``RankViolation`` and changes nothing.
* ``idle(rank)``: the rank has reported every sample it was assigned. Sync's gate
  treats an idle rank as ready (it cannot step any more), so the tail of an epoch is
  still averaged -- and committed -- when partitions differ by one batch.
* Death (``reassign``): the positions of the lost rank's assignment that are not
  committed (never trained, or trained in a window that was never folded) are split
  equally among the survivors in rank order, as ``ExtendPartition{epoch, offset,
  size}`` -- one command per contiguous range slice. The lost rank's assignment is
  emptied, so a position always belongs to at most one live rank.
* Join (Sync, mid-epoch): the joiner is owed a share of the live epoch; at the next
  finished round its untrained rest is split in equal shares over the alive ranks, the
  members above theirs trimmed (``TrimPartition``) and what they answer they gave back
  handed out (``ExtendPartition``) -- ``_repartition``. The range arithmetic of all of
  this is ``_ranges``.
* Roles: the epoch-callback role is ``st.roles.epoch_role`` (elected by ``_roles``);
  the ranks are told it at a dispatch whenever it is dirty (changed since last
  announced: once, unless its holder dies or calibration elects another) -- inside each
  ``StartEpoch`` (``epoch_callback_role``), and by ``SetEpochCallbackRole`` to a rank
  that got no plan: a dispatch is one command per rank, not two.

The ``Dispatcher`` protocol is the seam a policy engine replaces: it owns
``dispatch_epoch``, ``reassign`` and ``idle``, plus the hooks the step calls on every
batch (``on_batch``), when a round opens (``on_trigger``, just before the
``RequestParams``: Cadence hands idle ranks their next window there, so the round
overlaps training) and around a finished round (``on_round_finished`` returns the
chunk each rank gets inside its ``Update``; ``after_round`` wakes idle ranks), and
when an epoch is aggregated (``on_epoch_aggregated``: Cadence makes room in the windows
its callbacks land in).
``progressive`` says whether chunks stream (no ``Throttle`` barrier at a trigger).
Sync's hooks do nothing; the Cadence engine (``cadence._dispatcher``) registers itself in
``_policy.POLICIES`` and keeps its own state in ``state.cadence``.
"""

from __future__ import annotations

from itertools import accumulate, repeat
from operator import itemgetter
from typing import Container, Optional, Protocol

from flodl.wire import LEN, VARINT, pb, tag, varint

from . import _coverage, _repartition
from ._commands import Command, command_id_field
from ._errors import LocalViolation, RankViolation
from ._events import BatchDone
from ._extend import extend
from ._ranges import equal_sizes, split_ranges, subtract_ranges
from ._state import CoordinatorState

__all__ = [
    "Dispatcher",
    "SyncDispatcher",
    "epoch_samples",
    "equal_sizes",
    "contiguous_plans",
    "split_ranges",
    "subtract_ranges",
    "lost_by_epoch",
    "announce_role",
    "role_to_tell",
    "send_plan",
    "send_plans",
    "check_batch",
    "record_batch",
]


def epoch_samples(total: int, splits: int, epoch: int) -> int:
    """Size of the ``epoch``-th of ``splits`` contiguous slices of ``total`` (§8.1)."""
    splits = max(1, splits)
    i = epoch % splits
    return total // splits + (1 if i < total % splits else 0)


def contiguous_plans(ranks: list[int], sizes: list[int]) -> dict[int, tuple[int, int]]:
    """``rank -> (offset, size)`` with offsets cumulative in rank order."""
    return dict(zip(ranks, zip(accumulate(sizes, initial=0), sizes)))  # (in C: a plan per rank)


def lost_by_epoch(lost: list[tuple[int, int, int]]) -> dict[int, list[tuple[int, int]]]:
    """``(epoch, offset, samples)`` batches as sorted, coalesced ranges per epoch."""
    per: dict[int, list[tuple[int, int]]] = {}
    for epoch, off, n in sorted(lost):
        if n <= 0:
            continue
        ranges = per.setdefault(epoch, [])
        if ranges and ranges[-1][0] + ranges[-1][1] == off:
            ranges[-1] = (ranges[-1][0], ranges[-1][1] + n)
        else:
            ranges.append((off, n))
    return per


def role_to_tell(st: CoordinatorState) -> Optional[int]:
    """The epoch role when the ranks must be told it (it changed since last told), else
    None: a dispatch carries it in each ``StartEpoch`` (``send_plan``), then
    ``announce_role`` tells the ranks that got no plan."""
    role = st.roles.epoch_role
    if role is not None and (st.roles.dirty or role != st.dispatch.announced_role):
        return role
    return None


def send_plan(st: CoordinatorState, out: list[Command], rank: int, epoch: int, offset: int, size: int,
              role: Optional[int] = None) -> None:  # fmt: skip
    """``StartEpoch{plan, epoch_callback_role}`` to ``rank``, built when the shell sends
    it (a dispatch sends one per rank: ``CoordinatorState.send_built``)."""
    st.send_built(out, rank, "start_epoch", _start_epoch, (epoch, offset, size, role))


def send_plans(st: CoordinatorState, out: list[Command], epoch: int, plans: dict[int, tuple[int, int]],
               role: Optional[int] = None) -> None:  # fmt: skip
    """``send_plan`` to each rank of ``plans`` (``rank -> (offset, size)``), in its order."""
    st.send_built_zip(out, list(plans), "start_epoch", _start_epoch,
                      [(epoch, off, size, role) for off, size in plans.values()], wire=_start_epoch_wire)  # fmt: skip


def _one(plan: tuple[int, int]) -> list[tuple[int, int]]:
    return [plan]


def _start_epoch(ctl: pb.Control, epoch: int, offset: int, size: int, role: Optional[int]) -> None:
    start = ctl.start_epoch
    plan = start.plan
    plan.epoch, plan.partition_offset, plan.partition_size = epoch, offset, size
    if role is not None:
        start.epoch_callback_role = role


_PLAN_FIELDS = pb.EpochPlan.DESCRIPTOR.fields_by_name
_EPOCH, _OFFSET, _SIZE = (tag(_PLAN_FIELDS[n].number, VARINT) for n in ("epoch", "partition_offset", "partition_size"))
_START_FIELDS = pb.Control.StartEpoch.DESCRIPTOR.fields_by_name
_START_PLAN, _START_ROLE = tag(_START_FIELDS["plan"].number, LEN), tag(_START_FIELDS["epoch_callback_role"].number, VARINT)
_START_TAG = tag(pb.Control.DESCRIPTOR.fields_by_name["start_epoch"].number, LEN)


def _plan_wire(epoch: int, offset: int, size: int) -> bytes:
    """An ``EpochPlan``'s bytes as protobuf writes them (proto3: zeros left out)."""
    parts: list[bytes] = []
    if epoch:
        parts += (_EPOCH, varint(epoch))
    if offset:
        parts += (_OFFSET, varint(offset))
    if size:
        parts += (_SIZE, varint(size))
    return b"".join(parts)


def _start_epoch_wire(command_id: int, epoch: int, offset: int, size: int, role: Optional[int]) -> bytes:
    """``_start_epoch``'s Control as protobuf serialises it, written without building it
    (a dispatch sends one to every rank; tests/unit/core/test_send_wire.py): the plan is
    always present (its fields are set, even to 0), the role when given."""
    plan = _plan_wire(epoch, offset, size)
    body = b"".join((_START_PLAN, varint(len(plan)), plan, b"" if role is None else _START_ROLE + varint(role)))
    return b"".join((command_id_field(command_id), _START_TAG, varint(len(body)), body))


def _set_role(ctl: pb.Control, role: int) -> None:
    ctl.set_epoch_callback_role.rank = role


def announce_role(st: CoordinatorState, out: list[Command], told: Container[int] = ()) -> None:
    """``SetEpochCallbackRole`` to every alive rank not in ``told`` (those a ``StartEpoch``
    carrying the role reached) when the epoch role is dirty (changed since last told)."""
    role = role_to_tell(st)
    if role is None:
        return
    args = (role,)
    for r in st.index.alive():
        if r not in told:
            st.send_built(out, r, "set_epoch_callback_role", _set_role, args)
    st.dispatch.announced_role = role
    st.roles.dirty = False


def check_batch(st: CoordinatorState, ev: BatchDone) -> None:
    """Raise ``RankViolation`` unless the batch lies in the rank's current assignment."""
    if ev.samples < 0 or ev.offset < 0:
        raise RankViolation(f"rank {ev.rank}: batch with negative offset or samples")
    cur = st.dispatch.rank_epoch.get(ev.rank)
    if cur is None or ev.epoch != cur:
        raise RankViolation(f"rank {ev.rank}: batch of epoch {ev.epoch}, but its current epoch is {cur}")
    ec = st.coverage.epochs.get(cur)
    if ec is None or ec.frozen:
        raise RankViolation(f"rank {ev.rank}: batch of epoch {ev.epoch}, which is already aggregated")
    if ev.samples == 0:
        return
    end = ev.offset + ev.samples
    for off, size in st.dispatch.assigned.get(cur, {}).get(ev.rank, ()):
        if off <= ev.offset and end <= off + size:
            return
    raise RankViolation(
        f"rank {ev.rank}: batch [{ev.offset}, {end}) of epoch {ev.epoch} is outside its assignment"
    )


def record_batch(st: CoordinatorState, ev: BatchDone) -> None:
    per_rank = st.dispatch.reported.setdefault(ev.epoch, {})
    per_rank[ev.rank] = per_rank.get(ev.rank, 0) + ev.samples


class Dispatcher(Protocol):
    """What the step needs from a dispatcher (Sync here; Cadence in ``cadence._dispatcher``)."""

    progressive: bool

    def setup(self, st: CoordinatorState) -> None: ...

    def dispatch_epoch(self, st: CoordinatorState, epoch: int, out: list[Command]) -> None: ...

    def reassign(self, st: CoordinatorState, rank: int, out: list[Command]) -> None: ...

    def idle(self, st: CoordinatorState, rank: int) -> bool: ...

    def give_back(
        self, st: CoordinatorState, rank: int, lost: list[tuple[int, int, int]], out: list[Command]
    ) -> None: ...

    def on_batch(self, st: CoordinatorState, ev: BatchDone, out: list[Command], more: bool = False) -> None:
        """One batch folded into the ledgers. ``more``: later batches of the same rank's
        frame follow in this step, so a decision the last one makes with fresher state
        (a top-up: fewer batches left then) may wait for it -- not one the frame's order
        needs (a chunk that ran dry mid-frame is still served there)."""
        ...

    def on_trigger(self, st: CoordinatorState, ranks: list[int], out: list[Command]) -> None: ...

    def on_round_finished(
        self, st: CoordinatorState, ranks: list[int], out: list[Command]
    ) -> dict[int, pb.EpochPlan]: ...

    def after_round(self, st: CoordinatorState, out: list[Command]) -> None: ...

    def on_epoch_aggregated(self, st: CoordinatorState, epoch: int, out: list[Command]) -> None: ...

    def on_join(self, st: CoordinatorState, rank: int, out: list[Command]) -> None: ...

    def window_end_step(self, st: CoordinatorState, rank: int) -> int: ...

    def window_end_steps(self, st: CoordinatorState, ranks: list[int]) -> list[int]:
        """``window_end_step`` of each of ``ranks`` (a round's ``Update`` to every rank)."""
        ...


class SyncDispatcher:
    """Equal contiguous partitions per epoch; a lost rank's remainder is split equally."""

    progressive = False

    def setup(self, st: CoordinatorState) -> None:
        pass

    def on_batch(self, st: CoordinatorState, ev: BatchDone, out: list[Command], more: bool = False) -> None:
        pass

    def window_end_step(self, st: CoordinatorState, rank: int) -> int:
        return 0  # the barrier follows the partition's end, which a rank reports at once

    def window_end_steps(self, st: CoordinatorState, ranks: list[int]) -> list[int]:
        return [0] * len(ranks)

    def on_trigger(self, st: CoordinatorState, ranks: list[int], out: list[Command]) -> None:
        pass  # Sync: the rank keeps its partition; the Throttle barrier follows

    def on_round_finished(
        self, st: CoordinatorState, ranks: list[int], out: list[Command]
    ) -> dict[int, pb.EpochPlan]:
        """The barrier: a joiner owed a share of the live epoch gets one (``_repartition``:
        the members above their equal share are trimmed before their ``Update``). The
        next plan is otherwise the rest of the partition each rank already has."""
        _repartition.plan(st, out)
        return {}

    def after_round(self, st: CoordinatorState, out: list[Command]) -> None:
        pass

    def on_epoch_aggregated(self, st: CoordinatorState, epoch: int, out: list[Command]) -> None:
        pass  # Sync has no windows to make room in

    def on_join(self, st: CoordinatorState, rank: int, out: list[Command]) -> None:
        """A joiner in the middle of an epoch is owed a share of its rest: it gets one at
        the next finished round (``on_round_finished``); until then it is idle, and idle
        counts as ready at the gate. From the next epoch on, the partition counts it."""
        _repartition.owe(st, rank)

    def plans_for_epoch(self, st: CoordinatorState, epoch: int) -> dict[int, tuple[int, int]]:
        cached = st.dispatch.plans.get(epoch)
        if cached is not None:
            return cached
        total = epoch_samples(st.total_samples, 1, epoch)
        if total <= 0:
            raise LocalViolation("dispatch_epoch requires total_samples > 0")
        alive = st.alive_ranks()
        plans = contiguous_plans(alive, equal_sizes(len(alive), total))
        st.dispatch.plans[epoch] = plans
        return plans

    def dispatch_epoch(self, st: CoordinatorState, epoch: int, out: list[Command]) -> None:
        if epoch in st.checkpoints.resume_holes:
            self._dispatch_resumed(st, epoch, out)
            return
        plans = self.plans_for_epoch(st, epoch)
        d = st.dispatch
        _repartition.settled(st)
        role = role_to_tell(st)
        _coverage.open_epoch(st.coverage, epoch, sum(map(itemgetter(1), plans.values())))
        assigned = d.assigned.setdefault(epoch, {})
        # One comprehension per book, not a loop of four writes per rank (a dispatch of
        # thousands): the same entries in the same order.
        ranks = [r for r in st.index.alive() if r in plans and plans[r][1] != 0]
        mine = [plans[r] for r in ranks]
        args = [(epoch, off, size, role) for off, size in mine]
        assigned.update(zip(ranks, map(_one, mine)))
        d.rank_epoch.update(zip(ranks, repeat(epoch)))
        st.send_built_zip(out, ranks, "start_epoch", _start_epoch, args)  # one StartEpoch each (``send_plan``)
        announce_role(st, out, told=set(ranks))  # a rank whose share is 0 got no plan
        d.reported.setdefault(epoch, {})
        d.last_dispatched = epoch
        d.dispatched_at.setdefault(epoch, st.now)

    def _dispatch_resumed(self, st: CoordinatorState, epoch: int, out: list[Command]) -> None:
        """An epoch the resumed checkpoint has samples of: only its uncovered ranges
        (``checkpoints.resume_holes``; none when the weights hold all of it),
        split equally; a rank's first range is its ``StartEpoch`` plan, the rest
        ``ExtendPartition``s. The coverage was opened, covered positions committed."""
        d = st.dispatch
        role, planned = role_to_tell(st), set()
        assigned = d.assigned.setdefault(epoch, {})
        alive = st.alive_ranks()
        for r, ranges in zip(alive, split_ranges(list(st.checkpoints.resume_holes[epoch]), len(alive))):
            if not ranges:
                continue
            planned.add(r)
            (off, size), rest = ranges[0], ranges[1:]
            send_plan(st, out, r, epoch, off, size, role)
            for o, s in rest:
                ext = pb.Control.ExtendPartition(epoch=epoch, partition_offset=o, partition_size=s)
                st.send(out, r, extend_partition=ext)
            assigned[r] = list(ranges)
            d.rank_epoch[r] = epoch
        announce_role(st, out, told=planned)
        d.reported.setdefault(epoch, {})
        d.last_dispatched = epoch
        d.dispatched_at.setdefault(epoch, st.now)

    def reassign(self, st: CoordinatorState, rank: int, out: list[Command]) -> None:
        d = st.dispatch
        _repartition.forget(st, rank)  # a trim it owed an answer to: its whole rest goes below
        epoch = d.rank_epoch.get(rank)
        if epoch is None or st.coverage.epochs[epoch].frozen:
            return
        mine = d.assigned.get(epoch, {}).get(rank, [])
        remainder = _coverage.uncommitted(st.coverage, epoch, mine)
        d.assigned[epoch][rank] = []
        survivors = st.alive_ranks()
        if not remainder or not survivors:
            return
        for r, ranges in zip(survivors, split_ranges(remainder, len(survivors))):
            extend(st, out, epoch, r, ranges)

    def give_back(
        self, st: CoordinatorState, rank: int, lost: list[tuple[int, int, int]], out: list[Command]
    ) -> None:
        """A live rank's refused window: its ``(epoch, offset, samples)`` batches leave its
        assignment and are split equally among the alive ranks (it included), as
        ``ExtendPartition`` -- the same path as a death's remainder."""
        d = st.dispatch
        for epoch, ranges in lost_by_epoch(lost).items():
            ec = st.coverage.epochs.get(epoch)
            if ec is None or ec.frozen:
                continue
            per_rank = d.assigned.setdefault(epoch, {})
            per_rank[rank] = subtract_ranges(per_rank.get(rank, []), ranges)
            reported = d.reported.setdefault(epoch, {})
            reported[rank] = max(0, reported.get(rank, 0) - sum(n for _, n in ranges))
            alive = st.alive_ranks()
            for r, mine in zip(alive, split_ranges(ranges, len(alive))):
                extend(st, out, epoch, r, mine)

    def idle(self, st: CoordinatorState, rank: int) -> bool:
        d = st.dispatch
        epoch = d.rank_epoch.get(rank)
        if epoch is None:
            return True
        owed = sum(size for _, size in d.assigned.get(epoch, {}).get(rank, ()))
        return d.reported.get(epoch, {}).get(rank, 0) >= owed


SYNC = SyncDispatcher()
