"""flodl.sim: run the real core against simulated ranks, in virtual time.

    from flodl.sim import SimConfig, simulate
    res = simulate(SimConfig(ms_per_batch=(10, 20, 40), policy="sync", epochs=3))
    res.summary["coverage"]

Thousands of ranks or hours of training take seconds, and every run replays from its
seed (``res.events`` is the exact event list the core consumed).
"""

from ._reports import batch_ends
from ._world import Result, SimConfig, simulate

__all__ = ["SimConfig", "Result", "simulate", "batch_ends"]
