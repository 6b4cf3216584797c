"""The simulator's links: FIFO per rank by the time a frame is sent."""

from __future__ import annotations

import heapq

from flodl.sim import SimConfig
from flodl.sim._world import _World


def _run_queue(w: _World) -> None:
    while w._q:
        t, _, fn, args = heapq.heappop(w._q)
        w.now = max(w.now, t)
        fn(*args)


def test_a_command_sent_while_a_round_reduces_goes_ahead_of_its_consensus():
    # The consensus leaves when the reduce is done (0.5 ms a contribution: half a second
    # at 1,024 ranks). It used to take its place on each rank's link at the reduce's
    # start, so every chunk sent meanwhile waited behind it: a simulated 1,024-rank run
    # idled 0.45 s a rank at its first round, waiting for extensions sent long before.
    w = _World(SimConfig(ms_per_batch=(10.0, 10.0), reduce_s_per_rank=0.1, latency_s=0.001))
    w._q.clear()  # (no hellos, no ticks: the links only)
    arrived = []
    for r in w.ranks:
        r.on_consensus = lambda cycle, arrays, inc, r=r.rank: arrived.append((round(w.now, 4), r, "consensus"))
    w.round = {"cycle": 1, "expected": {0, 1}, "got": {}, "missing": {0, 1}}
    w._arrive(w.gen, 0, 1, 1.0)
    w._arrive(w.gen, 1, 1, 1.0)  # reduced: the consensus leaves at 0.2 s
    w.now = 0.05
    w._to_rank(0, lambda: arrived.append((round(w.now, 4), 0, "chunk")))  # sent at 0.05 s
    _run_queue(w)
    mine = [(what, t) for t, r, what in arrived if r == 0]
    assert [what for what, _ in mine] == ["chunk", "consensus"]
    assert mine[0][1] < 0.06 and mine[1][1] >= 0.2  # the chunk a link's delay after it was sent
    assert [what for _, r, what in arrived if r == 1] == ["consensus"]


def test_a_consensus_of_a_coordinator_that_died_reducing_is_lost_and_counted():
    w = _World(SimConfig(ms_per_batch=(10.0, 10.0), reduce_s_per_rank=0.1))
    w._q.clear()
    got = []
    for r in w.ranks:
        r.on_consensus = lambda *a: got.append(a)
    w.round = {"cycle": 1, "expected": {0, 1}, "got": {}, "missing": {0, 1}}
    w._arrive(w.gen, 0, 1, 1.0)
    w._arrive(w.gen, 1, 1, 1.0)
    w.gen += 1  # the coordinator died while reducing
    _run_queue(w)
    assert got == [] and w.lost_frames == 2
