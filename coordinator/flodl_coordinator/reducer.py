"""The bus reducer: weighted parameter averaging for one open round at a time.

Theory of operation
-------------------
The core decides *when* a round opens and *who* must contribute (``OpenRound``); this
object only does the arithmetic and says when it is done. Each contribution arrives
already multiplied by its mass ``w_r`` (the rank's realized work, ``n**gamma``) with
``w_r`` in the header. We sum tensors in f32 and masses in f64, and divide exactly
once, by the mass of exactly the frames we accepted: work that never arrived is in
neither the sum nor the divisor. A rank that dies mid-round is dropped from the
expected set, so the round completes with the survivors' contributions — and a
contribution it had already sent is dropped too: it will never acknowledge the
consensus, so its samples are not committed and go back to the pool; keeping its
tensors in the sum would train those samples twice.

Folded contributions. A relay may fold its host's ranks (``flodl_worker.fold``): one
frame whose tensors are the sum of theirs, whose weight is the sum of their weights and
whose ``contributing_ranks`` names them. Which relay folds whom in the open round is the
``FoldPlan`` (``folding``); a folded frame is accepted when its relay folds every rank
it names, each of them is expected, and none is counted yet — it then credits every one
of them. The sum cannot be un-mixed, so when one of its ranks dies before the round is
done (or had died before the frame arrived: the race a ``FoldDrop`` could not win) the
whole frame leaves the round, mass and tensors, and its other ranks are *excluded*:
no longer waited for, not in the consensus's ``contributing_ranks``, but still sent the
consensus, so that they acknowledge the round and keep their local weights and credit.

Fan-out (the downstream twin of folding). The consensus is the same header and blobs
for every receiver, so a relay that folded >= ``MIN_FAN_OUT`` of the ranks in ``to``
this round gets it ONCE, on its own route, with ``deliver_to`` naming those ranks; it
forwards the very same frames to each (``flodl_worker.fold``). Only ranks whose work
reached the round through that relay's folded frame (accepted, or the frame excluded)
qualify: that proves the relay folds (not ``--no-fold``) and knows their frontend ids
from the cycle's ``FoldOpen``. Everyone else gets a copy on its own route, as before.
``bytes_out`` counts the copies actually sent: one per fan-out, one per direct rank.

After the division the outer optimizer (``outer``: SlowMo / Nesterov, identity by
default) turns the consensus into the global the ranks receive.

A round whose accepted mass is 0 answers ``weight = 0`` with elided tensors: every
receiver keeps its local parameters (nothing was realized).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np

from flodl.wire import BadTensor, bf16_to_f32, f32_to_bf16, pack_round, pb, unpack_round

from .folding import FoldPlan
from .outer import OuterError, OuterOptimizer

__all__ = ["BusReducer", "RoundResult", "RoundRefused", "MIN_FAN_OUT"]

log = logging.getLogger("flodl.reducer")

# A relay is sent the consensus once for its ranks when it delivers to at least this many
# (for one rank, its own route costs the same and keeps the path the rank already uses).
MIN_FAN_OUT = 2


class RoundRefused(Exception):
    """A contribution that cannot belong to the open round; ``reason`` names why."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


@dataclass
class RoundResult:
    """The consensus to send: the same header and blobs go to every rank in ``to``."""

    cycle: int
    to: tuple[int, ...]
    header: pb.RoundHeader
    blobs: list
    total_weight: float
    contributors: tuple[int, ...]
    excluded: tuple[int, ...] = ()  # sent the consensus, but their work is not in it
    # (relay route, ranks): one copy to the relay, which forwards it to those ranks.
    fanout: tuple[tuple[tuple, tuple[int, ...]], ...] = ()

    @property
    def direct(self) -> tuple[int, ...]:
        """The ranks of ``to`` that get their own copy on their own route."""
        via = {r for _, ranks in self.fanout for r in ranks}
        return tuple(r for r in self.to if r not in via)

    def relay_header(self, ranks) -> pb.RoundHeader:
        """The consensus header for a relay's fan-out: the same, plus ``deliver_to``."""
        h = pb.RoundHeader()
        h.CopyFrom(self.header)
        h.deliver_to.extend(ranks)
        return h


@dataclass
class _Part:
    ranks: tuple[int, ...]  # one rank, or the ranks a relay folded
    weight: float
    arrays: list[np.ndarray] | None  # None when the weight is 0 (nothing to add)


@dataclass
class _Open:
    cycle: int
    expected: set[int]
    parts: dict[tuple[int, ...], _Part] = field(default_factory=dict)
    counted: dict[int, tuple[int, ...]] = field(default_factory=dict)  # rank -> key of its part
    gone: set[int] = field(default_factory=set)  # dropped (dead) during this round
    excluded: set[int] = field(default_factory=set)  # alive, but their folded frame left
    via: dict[int, tuple] = field(default_factory=dict)  # rank -> relay whose folded frame carried it
    shapes: tuple[tuple[int, ...], ...] | None = None


def _bf16_round(a: np.ndarray) -> np.ndarray:
    return bf16_to_f32(f32_to_bf16(a))


class BusReducer:
    def __init__(self, *, bf16_wire: bool = False, outer: OuterOptimizer | None = None) -> None:
        self.bf16_wire = bf16_wire
        self.outer = outer or OuterOptimizer()
        self.folds = FoldPlan()
        self._open: _Open | None = None
        self.rounds_completed = 0
        self.bytes_in = 0
        self.bytes_out = 0
        self.folded_in = 0  # folded frames accepted
        self.folds_discarded = 0  # folded frames dropped because one of their ranks died

    @property
    def open_cycle(self) -> int | None:
        return self._open.cycle if self._open else None

    def open(self, cycle: int, ranks) -> RoundResult | None:
        """Start expecting contributions for ``cycle``. An unfinished older round is abandoned."""
        self._open = _Open(cycle=cycle, expected=set(ranks))
        return self._maybe_finish()

    def contribute(self, rank: int, header: pb.RoundHeader, blobs) -> RoundResult | None:
        """One rank's own (unfolded) contribution."""
        o = self._check_cycle(f"rank {rank}", header)
        self._check_rank(o, f"rank {rank}", rank)
        self._accept(o, (rank,), header, blobs, f"rank {rank}")
        return self._maybe_finish()

    @staticmethod
    def _check_rank(o: "_Open", who: str, r: int) -> None:
        """Refuse a contribution for ``r`` that cannot count in the open round."""
        if r in o.excluded:
            raise RoundRefused(f"{who}: rank {r} is excluded from cycle {o.cycle} (its relay's folded frame left the round)")
        if r not in o.expected:
            raise RoundRefused(f"{who}: rank {r} is not expected in cycle {o.cycle}")
        if r in o.counted:
            raise RoundRefused(f"{who}: rank {r} already contributed to cycle {o.cycle}")

    def contribute_folded(self, relay: tuple, header: pb.RoundHeader, blobs) -> RoundResult | None:
        """A relay's folded frame: credits every rank in ``header.contributing_ranks``."""
        who = f"relay {relay[0][:32]!r}" if relay else "relay"
        o = self._check_cycle(who, header)
        ranks = tuple(sorted(header.contributing_ranks))
        if not ranks:
            raise RoundRefused(f"{who}: folded frame names no contributing ranks")
        if len(set(ranks)) != len(ranks):
            raise RoundRefused(f"{who}: folded frame names a rank twice")
        for r in ranks:
            if self.folds.relay_of(o.cycle, r) != relay:
                raise RoundRefused(f"{who} does not fold rank {r} in cycle {o.cycle}")
        dead = [r for r in ranks if r in o.gone]
        if dead:
            # The race: the fold left before the FoldDrop reached the relay. The dead
            # rank's work cannot be taken out of the sum: the frame leaves the round.
            self._exclude(o, ranks, f"rank {dead[0]} died after its relay's fold left")
            o.via.update((r, relay) for r in ranks)
            return self._maybe_finish()
        for r in ranks:
            self._check_rank(o, who, r)
        self._accept(o, ranks, header, blobs, who)
        o.via.update((r, relay) for r in ranks)
        self.folded_in += 1
        return self._maybe_finish()

    def drop(self, rank: int) -> RoundResult | None:
        """``rank`` is gone: stop waiting for it (and do not send it the consensus)."""
        o = self._open
        if o is None:
            return None
        o.expected.discard(rank)
        o.excluded.discard(rank)
        o.gone.add(rank)
        key = o.counted.get(rank)
        if key is not None:
            if len(key) == 1:
                del o.counted[rank]
                del o.parts[key]
            else:
                self._exclude(o, key, f"rank {rank} died before the round was done")
        return self._maybe_finish()

    # -- internals ---------------------------------------------------------------------

    def _check_cycle(self, who: str, header: pb.RoundHeader) -> _Open:
        o = self._open
        if o is None or header.cycle != o.cycle:
            raise RoundRefused(f"{who} sent cycle {header.cycle}, open cycle is {self.open_cycle}")
        if header.kind != pb.ROUND_KIND_MODEL or header.phase not in (
            pb.ROUND_PHASE_PARAMS,
            pb.ROUND_PHASE_UNSPECIFIED,
        ):
            raise RoundRefused(f"{who}: round phase {header.phase} kind {header.kind} is not a params round")
        return o

    def _accept(self, o: _Open, ranks: tuple[int, ...], header: pb.RoundHeader, blobs, who: str) -> None:
        try:
            arrays = unpack_round(header, blobs)
        except BadTensor as e:
            raise RoundRefused(f"{who}: {e}") from None
        shapes = tuple(a.shape for a in arrays)
        if o.shapes is None:
            o.shapes = shapes
        elif shapes != o.shapes:
            raise RoundRefused(f"{who}: tensor shapes differ from the cohort's")
        w = float(header.weight)
        o.parts[ranks] = _Part(ranks, w, arrays if w > 0 else None)
        for r in ranks:
            o.counted[r] = ranks
        self.bytes_in += sum(len(b) for b in blobs)

    def _exclude(self, o: _Open, ranks: tuple[int, ...], why: str) -> None:
        """A folded frame leaves the round; its surviving ranks are excluded."""
        o.parts.pop(ranks, None)
        for r in ranks:
            o.counted.pop(r, None)
            if r not in o.gone:
                o.expected.discard(r)
                o.excluded.add(r)
        self.folds_discarded += 1
        log.warning(
            "cycle %d: folded contribution of ranks %s discarded (%s); %s keep their local weights",
            o.cycle, list(ranks), why, sorted(set(ranks) - o.gone) or "none",
        )

    def _maybe_finish(self) -> RoundResult | None:
        o = self._open
        if o is None or not o.expected.issubset(o.counted.keys()):
            return None
        self._open = None
        contributors = tuple(sorted(o.counted))
        excluded = tuple(sorted(o.excluded))
        to = tuple(sorted(set(contributors) | o.excluded))
        total = float(sum(p.weight for p in o.parts.values()))
        weighted = [p for _, p in sorted(o.parts.items()) if p.arrays is not None]
        if total > 0 and weighted:
            # f32 accumulation in rank order (deterministic), one division at the end.
            consensus = [np.array(t, dtype=np.float32, copy=True) for t in weighted[0].arrays]
            for p in weighted[1:]:
                for acc, t in zip(consensus, p.arrays):
                    acc += t
            inv = np.float32(total)
            for acc in consensus:
                acc /= inv
            consensus = self._outer_step(o.cycle, consensus)
        else:
            total = 0.0
            consensus = [np.zeros(s, dtype=np.float32) for s in (o.shapes or ())]
        header, blobs = pack_round(
            consensus,
            cycle=o.cycle,
            weight=total,
            bf16=self.bf16_wire,
            contributing_ranks=contributors,
        )
        groups: dict[tuple, list[int]] = {}
        for r in to:
            relay = o.via.get(r)
            if relay is not None:
                groups.setdefault(relay, []).append(r)
        fanout = tuple((relay, tuple(rs)) for relay, rs in sorted(groups.items()) if len(rs) >= MIN_FAN_OUT)
        copies = len(to) - sum(len(rs) for _, rs in fanout) + len(fanout)
        self.rounds_completed += 1
        self.bytes_out += sum(len(b) for b in blobs) * copies
        return RoundResult(o.cycle, to, header, blobs, total, contributors, excluded, fanout)

    def _outer_step(self, cycle: int, consensus: list[np.ndarray]) -> list[np.ndarray]:
        if not self.outer.enabled:
            return consensus
        quantize = _bf16_round if self.bf16_wire else None
        try:
            return self.outer.step(cycle, consensus, quantize=quantize)
        except OuterError as e:
            log.error("outer optimizer state reset: %s", e)
            self.outer.reset()
            return self.outer.step(cycle, consensus, quantize=quantize)
