"""Phases and their transition tables: every state a rank, a round or the run can be in.

Theory of operation
-------------------
Phases are sentinels (h11 style): classes whose repr is their own name, compared with
``is``. They survive ``copy.deepcopy`` and compare equal after a replay.

Each of the three machines moves only along its table; ``next_phase`` looks a move up
and refuses one that is not there with a ``LocalViolation`` (our bug, never a peer's)::

    MEMBERSHIP (a rank slot)   VACANT --admit--> JOINING --form--> ACTIVE
                               JOINING --lost/leave--> VACANT
                               ACTIVE --lost--> DEAD     ACTIVE --leave--> LEFT
                               JOINING --join--> ACTIVE  (admitted mid-run, seeded)
                               DEAD/LEFT --admit--> JOINING  (the slot refilled mid-run)
    ROUND (averaging)          IDLE --trigger--> PENDING --finish/stall/abandon--> IDLE
    RUN                        FORMING --form--> TRAINING --final_eval--> FINAL_EVAL
                               TRAINING/FINAL_EVAL --shutdown--> SHUTTING_DOWN --finish--> FINISHED
                               FORMING/TRAINING/FINAL_EVAL --stop--> STOPPING --finish--> FINISHED
                               FORMING/TRAINING/FINAL_EVAL --fail--> FINISHED

``python -m flodl.core._phases`` prints the three diagrams from the tables (``diagram``),
so the docs never drift from the code.
"""

from __future__ import annotations

from typing import Any

from ._errors import LocalViolation

__all__ = [
    "Sentinel",
    "VACANT",
    "JOINING",
    "ACTIVE",
    "DEAD",
    "LEFT",
    "IDLE",
    "PENDING",
    "FORMING",
    "TRAINING",
    "FINAL_EVAL",
    "SHUTTING_DOWN",
    "STOPPING",
    "FINISHED",
    "MEMBERSHIP",
    "ROUND",
    "RUN",
    "TABLES",
    "next_phase",
    "diagram",
]


class Sentinel(type):
    """A class that is its own instance, printing as its name (h11's ``_util.Sentinel``)."""

    def __new__(cls, name, bases, namespace, **kwds):
        assert bases == (Sentinel,)
        v = super().__new__(cls, name, bases, namespace, **kwds)
        v.__class__ = v
        return v

    def __repr__(self) -> str:
        return self.__name__


# Rank membership phases (MEMBERSHIP).
class VACANT(Sentinel, metaclass=Sentinel): """No admitted process holds this rank."""
class JOINING(Sentinel, metaclass=Sentinel): """Admitted; waiting for the world to form."""
class ACTIVE(Sentinel, metaclass=Sentinel): """In the formed world, alive."""
class DEAD(Sentinel, metaclass=Sentinel): """Lost (silence, crash, unroutable). Only a new process may take the slot again."""
class LEFT(Sentinel, metaclass=Sentinel): """Exited cleanly. Not a failure; only a new process may take the slot again."""


# Averaging-round phases (ROUND).
class IDLE(Sentinel, metaclass=Sentinel): """No round open."""
class PENDING(Sentinel, metaclass=Sentinel): """Round open; waiting for SyncAcks."""


# Run phases (RUN).
class FORMING(Sentinel, metaclass=Sentinel): """Admitting ranks until world_size are in."""
class TRAINING(Sentinel, metaclass=Sentinel): """Epochs being dispatched and averaged."""
class FINAL_EVAL(Sentinel, metaclass=Sentinel): """Final canonical eval sent; waiting for it."""
class SHUTTING_DOWN(Sentinel, metaclass=Sentinel): """Shutdown sent; waiting for exits."""
class STOPPING(Sentinel, metaclass=Sentinel): """Operator stop; waiting for exits."""
class FINISHED(Sentinel, metaclass=Sentinel): """RunFinished emitted. Terminal."""


MEMBERSHIP: dict[tuple[Any, str], Any] = {
    (VACANT, "admit"): JOINING,
    (JOINING, "form"): ACTIVE,
    (JOINING, "lost"): VACANT,
    (JOINING, "leave"): VACANT,
    (ACTIVE, "lost"): DEAD,
    (ACTIVE, "leave"): LEFT,
    # Elastic membership: a rank admitted into a running world joins once it holds the
    # seed consensus; a slot whose rank died or left may be taken again (a restart).
    (JOINING, "join"): ACTIVE,
    (DEAD, "admit"): JOINING,
    (LEFT, "admit"): JOINING,
}

ROUND: dict[tuple[Any, str], Any] = {
    (IDLE, "trigger"): PENDING,
    (PENDING, "finish"): IDLE,
    (PENDING, "stall"): IDLE,  # the run then ends: ReduceStall
    (PENDING, "abandon"): IDLE,  # the coordinator restarted (``_resync``)
}

RUN: dict[tuple[Any, str], Any] = {
    (FORMING, "form"): TRAINING,
    (TRAINING, "final_eval"): FINAL_EVAL,
    (TRAINING, "shutdown"): SHUTTING_DOWN,
    (FINAL_EVAL, "shutdown"): SHUTTING_DOWN,
    (SHUTTING_DOWN, "finish"): FINISHED,
    (FORMING, "stop"): STOPPING,
    (TRAINING, "stop"): STOPPING,
    (FINAL_EVAL, "stop"): STOPPING,
    (STOPPING, "finish"): FINISHED,
    (FORMING, "fail"): FINISHED,  # form_timeout_s passed
    (TRAINING, "fail"): FINISHED,
    (FINAL_EVAL, "fail"): FINISHED,
}

TABLES: dict[str, dict[tuple[Any, str], Any]] = {"membership": MEMBERSHIP, "round": ROUND, "run": RUN}


def next_phase(table: dict, phase, trigger: str, who: str):
    """Look up ``(phase, trigger)`` in a transition table; a missing entry is our bug."""
    new = table.get((phase, trigger))
    if new is None:
        raise LocalViolation(f"{who}: no transition from {phase!r} on {trigger!r}")
    return new


def diagram(table: dict[tuple[Any, str], Any], name: str = "") -> str:
    """The table as a Mermaid ``stateDiagram-v2`` (one edge per move; terminal phases end)."""
    lines = ["stateDiagram-v2"] + ([f"    %% {name}"] if name else [])
    sources = {src for src, _ in table}
    first = next(iter(table))[0]
    lines.append(f"    [*] --> {first!r}")
    for (src, trigger), dst in table.items():
        lines.append(f"    {src!r} --> {dst!r}: {trigger}")
    for dst in dict.fromkeys(table.values()):
        if dst not in sources:
            lines.append(f"    {dst!r} --> [*]")
    return "\n".join(lines)


if __name__ == "__main__":  # python -m flodl.core._phases
    print("\n\n".join(diagram(t, n) for n, t in TABLES.items()))
