"""Handing a rank more of an epoch: one ``ExtendPartition`` per range, recorded where
dispatch keeps what each rank holds (``assigned``), the rank's current epoch and the
extension count. A death's remainder (``reassign``), a lost plan's ranges (``give_back``)
and a joiner's share of the live epoch (``_repartition``) all go out this way."""

from __future__ import annotations

from flodl.wire import pb

from ._commands import Command
from ._state import CoordinatorState


def extend(st: CoordinatorState, out: list[Command], epoch: int, rank: int, ranges: list[tuple[int, int]]) -> None:
    d = st.dispatch
    held = d.assigned.setdefault(epoch, {}).setdefault(rank, [])
    for off, size in ranges:
        ext = pb.Control.ExtendPartition(epoch=epoch, partition_offset=off, partition_size=size)
        st.send(out, rank, extend_partition=ext)
        held.append((off, size))
        d.extensions += 1
    if ranges:
        d.rank_epoch[rank] = epoch
