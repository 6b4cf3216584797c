"""The drift check: the core's incremental views against a recount of what they summarise.

``view_drift(state)`` lists every disagreement (empty: none) between what the core keeps
so that an event costs O(1) -- the rank index (``_rank_index``: phases, unfolded steps,
the open round's waiting set, the liveness floor), Cadence's wake/gate views and cached
counts (``cadence._views``), the chunk pools' kept sums, each epoch's count of pending batches -- and the same
values recomputed from the records. The stateful property tests assert it after every
step, so a writer that forgets to keep a view shows up there rather than as a slow or
wrong answer much later. It walks everything: a check, never on the step's path.
"""

from __future__ import annotations

from ._phases import ACTIVE, TRAINING
from ._state import CoordinatorState
from .cadence._boundary import leaves_the_tail
from .cadence._dispatcher import _held, _pool_of, quiesced, source_epoch, window_steps

__all__ = ["view_drift"]


def view_drift(st: CoordinatorState) -> list[str]:
    return st.index_drift() + _cadence_drift(st) + _coverage_drift(st)


def _coverage_drift(st: CoordinatorState) -> list[str]:
    """Each epoch's ``pending`` counts its batches on the ranks' pending lists."""
    held: dict[int, int] = {}
    for items in st.coverage.pending.values():
        for it in items:
            held[it[0]] = held.get(it[0], 0) + 1
    return [f"epoch {e} counts {ec.pending} pending batches, the lists hold {held.get(e, 0)}"
            for e, ec in st.coverage.epochs.items() if ec.pending != held.get(e, 0)]  # fmt: skip


def _cadence_drift(st: CoordinatorState) -> list[str]:
    """``wakeable`` holds every rank a wake could serve, ``open_windows`` every rank that
    blocks the gate (both up to the ranks the index released and nobody absorbed yet),
    ``alive_counts`` the current counts of the alive, each pool its sums."""
    cad = st.cadence
    if cad is None:
        return []
    bad: list[str] = []
    released = st.index.released
    alive = st.index.alive()
    if st.run.phase is TRAINING:
        streams = cad.streams_epochs  # Async, and Cadence at its boundary: an idle rank draws from the source epoch
        source = source_epoch(st) if streams else None
        for r in alive:
            if _held(st, r) is not None or r in cad.wakeable or r in released or leaves_the_tail(st, r):
                continue
            pool = _pool_of(st, r)
            if source is not None if streams else pool is not None and pool.remaining() > 0:
                bad.append(f"rank {r} could be served but is not wakeable")
    counts = cad.elche.batch_counts
    for r in alive:
        if r in cad.in_open or r in released or r in cad.throttled:
            continue
        if window_steps(st, r) < counts[r] and not quiesced(st, r):
            bad.append(f"rank {r} blocks the gate but is not in open_windows")
    if set(cad.open_windows) != cad.in_open:
        bad.append(f"open_windows {sorted(cad.open_windows)} and in_open {sorted(cad.in_open)} differ")
    view = cad.alive_counts
    if view is not None and view[0] == st.index.alive_version:
        want = [c if rec.phase is ACTIVE else 0 for c, rec in zip(counts, st.ranks)]
        recount = (want, sum(want), cad.elche.calibrated or cad.elche.has_speed_hint())
        if view[1:] != recount:
            bad.append(f"alive_counts {view[1:]} differ from a recount {recount}")
    for pool in cad.pools.values():
        try:
            pool.check_sums()
        except AssertionError as e:
            bad.append(str(e))
    return bad
