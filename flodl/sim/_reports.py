"""Reading batch reports back out of an event list: each batch with when it ended."""

from __future__ import annotations

from typing import Iterable, Iterator

from flodl.core import BatchDone, BatchesDone, Event

__all__ = ["batch_ends"]


def batch_ends(events: Iterable[Event]) -> Iterator[tuple[BatchDone, float]]:
    """Every reported batch, in order, with the time it ended. A ``BatchDone`` arrives as
    its batch ends; a ``BatchesDone`` frame leaves when its last batch ends, so each earlier
    one ended the later ones' time (compute + data) before that. (The link delay is left
    in, as for a ``BatchDone``.)"""
    for ev in events:
        if type(ev) is BatchDone:
            yield ev, ev.now
        elif type(ev) is BatchesDone:
            each = ev.batches
            ends, after = [], 0.0
            for b in reversed(each):
                ends.append(ev.now - after / 1e3)
                after += b.batch_ms + b.data_ms
            yield from zip(each, reversed(ends))
