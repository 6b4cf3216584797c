"""The drift check: the core's incremental views against a recount of what they summarise.

``view_drift(state)`` lists every disagreement (empty: none) between what the core keeps
so that an event costs O(1) -- the rank index (``_rank_index``: phases, unfolded steps,
the open round's waiting set, the liveness floor), Cadence's wake/gate views and cached
counts (``cadence._dispatcher``), the chunk pools' kept sums -- and the same values
recomputed from the records. The stateful property tests assert it after every step, so
a writer that forgets to keep a view shows up there rather than as a slow wrong answer.
"""

from __future__ import annotations

from ._state import CoordinatorState
from .cadence import _dispatcher

__all__ = ["view_drift"]


def view_drift(st: CoordinatorState) -> list[str]:
    return st.index_drift() + _dispatcher.check_views(st)
