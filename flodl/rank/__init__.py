"""flodl.rank: the rank's half of the protocol as a sans-IO machine (no torch, no sockets).

    m = RankMachine(rank=0)
    m.handle(IncarnationSeen(incarnation=inc, hello_ack=True))
    m.handle(Admitted(spec=ack.run))
    for cmd in m.handle(ControlReceived(control=ctl)): ...   # SendTiming, TakeSnapshot, ...
    act = m.next_action(now)                                  # TrainBatch | SendMetrics | WAIT_*

Driven by the real rank (``flodl_worker.rank``: torch and a DEALER socket) and by the
simulator (``flodl.sim``: virtual time), so both run the same plans, credit,
checkpoint arming and resync logic. Imports only ``flodl.wire``'s message types.

Everything else lives in ``_``-prefixed modules; whatever is listed in ``__all__``
below is the public API.
"""

from ._events import (
    WAIT_PLAN,
    WAIT_THROTTLE,
    AbandonRounds,
    Admitted,
    ApplyConsensus,
    BatchTrained,
    HeartbeatDue,
    Command,
    ConsensusReady,
    ControlReceived,
    Drop,
    Event,
    Exit,
    FormGroup,
    IncarnationSeen,
    RunEpochFn,
    RunEval,
    SaveCheckpoint,
    SeedApplied,
    SendMetrics,
    SendTiming,
    Sentinel,
    TakeSnapshot,
    TrainBatch,
    Warn,
)
from ._account import CAUSES, GOODPUT_CAUSES, TimeAccount
from ._machine import INFORMATIONAL, RankMachine, Snapshot, gamma_mass
from ._plans import Chunk

__all__ = [
    "RankMachine",
    "Snapshot",
    "Chunk",
    "gamma_mass",
    "INFORMATIONAL",
    # where a rank's wall time went (goodput / badput by cause)
    "TimeAccount",
    "CAUSES",
    "GOODPUT_CAUSES",
    # events
    "Event",
    "Admitted",
    "IncarnationSeen",
    "ControlReceived",
    "ConsensusReady",
    "BatchTrained",
    "HeartbeatDue",
    "SeedApplied",
    # commands
    "Command",
    "SendTiming",
    "SendMetrics",
    "TrainBatch",
    "TakeSnapshot",
    "ApplyConsensus",
    "AbandonRounds",
    "SaveCheckpoint",
    "RunEval",
    "RunEpochFn",
    "FormGroup",
    "Exit",
    "Drop",
    "Warn",
    # next_action's answers when there is nothing to train
    "Sentinel",
    "WAIT_PLAN",
    "WAIT_THROTTLE",
]
