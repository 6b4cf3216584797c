"""Policies as data: the one place that reads ``config.policy``.

Theory of operation
-------------------
A run's averaging policy is a ``Policy`` value: its dispatcher (who trains what, when:
``_dispatch.Dispatcher``), its gate (when a round opens: ``(bool, reason)``), and the
switches that tell the Cadence family's engines how to behave, which used to be string
checks on ``config.policy`` spread over the engines:

==================  =====  =======  =====  ==================================================
switch              Sync   Cadence  Async  meaning
==================  =====  =======  =====  ==================================================
``barrier_paced``   yes    yes      no     ranks are held at the reduce (and epoch) barrier;
                                           Async may run its overshoot past it
``overshoot``       no     no       yes    the reduce budget has a look-ahead that moves with
                                           the guard's verdicts (``_overshoot``)
``atomic_dispatch`` no     yes      no     the next chunk is folded into the ``Update``
``streams_epochs``  no     yes      yes    epoch e+1 opens while e is still live
                                           (Cadence: a window runs on into it,
                                           ``cadence._boundary``)
==================  =====  =======  =====  ==================================================

``POLICIES`` maps the configured name to its value; ``policy_of`` looks it up (an
unknown name is our bug: ``CoreConfig`` refuses it first). Nothing registers itself
when imported: the table below is the whole list.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

from .cadence import _async, _boundary, _dispatcher, _feedback
from ._averaging import should_average
from ._config import CoreConfig
from ._dispatch import SYNC, Dispatcher
from ._errors import LocalViolation
from ._state import CoordinatorState

__all__ = ["Policy", "POLICIES", "SYNC_POLICY", "CADENCE_POLICY", "ASYNC_POLICY", "policy_of", "dispatcher_for",
           "gate_for", "DISPATCHERS", "GATES"]  # fmt: skip

Gate = Callable[[CoordinatorState], tuple[bool, str]]


@dataclass(frozen=True, slots=True, eq=False)
class Policy:
    """One averaging policy (see the module doc); compared by identity, like a module."""

    name: str
    dispatcher: Dispatcher
    gate: Gate
    barrier_paced: bool
    overshoot: bool
    atomic_dispatch: bool
    streams_epochs: bool
    # The policy's own records, where the protocol modules would otherwise read
    # ``st.cadence``: a restart (the abandoned round's cycle or None), a resynced rank's
    # throttle lifted, the run summary's policy part.
    on_restarted: Callable[[CoordinatorState, Optional[int]], None]
    release_throttle: Callable[[CoordinatorState, int], None]
    summarise: Callable[[CoordinatorState, dict[str, Any]], None]

    def __repr__(self) -> str:
        return f"Policy({self.name!r})"


def _nothing(*_: Any) -> None:
    """Sync keeps no policy record."""


SYNC_POLICY = Policy("sync", SYNC, should_average, barrier_paced=True, overshoot=False, atomic_dispatch=False,
                     streams_epochs=False, on_restarted=_nothing, release_throttle=_nothing,
                     summarise=_nothing)  # fmt: skip
# Cadence and Async are one dispatcher class composed with the switches (and, for Async,
# its epoch streaming: ``cadence._async.STREAMS``); its setup hands barrier_paced and
# overshoot to the CadenceState the engines read. The Policy repeats them so the table
# above is data.
def _composed(name: str, d: _dispatcher.CadenceDispatcher) -> Policy:
    return Policy(name, d, _dispatcher.cadence_gate, barrier_paced=d.barrier_paced, overshoot=d.overshoot,
                  atomic_dispatch=d.atomic_dispatch, streams_epochs=d.streams is not None,
                  on_restarted=_dispatcher.on_restarted, release_throttle=_dispatcher.release_throttle,
                  summarise=_feedback.summarise)  # fmt: skip


CADENCE_POLICY = _composed("cadence", _boundary.CADENCE)
ASYNC_POLICY = _composed("async", _async.ASYNC)

POLICIES: dict[str, Policy] = {p.name: p for p in (SYNC_POLICY, CADENCE_POLICY, ASYNC_POLICY)}
# Views for callers that want one part (tests, the step).
DISPATCHERS: dict[str, Dispatcher] = {n: p.dispatcher for n, p in POLICIES.items()}
GATES: dict[str, Gate] = {n: p.gate for n, p in POLICIES.items()}


def policy_of(config: CoreConfig) -> Policy:
    """The run's policy."""
    try:
        return POLICIES[config.policy]
    except KeyError:
        raise LocalViolation(f"policy {config.policy!r} has no Policy") from None


def dispatcher_for(st: CoordinatorState) -> Dispatcher:
    return policy_of(st.config).dispatcher


def gate_for(st: CoordinatorState) -> Gate:
    return policy_of(st.config).gate
