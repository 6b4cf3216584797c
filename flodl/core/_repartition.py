"""Sync, a rank joined mid-epoch: the epoch's rest is re-partitioned to take it in (issue 12).

Theory of operation
-------------------
Sync partitions an epoch equally among the ranks alive when it is dispatched. A rank
that joins later (seeded, so ACTIVE: ``_membership.on_seeded``) is *owed* a share of the
live epoch (``owe``). Sync's rounds are barriers: when a round finishes, every
participant is throttled and has reported every batch it trained (its ack travels
behind them on the same link), so the coordinator knows what each rank still holds,
``assigned - reported`` samples. There (``plan``, from Sync's ``on_round_finished``,
before the ``Update`` that lifts the barrier) the rest R of the epoch is split as Sync
partitions, ``equal_sizes(alive, R)`` in rank order (``shares``): a member above its
share is sent ``TrimPartition{epoch, keep=share}``, and what it will give back is
allotted, in order, to the ranks below their share -- the joiners first, then members
that trained faster and hold less. A surplus under one batch stays where it is (moving
it costs more than it evens out). Nothing changes hands yet.

The rank answers ``PartitionTrimmed`` with the positions it gave back (``on_trimmed``):
they leave its assignment and go, in order, to the trim's allotment as
``ExtendPartition`` (a target no longer ACTIVE, or positions beyond the allotment: split
equally among the alive ranks, as a refused window's).
A position belongs to one live rank at a time, and the member, answering from its own
plan, gives back only positions it will never train -- throttled or not.

Faults (exactly once through each):

* a member dies with a trim outstanding: ``forget`` drops the trim; its assignment, the
  tail it was asked for included, goes to the survivors, the joiner among them, as any
  death's (``SyncDispatcher.reassign``);
* a joiner (or a member allotted positions) dies: its allotment goes to every alive rank;
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
from ._extend import extend
from ._phases import ACTIVE
from ._ranges import equal_sizes, split_ranges, subtract_ranges
from ._state import CoordinatorState

__all__ = ["owe", "plan", "shares", "check_trimmed", "on_trimmed", "forget", "settled", "on_resynced", "held",
           "summary"]  # fmt: skip


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


def shares(
    hold: dict[int, int], joiners: list[int], batch: int
) -> dict[int, tuple[int, tuple[tuple[int, int], ...]]]:
    """``member -> (keep, ((to, samples), ...))`` for each member to trim: the rest split
    ``equal_sizes`` over ``hold``'s ranks in order; surpluses under ``batch`` stay; the
    ranks below their share are filled joiners first, then in rank order."""
    ranks = list(hold)
    share = dict(zip(ranks, equal_sizes(len(ranks), sum(hold.values()))))
    surplus = [(r, hold[r] - share[r]) for r in ranks if r not in joiners and hold[r] - share[r] >= max(1, batch)]
    order = [r for r in ranks if r in joiners] + [r for r in ranks if r not in joiners]
    need = [[r, share[r] - hold[r]] for r in order if share[r] > hold[r]]
    out: dict[int, tuple[int, tuple[tuple[int, int], ...]]] = {}
    for r, extra in surplus:
        allot: list[tuple[int, int]] = []
        while extra > 0 and need:
            take = min(extra, need[0][1])
            allot.append((need[0][0], take))
            extra -= take
            need[0][1] -= take
            if need[0][1] == 0:
                need.pop(0)
        if allot:
            out[r] = (hold[r] - sum(n for _, n in allot), tuple(allot))
    return out


def plan(st: CoordinatorState, out: list[Command]) -> None:
    """At a finished round (the barrier): trim the members above their equal share of the
    epoch's rest for the owed joiners. Sent before the round's ``Update``, so a member
    handles it still throttled."""
    d = st.dispatch
    d.share_owed = [r for r in d.share_owed if st.ranks[r].phase is ACTIVE]
    if not d.share_owed or d.trims:
        return
    epoch = _live_epoch(st)
    joiners = list(d.share_owed)
    d.share_owed.clear()  # settled here: trimmed now, or nothing worth sharing is left
    if epoch is None:
        return
    hold = {r: held(st, r, epoch) for r in st.alive_ranks()}
    trims = shares(hold, joiners, st.config.batch_size)
    for r, (keep, allot) in trims.items():
        d.trims[r] = (st.next_command_id, epoch, tuple(joiners), allot)
        st.send(out, r, trim_partition=pb.Control.TrimPartition(epoch=epoch, keep=keep))
        _count(st, "sent")
    if trims:
        out.append(Notice("repartition", {"epoch": epoch, "joiners": joiners, "held": hold,
                                          "trims": {r: {"keep": k, "to": [list(x) for x in a]}
                                                    for r, (k, a) in trims.items()}}))  # fmt: skip


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
        committed = _coverage.uncommitted(st.coverage, ev.epoch, [(off, n)]) != [(off, n)]
        untrained = not committed and not _overlaps(trained, off, n)
        if _outside(mine, off, n) or not untrained:
            raise RankViolation(
                f"rank {ev.rank}: gave back [{off}, {off + n}) of epoch {ev.epoch}, which it does not hold untrained"
            )


def _outside(ranges: list[tuple[int, int]], off: int, n: int) -> bool:
    """Some position of ``[off, off + n)`` is in none of ``ranges``."""
    return bool(subtract_ranges([(off, n)], ranges))


def _overlaps(ranges: list[tuple[int, int]], off: int, n: int) -> bool:
    return any(o < off + n and off < o + size for o, size in ranges)


def on_trimmed(st: CoordinatorState, ev: PartitionTrimmed, out: list[Command]) -> None:
    """The member's answer: what it gave back goes to the trim's allotment. An answer to a
    trim no longer outstanding is honoured all the same (its positions need a trainer)."""
    d = st.dispatch
    rec = d.trims.get(ev.rank)
    allot: tuple[tuple[int, int], ...] = ()
    if rec is not None and rec[0] == ev.command_id:
        del d.trims[ev.rank]
        allot = rec[3]
        _count(st, "answered")
    else:
        st.count_ignored("PartitionTrimmed for a trim not outstanding")
    _hand_out(st, ev.rank, ev.epoch, [(int(o), int(n)) for o, n in ev.released if n > 0], allot, out)


def _take(queue: list[tuple[int, int]], n: int) -> list[tuple[int, int]]:
    """The first ``n`` positions of ``queue`` (consumed), as ranges."""
    got: list[tuple[int, int]] = []
    while n > 0 and queue:
        off, size = queue[0]
        take = min(n, size)
        got.append((off, take))
        n -= take
        queue[0] = (off + take, size - take)
        if queue[0][1] == 0:
            queue.pop(0)
    return got


def _hand_out(
    st: CoordinatorState, rank: int, epoch: int, ranges: list[tuple[int, int]],
    allot: tuple[tuple[int, int], ...], out: list[Command],
) -> None:  # fmt: skip
    if not ranges:
        return
    d = st.dispatch
    per_rank = d.assigned.setdefault(epoch, {})
    per_rank[rank] = subtract_ranges(per_rank.get(rank, []), ranges)
    queue, orphans = list(ranges), []
    parts: dict[int, list[tuple[int, int]]] = {}
    for to, n in allot:
        got = _take(queue, n)
        if st.ranks[to].phase is ACTIVE:
            parts.setdefault(to, []).extend(got)
        else:
            orphans.extend(got)
    orphans.extend(queue)  # beyond the allotment (none is planned): anyone alive
    if orphans:
        alive = st.alive_ranks()
        for r, mine in zip(alive, split_ranges(orphans, len(alive))):
            parts.setdefault(r, []).extend(mine)
    for r, mine in parts.items():
        extend(st, out, epoch, r, mine)
    moved = sum(n for _, n in ranges)
    _count(st, "samples", moved)
    shared = {r: sum(n for _, n in v) for r, v in parts.items() if v}
    out.append(Notice("partition_shared", {"rank": rank, "epoch": epoch, "samples": moved, "to": shared}))


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
    cid, epoch, joiners, allot = rec
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
    _hand_out(st, ev.rank, epoch, gave, allot, out)
    return [x for x in lost if x[0] != epoch]
