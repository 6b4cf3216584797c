"""Which relay folds which ranks in the open round: the coordinator's half of folding.

Theory of operation
-------------------
A rank behind a relay has the route ``(relay_id, rank_id)``; the relay itself is the
route ``(relay_id,)`` (its backend DEALER). When a round opens, ``open`` groups the
round's ranks by relay and returns one ``RelayMsg.FoldOpen{cycle, ranks, identities}``
per relay that carries at least ``MIN_FOLD`` of them (folding one rank saves nothing).
The service sends these *before* the ranks' ``RequestParams`` (the core emits
``OpenRound`` first): both ride the same coordinator -> relay pipe, which is FIFO, so a
relay always knows a fold before any rank of it can answer with its round.

``drop`` gives the ``FoldDrop`` for a rank that died while its fold is open, so the
relay stops waiting for it. The rank stays in the plan: if its relay's fold had already
left, the frame still names it, and the reducer must recognise the race (drop the whole
frame) rather than call the frame foreign. ``relay_of`` is what the reducer checks a
folded frame against: a relay may only speak for the ranks it was asked to fold.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

from flodl.wire import pb

__all__ = ["FoldPlan", "MIN_FOLD"]

MIN_FOLD = 2

Route = tuple


class FoldPlan:
    def __init__(self) -> None:
        self.cycle: Optional[int] = None
        self._relay: dict[int, Route] = {}  # rank -> relay route (one hop)

    def open(
        self, cycle: int, ranks: Sequence[int], route_of: Callable[[int], Optional[Sequence[bytes]]]
    ) -> list[tuple[Route, pb.RelayMsg]]:
        """The FoldOpen to send to each relay that folds ranks of round ``cycle``."""
        groups: dict[Route, list[tuple[int, bytes]]] = {}
        for r in sorted(ranks):
            route = route_of(r)
            if route is not None and len(route) == 2:
                groups.setdefault((bytes(route[0]),), []).append((r, bytes(route[1])))
        self.cycle = cycle
        self._relay = {}
        out = []
        for relay, members in groups.items():
            if len(members) < MIN_FOLD:
                continue
            for r, _ in members:
                self._relay[r] = relay
            msg = pb.RelayMsg()
            msg.fold_open.cycle = cycle
            msg.fold_open.ranks.extend(r for r, _ in members)
            msg.fold_open.identities.extend(i for _, i in members)
            out.append((relay, msg))
        return out

    def relay_of(self, cycle: int, rank: int) -> Optional[Route]:
        return self._relay.get(rank) if cycle == self.cycle else None

    def drop(self, cycle: Optional[int], rank: int) -> Optional[tuple[Route, pb.RelayMsg]]:
        """The FoldDrop for ``rank`` if it is folded in the open round ``cycle``."""
        relay = self.relay_of(cycle, rank) if cycle is not None else None
        if relay is None:
            return None
        msg = pb.RelayMsg()
        msg.fold_drop.cycle = cycle
        msg.fold_drop.rank = rank
        return relay, msg
