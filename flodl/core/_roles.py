"""Callback roles: which rank saves checkpoints, runs evals and the epoch callback.

Theory of operation
-------------------
Three roles (spec §10.1-10.5) live in ``RoleState`` (``st.roles``, a record of ``_state``): ``checkpoint_role``,
``eval_role`` and ``epoch_role``. The policy is ``CoreConfig.epoch_callback_policy``:

* ``"fastest"`` (default): a role goes to the fastest alive rank -- the lowest smoothed
  ms per batch among alive ranks that have one (Cadence's ElChe; ties -> lowest rank);
  with no pace (Sync, or before any window) the lowest alive rank (``resolve_fastest``).
* ``"rank:N"``: every role is rank ``min(N, world_size - 1)``, pinned.

Roles are sticky: they do not follow pace drift. They move only

* on a death (``on_death``): Fastest re-resolves every role the dead rank held; Rank(N)
  moves only the checkpoint role, to the lowest alive rank other than the dead one
  (``_checkpointing``'s failover does the same for a save in flight);
* once, when Cadence first calibrates (``on_calibration``, Fastest only): all roles :=
  the fastest rank (nothing moves if no rank has a pace);
* by ``_checkpointing``: a failed save moves the checkpoint role to the rank retried, a
  successful one to the rank that saved (``set_checkpoint_role``).

``dirty`` says the epoch role changed since it was last announced: ``_dispatch``'s
``announce_role`` then broadcasts ``SetEpochCallbackRole`` at the next dispatch and
clears it (it starts True so the first dispatch announces).

The callback costs (``CheckpointDone`` / ``EvalDone`` / ``EpochFnElapsed`` ``elapsed_ms``)
are smoothed per kind with an EWMA (alpha 0.3, the first sample seeds it): ``absorb_cost``
(a non-finite or negative epoch-fn time is ignored and counted). ``_slack`` turns them
into a shorter window for the rank that pays them.

Intents (``IntentRaised``) only set flags here; they are served at the next epoch
aggregation (``_metrics`` -> ``_checkpointing`` / ``_run``). Non-final evals asked by an
intent are remembered in ``pending_evals`` (schedule id -> (epoch, target)) and their
answers in ``evals``.

Everything here is pure: functions of the state, no commands.
"""

from __future__ import annotations

import math
from typing import Optional

from ._config import CoreConfig, parse_policy  # noqa: F401  (parse_policy re-exported; the run schema owns it)
from ._events import EpochFnElapsed
from ._state import CoordinatorState, RoleState  # noqa: F401  (RoleState re-exported; the records live in _state)

__all__ = [
    "EWMA_ALPHA",
    "RoleState",
    "parse_policy",
    "initial_roles",
    "pace",
    "resolve_fastest",
    "on_death",
    "on_calibration",
    "set_checkpoint_role",
    "absorb_cost",
    "on_epoch_fn_elapsed",
    "lowest_alive_except",
]

EWMA_ALPHA = 0.3


def _pinned(st: CoordinatorState) -> Optional[int]:
    n = parse_policy(st.config.epoch_callback_policy)
    return None if n is None else min(n, st.config.world_size - 1)


def initial_roles(config: CoreConfig) -> RoleState:
    """Before the world forms: Fastest -> rank 0 (the lowest, all will be alive); Rank(N) -> N."""
    n = parse_policy(config.epoch_callback_policy)
    r = 0 if n is None else min(n, config.world_size - 1)
    return RoleState(checkpoint_role=r, eval_role=r, epoch_role=r)


def pace(st: CoordinatorState, rank: int) -> Optional[float]:
    """The rank's smoothed ms per batch (Cadence), None without one (Sync, no reading)."""
    cad = st.cadence
    if cad is None:
        return None
    return cad.elche.smoothed_ms_per_batch(rank)


def _lowest_alive(st: CoordinatorState) -> Optional[int]:
    alive = st.alive_ranks()
    return alive[0] if alive else None


def lowest_alive_except(st: CoordinatorState, exclude: tuple[int, ...]) -> Optional[int]:
    return next((r for r in st.alive_ranks() if r not in exclude), None)


def resolve_fastest(st: CoordinatorState, *, paced_only: bool = False) -> Optional[int]:
    """The alive rank with the lowest pace (ties -> lowest rank); none paced -> the lowest
    alive rank (or None with ``paced_only``); none alive -> None."""
    best, best_ms = None, None
    for r in st.alive_ranks():
        ms = pace(st, r)
        if ms is not None and (best_ms is None or ms < best_ms):
            best, best_ms = r, ms
    if best is not None or paced_only:
        return best
    return _lowest_alive(st)


def on_death(st: CoordinatorState, rank: int) -> None:
    """``rank`` is gone (it is no longer ACTIVE): move the roles it held (module doc)."""
    ro = st.roles
    if _pinned(st) is not None:
        if ro.checkpoint_role == rank:
            ro.checkpoint_role = lowest_alive_except(st, (rank,))
        return
    old_epoch = ro.epoch_role
    if ro.checkpoint_role == rank:
        ro.checkpoint_role = resolve_fastest(st)
    if ro.eval_role == rank:
        ro.eval_role = resolve_fastest(st)
    if ro.epoch_role == rank:
        ro.epoch_role = resolve_fastest(st)
        if ro.epoch_role != old_epoch and ro.epoch_role is not None:
            ro.dirty = True


def on_calibration(st: CoordinatorState) -> None:
    """Once, when Cadence first calibrates: Fastest puts all roles on the fastest paced
    rank (no pace: nothing moves, and the election stays pending)."""
    ro = st.roles
    if ro.calibration_elected or _pinned(st) is not None:
        return
    fastest = resolve_fastest(st, paced_only=True)
    if fastest is None:
        return
    ro.calibration_elected = True
    if ro.epoch_role != fastest:
        ro.dirty = True
    ro.checkpoint_role = ro.eval_role = ro.epoch_role = fastest


def set_checkpoint_role(st: CoordinatorState, rank: int) -> None:
    st.roles.checkpoint_role = rank


def _ewma(old: Optional[float], sample: float) -> float:
    return sample if old is None else EWMA_ALPHA * sample + (1.0 - EWMA_ALPHA) * old


def absorb_cost(st: CoordinatorState, kind: str, elapsed_ms: float) -> None:
    """Smooth a callback's cost: ``kind`` is "checkpoint", "eval" or "epoch_fn"."""
    ro = st.roles
    attr = f"{kind}_ewma_ms"
    setattr(ro, attr, _ewma(getattr(ro, attr), float(elapsed_ms)))


def on_epoch_fn_elapsed(st: CoordinatorState, ev: EpochFnElapsed) -> None:
    """``EpochFnElapsed``: smooth the epoch function's cost (spec §10.5)."""
    ms = float(ev.elapsed_ms)
    if not (math.isfinite(ms) and ms >= 0.0):
        st.count_ignored("EpochFnElapsed with a non-finite or negative elapsed_ms")
        return
    absorb_cost(st, "epoch_fn", ms)
