"""Sync, a rank joined mid-epoch: the epoch's rest is re-partitioned to take it in (issue 12).

Theory of operation
-------------------
Sync partitions an epoch equally among the ranks alive when it is dispatched. A rank
that joins later (seeded, so ACTIVE: ``_membership.on_seeded``) is *owed* a share of the
live epoch (``owe``). Sync's rounds are barriers: when a round finishes, every
participant is throttled and has reported every batch it trained (its ack travels
behind them on the same link), so the coordinator knows what each member still holds,
``assigned - reported`` samples. There (``plan``, from Sync's ``on_round_finished``,
before the ``Update`` that lifts the barrier) the held samples are levelled: ``level``
is the smallest L with ``sum(max(0, h - L) for members) <= sum(max(0, L - h) for
joiners)``, so nobody holds more than L afterwards and no position moves between two
members (equal shares when the members hold equal rests, as Sync partitions). Each
member above L is sent ``TrimPartition{epoch, keep=L}``; nothing changes hands yet.

The rank answers ``PartitionTrimmed`` with the positions it gave back (``on_trimmed``):
they leave its assignment and go, split equally, to the trim's joiners that are still
ACTIVE (to every alive rank when none is, as a refused window's) as ``ExtendPartition``.
A position belongs to one live rank at a time, and the member, answering from its own
plan, gives back only positions it will never train -- throttled or not.

Faults (exactly once through each):

* a member dies with a trim outstanding: ``forget`` drops the trim; its assignment, the
  tail it was asked for included, goes to the survivors, the joiner among them, as any
  death's (``SyncDispatcher.reassign``);
* a joiner dies: it is owed nothing more; an answer meant for it goes to the trim's
  other joiners, or to every alive rank;
* the coordinator restarts: debts and trims are state, the replayed journal has them;
  the answer may have died with the old process. The member's resync report settles
  it (``on_resynced``): it handled the trim (``command_id <= last_command_id``): what
  it neither trained nor holds of that epoch (``_resync.lost_positions``) is what it
  gave back, handed out as the answer's would have been; it never heard the trim and
  never will (sent by the dead incarnation): the trim is void and its joiners are owed
  again (the next barrier plans anew); sent by this incarnation: still on its way.

Only one re-partition is in flight at a time: joiners who come meanwhile wait for the
next barrier. A new epoch's partition counts every ACTIVE rank, so dispatching it
settles every debt (``settled``).
"""

from __future__ import annotations

from flodl.wire import pb

from . import _coverage
from ._commands import Command, Notice
from ._errors import RankViolation
from ._events import PartitionTrimmed, RankResynced
from ._phases import ACTIVE
from ._ranges import split_ranges, subtract_ranges
from ._state import CoordinatorState

__all__ = ["owe", "plan", "level", "check_trimmed", "on_trimmed", "forget", "settled", "on_resynced", "held", "summary"]


def _count(st: CoordinatorState, what: str, n: int = 1) -> None:
    c = st.dispatch.trim_counts
    c[what] = c.get(what, 0) + n


def summary(st: CoordinatorState) -> dict[str, int]:
    """The run summary's ``elastic.repartition``: trims sent, how each ended, samples moved."""
    c = st.dispatch.trim_counts
    keys = ("sent", "answered", "settled_by_resync", "void", "dropped", "samples")
    return {k: c.get(k, 0) for k in keys}


def _live_epoch(st: CoordinatorState) -> int | None:
    epoch = st.dispatch.last_dispatched
    ec = st.coverage.epochs.get(epoch) if epoch is not None else None
    return None if ec is None or ec.frozen else epoch


def held(st: CoordinatorState, rank: int, epoch: int) -> int:
    """Samples of ``epoch`` assigned to ``rank`` and not reported trained."""
    d = st.dispatch
    if d.rank_epoch.get(rank) != epoch:
        return 0
    owed = sum(size for _, size in d.assigned.get(epoch, {}).get(rank, ()))
    return max(0, owed - d.reported.get(epoch, {}).get(rank, 0))


def owe(st: CoordinatorState, rank: int) -> None:
    """A joiner became a member while an epoch is live: it is owed a share of it."""
    if _live_epoch(st) is not None and rank not in st.dispatch.share_owed:
        st.dispatch.share_owed.append(rank)


def settled(st: CoordinatorState) -> None:
    """A new epoch was partitioned over every ACTIVE rank: nobody is owed a share."""
    st.dispatch.share_owed.clear()


def level(members: list[int], joiners: list[int]) -> int:
    """The smallest L whose surplus above it (members) fits the room below it (joiners)."""
    lo, hi = 0, max(members + joiners + [0])
    while lo < hi:
        mid = (lo + hi) // 2
        surplus = sum(max(0, h - mid) for h in members)
        room = sum(max(0, mid - h) for h in joiners)
        if surplus <= room:
            hi = mid
        else:
            lo = mid + 1
    return lo


def plan(st: CoordinatorState, out: list[Command]) -> None:
    """At a finished round (the barrier): trim the members above the level for the owed
    joiners. Sent before the round's ``Update``, so a member handles it still throttled."""
    d = st.dispatch
    d.share_owed = [r for r in d.share_owed if st.ranks[r].phase is ACTIVE]
    if not d.share_owed or d.trims:
        return
    epoch = _live_epoch(st)
    if epoch is None:
        d.share_owed.clear()
        return
    joiners = list(d.share_owed)
    members = [r for r in st.alive_ranks() if r not in joiners]
    hold = {r: held(st, r, epoch) for r in members}
    keep = level(list(hold.values()), [held(st, j, epoch) for j in joiners])
    trimmed = [r for r in members if hold[r] > keep]
    if not trimmed:
        d.share_owed.clear()  # nothing left to share: the next epoch's partition counts them
        return
    for r in trimmed:
        d.trims[r] = (st.next_command_id, epoch, tuple(joiners))
        st.send(out, r, trim_partition=pb.Control.TrimPartition(epoch=epoch, keep=keep))
        _count(st, "sent")
    d.share_owed.clear()
    out.append(Notice("repartition", {"epoch": epoch, "joiners": joiners, "keep": keep, "trimmed": trimmed,
                                      "asked_samples": sum(hold[r] - keep for r in trimmed)}))  # fmt: skip


def check_trimmed(st: CoordinatorState, ev: PartitionTrimmed) -> None:
    """Raise ``RankViolation`` unless every released position is the rank's, uncommitted
    and not reported trained (the answer then changes nothing)."""
    ec = st.coverage.epochs.get(ev.epoch)
    released = [(int(o), int(n)) for o, n in ev.released if n > 0]
    if not released:
        return
    if ec is None or ec.frozen:
        raise RankViolation(f"rank {ev.rank}: gave back positions of epoch {ev.epoch}, which is not live")
    mine = st.dispatch.assigned.get(ev.epoch, {}).get(ev.rank, [])
    trained = [(off, n) for e, off, n, _s in st.coverage.pending.get(ev.rank, ()) if e == ev.epoch]
    for off, n in released:
        untrained = _coverage.uncommitted(st.coverage, ev.epoch, [(off, n)]) == [(off, n)] and not _overlaps(trained, off, n)
        if _outside(mine, off, n) or not untrained:
            raise RankViolation(
                f"rank {ev.rank}: gave back [{off}, {off + n}) of epoch {ev.epoch}, which it does not hold untrained"
            )


def _outside(ranges: list[tuple[int, int]], off: int, n: int) -> bool:
    return not any(o <= off and off + n <= o + size for o, size in ranges)


def _overlaps(ranges: list[tuple[int, int]], off: int, n: int) -> bool:
    return any(o < off + n and off < o + size for o, size in ranges)


def on_trimmed(st: CoordinatorState, ev: PartitionTrimmed, out: list[Command]) -> None:
    """The member's answer: what it gave back goes to the trim's joiners. An answer to a
    trim no longer outstanding is honoured all the same (its positions need a trainer)."""
    d = st.dispatch
    rec = d.trims.get(ev.rank)
    joiners: tuple[int, ...] = ()
    if rec is not None and rec[0] == ev.command_id:
        del d.trims[ev.rank]
        joiners = rec[2]
        _count(st, "answered")
    else:
        st.count_ignored("PartitionTrimmed for a trim not outstanding")
    _hand_out(st, ev.rank, ev.epoch, [(int(o), int(n)) for o, n in ev.released if n > 0], joiners, out)


def _hand_out(
    st: CoordinatorState, rank: int, epoch: int, ranges: list[tuple[int, int]], joiners: tuple[int, ...],
    out: list[Command],
) -> None:
    if not ranges:
        return
    d = st.dispatch
    per_rank = d.assigned.setdefault(epoch, {})
    per_rank[rank] = subtract_ranges(per_rank.get(rank, []), ranges)
    to = [j for j in joiners if st.ranks[j].phase is ACTIVE] or st.alive_ranks()
    for r, mine in zip(to, split_ranges(ranges, len(to))):
        for off, size in mine:
            ext = pb.Control.ExtendPartition(epoch=epoch, partition_offset=off, partition_size=size)
            st.send(out, r, extend_partition=ext)
            per_rank.setdefault(r, []).append((off, size))
            d.extensions += 1
        if mine:
            d.rank_epoch[r] = epoch
    moved = sum(n for _, n in ranges)
    _count(st, "samples", moved)
    out.append(Notice("partition_shared", {"rank": rank, "epoch": epoch, "samples": moved, "to": to}))


def forget(st: CoordinatorState, rank: int) -> None:
    """A rank left the run: no trim of it is outstanding, nothing is owed to it."""
    d = st.dispatch
    if d.trims.pop(rank, None) is not None:
        _count(st, "dropped")
    if rank in d.share_owed:
        d.share_owed.remove(rank)


def on_resynced(
    st: CoordinatorState, ev: RankResynced, lost: list[tuple[int, int, int]], out: list[Command]
) -> list[tuple[int, int, int]]:
    """After a restart, settle the rank's outstanding trim from its report (module doc);
    returns the lost positions still to be resent to the rank itself."""
    d = st.dispatch
    rec = d.trims.get(ev.rank)
    if rec is None:
        return lost
    cid, epoch, joiners = rec
    if cid > ev.last_command_id:
        end = st.resync.journal_end
        if end is not None and cid <= end:  # the dead incarnation's: it never arrives
            del d.trims[ev.rank]
            _count(st, "void")
            d.share_owed.extend(j for j in joiners if st.ranks[j].phase is ACTIVE and j not in d.share_owed)
            out.append(Notice("trim_void", {"rank": ev.rank, "command_id": cid, "epoch": epoch}))
        return lost
    del d.trims[ev.rank]
    _count(st, "settled_by_resync")
    gave = [(off, n) for e, off, n in lost if e == epoch]
    _hand_out(st, ev.rank, epoch, gave, joiners, out)
    return [x for x in lost if x[0] != epoch]
