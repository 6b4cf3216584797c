"""The work a rank was given, as position segments of an epoch.

A plan (``StartEpoch`` or ``Update.next_plan``) is a range of positions of the epoch
permutation ``flodl.shuffle.epoch_permutation(seed, epoch, total_samples)``.
``ExtendPartition`` appends a segment to the plan in training (same epoch) or becomes a
plan of its own. Batches never straddle two segments, so each ``timing.batch`` covers
exactly ``[offset, offset + samples)``.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

__all__ = ["Chunk"]


@dataclass(slots=True)
class Chunk:
    """One plan: an epoch and the position segments still to train, plus its metrics."""

    epoch: int
    seq: int
    segments: deque = field(default_factory=deque)  # [offset, size] lists, in order
    started: float = 0.0
    batches: int = 0
    samples: int = 0
    loss_sum: float = 0.0
    compute_ms: float = 0.0
    data_ms: float = 0.0

    def exhausted(self) -> bool:
        while self.segments and self.segments[0][1] == 0:
            self.segments.popleft()
        return not self.segments

    def last_batch_left(self, batch_size: int) -> bool:
        """What is left is one batch: the next one trained exhausts the plan."""
        return not self.exhausted() and len(self.segments) == 1 and self.segments[0][1] <= batch_size

    def take(self, batch_size: int) -> tuple[int, int] | None:
        """Next batch as (offset, count) inside one segment, or None when exhausted."""
        if self.exhausted():
            return None
        seg = self.segments[0]
        count = min(batch_size, seg[1])
        offset = seg[0]
        seg[0] += count
        seg[1] -= count
        return offset, count

    def held(self) -> list[tuple[int, int]]:
        """The (offset, size) segments not trained yet."""
        return [(int(o), int(n)) for o, n in self.segments if n > 0]
