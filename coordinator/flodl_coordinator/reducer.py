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

A round whose accepted mass is 0 answers ``weight = 0`` with elided tensors: every
receiver keeps its local parameters (nothing was realized).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from flodl.wire import BadTensor, pack_round, pb, unpack_round

__all__ = ["BusReducer", "RoundResult", "RoundRefused"]


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


@dataclass
class _Open:
    cycle: int
    expected: set[int]
    got: dict[int, float] = field(default_factory=dict)  # rank -> weight
    parts: dict[int, list[np.ndarray]] = field(default_factory=dict)  # rank -> weighted tensors
    shapes: tuple[tuple[int, ...], ...] | None = None


class BusReducer:
    def __init__(self, *, bf16_wire: bool = False) -> None:
        self.bf16_wire = bf16_wire
        self._open: _Open | None = None
        self.rounds_completed = 0
        self.bytes_in = 0
        self.bytes_out = 0

    @property
    def open_cycle(self) -> int | None:
        return self._open.cycle if self._open else None

    def open(self, cycle: int, ranks) -> RoundResult | None:
        """Start expecting contributions for ``cycle``. An unfinished older round is abandoned."""
        self._open = _Open(cycle=cycle, expected=set(ranks))
        return self._maybe_finish()

    def contribute(self, rank: int, header: pb.RoundHeader, blobs) -> RoundResult | None:
        o = self._open
        if o is None or header.cycle != o.cycle:
            raise RoundRefused(f"rank {rank} sent cycle {header.cycle}, open cycle is {self.open_cycle}")
        if rank not in o.expected:
            raise RoundRefused(f"rank {rank} is not expected in cycle {o.cycle}")
        if rank in o.got:
            raise RoundRefused(f"rank {rank} already contributed to cycle {o.cycle}")
        try:
            arrays = unpack_round(header, blobs)
        except BadTensor as e:
            raise RoundRefused(f"rank {rank}: {e}") from None
        shapes = tuple(a.shape for a in arrays)
        if o.shapes is None:
            o.shapes = shapes
        elif shapes != o.shapes:
            raise RoundRefused(f"rank {rank}: tensor shapes differ from the cohort's")
        w = float(header.weight)
        if w > 0:
            o.parts[rank] = arrays
        o.got[rank] = w
        self.bytes_in += sum(len(b) for b in blobs)
        return self._maybe_finish()

    def drop(self, rank: int) -> RoundResult | None:
        """``rank`` is gone: stop waiting for it (and do not send it the consensus)."""
        o = self._open
        if o is None:
            return None
        o.expected.discard(rank)
        o.got.pop(rank, None)
        o.parts.pop(rank, None)
        return self._maybe_finish()

    def _maybe_finish(self) -> RoundResult | None:
        o = self._open
        if o is None or not o.expected.issubset(o.got.keys()):
            return None
        self._open = None
        contributors = tuple(sorted(o.got))
        to = contributors
        total = float(sum(o.got.values()))
        if total > 0 and o.parts:
            # f32 accumulation in rank order (deterministic), one division at the end.
            ranks = sorted(o.parts)
            consensus = [np.array(t, dtype=np.float32, copy=True) for t in o.parts[ranks[0]]]
            for r in ranks[1:]:
                for acc, t in zip(consensus, o.parts[r]):
                    acc += t
            inv = np.float32(total)
            for acc in consensus:
                acc /= inv
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
        self.rounds_completed += 1
        self.bytes_out += sum(len(b) for b in blobs) * len(to)
        return RoundResult(o.cycle, to, header, blobs, total, contributors)
