"""The core's cost at many ranks, as counts of work, never as time (issue 11, item 1).

A command to every rank is a ``Send`` built when first read; a world forms in one move
of the rank index; a Cadence rearm puts back only what changed; the run's tail parks
the ranks that leave it; an epoch aggregates the ranks' running sums. Each test counts
what the old code did per rank (or per event) where the new code does not."""

from __future__ import annotations

import math
import random

import pytest

from flodl.core import Send
from flodl.core import _metrics
from flodl.core._events import ChunkDone
from flodl.core._state import EpochSums
from flodl.core._rank_index import RankIndex
from flodl.core.cadence import _boundary, _chunk_pool, _dispatcher
from flodl.wire import pb

from .cluster import Cluster


def _update(ctl: pb.Control, version: int, cycle: int) -> None:
    ctl.update.version, ctl.update.cycle = version, cycle


def test_send_built_reads_as_the_message_an_eager_send_carries():
    lazy = Send.built(3, 17, "update", _update, (2, 5))
    eager = Send(3, pb.Control(command_id=17, update=pb.Control.Update(version=2, cycle=5)))
    assert lazy.kind == "update"  # known without building
    assert lazy == eager and eager == lazy
    assert lazy.control is lazy.control  # built once, then kept
    assert repr(lazy) == repr(eager)
    assert lazy != Send(4, eager.control)
    with pytest.raises(Exception):
        lazy.rank = 4  # frozen, like the dataclass it replaces
    with pytest.raises(TypeError):
        hash(lazy)


def test_send_each_numbers_its_sends_in_order():
    sends = Send.each([5, 1, 9], 40, "update", _update, (1, 2))
    assert [(s.rank, s.control.command_id, s.kind) for s in sends] == [(5, 40, "update"), (1, 41, "update"),
                                                                        (9, 42, "update")]  # fmt: skip


def test_a_world_forms_without_a_phase_write_per_rank(monkeypatch):
    """The last hello forms the world: its ACTIVE moves reach the rank index at once
    (``RankIndex.moved``), not as one ``changed`` call per rank (the old loop)."""
    calls = []
    real = RankIndex.changed

    def counting(self, rec, name, old):
        calls.append(name)
        return real(self, rec, name, old)

    c = Cluster(policy="sync", world_size=8)
    for r in range(7):
        c.hello(r)
    monkeypatch.setattr(RankIndex, "changed", counting)
    c.hello(7)
    assert c.state.alive_count() == 8
    assert calls.count("phase") <= 1, calls  # the last hello's own JOINING, nothing per rank


@pytest.mark.parametrize("policy", ["cadence", "async"])
def test_a_death_rearms_the_gate_view_in_place(policy):
    """A death rearms Cadence's views: the ranks taken out since go back into the gate's
    heap; it is not rebuilt from every ACTIVE rank (sorted: O(N log N) per death, and a
    run's end is N deaths)."""
    c = Cluster(policy=policy, world_size=6, total=600, batch_size=4, epochs=2)
    c.join_all()
    while c.ranks[0].step < 3:
        assert c.pump_once()
    heap = c.state.cadence.open_windows
    c.kill(2)
    assert c.state.cadence.open_windows is heap


def test_the_tail_looks_at_each_parked_rank_once_until_one_trains(monkeypatch):
    """In the run's last window a wake used to look at every idle rank each time the last
    trainer finished a fragment; now those that left the tail stay parked, and a wake
    looks at them only until one trains again."""
    looked = []
    real = _boundary.leaves_the_tail

    def counting(st, rank):
        looked.append(rank)
        return real(st, rank)

    monkeypatch.setattr(_boundary, "leaves_the_tail", counting)
    c = Cluster(policy="cadence", world_size=64, total=64 * 32, batch_size=4, epochs=2,
                speeds=[(10.0, 20.0, 40.0)[r % 3] for r in range(64)])  # fmt: skip
    c.join_all()
    fin = c.run()
    assert fin is not None and fin.ok
    batches = sum(rec.batches for rec in c.state.ranks)
    # About one look per batch (1,052 for 1,024 batches); the old walk made 1,717.
    assert len(looked) <= 1.25 * batches, (len(looked), batches)


def _chunk(rank: int, seq: int, batches: int, loss: float, ms: float, scalars=()) -> ChunkDone:
    return ChunkDone(now=1.0, rank=rank, epoch=0, chunk_seq=seq, batches=batches, samples=batches * 4,
                     avg_loss=loss, epoch_ms=ms, share_complete_ms=ms / 2, scalars=scalars)  # fmt: skip


def test_running_sums_aggregate_to_what_the_chunks_do():
    chunks = {
        0: [_chunk(0, 1, 3, 0.25, 30.0, (("acc", 1.5, 3),)), _chunk(0, 2, 1, 0.125, 7.0)],
        2: [_chunk(2, 1, 2, 0.5, 21.0, (("acc", 0.5, 2), ("f1", 0.25, 1)))],
    }
    sums = EpochSums()
    for ch in (chunks[0][0], chunks[2][0], chunks[0][1]):  # in the order they arrive
        _metrics._add(sums, ch)
    m = _metrics.aggregate_sums(0, sums, 4)
    assert m == _metrics.aggregate(0, chunks, 4)
    # By hand: loss weighted by batches, samples per second of each rank's share_complete_ms.
    assert m["avg_loss"] == (0.25 * 3 + 0.125 * 1 + 0.5 * 2) / 6
    assert m["per_rank_batches"] == [4, 0, 2, 0] and m["per_rank_samples"] == [16, 0, 8, 0]
    assert m["per_rank_throughput"] == pytest.approx([16 / 18.5 * 1000, 0.0, 8 / 10.5 * 1000, 0.0])
    assert m["scalars"]["acc"] == pytest.approx((4 * 0.5 + 2 * 0.25) / 6)
    assert _metrics.aggregate_sums(0, EpochSums(), 2)["per_rank_throughput"] == [0.0, 0.0]


def test_an_epoch_aggregates_without_walking_its_chunks(monkeypatch):
    """The boundary step folds no chunk: each was folded into its rank's sums as it came."""
    folded, inside = [], []
    real_add, real_next = _metrics._add, _metrics.aggregate_next

    def add(acc, ev):
        if inside:
            folded.append(ev)
        real_add(acc, ev)

    def aggregate_next(st, out):
        inside.append(True)
        try:
            return real_next(st, out)
        finally:
            inside.clear()

    monkeypatch.setattr(_metrics, "_add", add)
    monkeypatch.setattr(_metrics, "aggregate_next", aggregate_next)
    c = Cluster(policy="sync", world_size=4, total=160, batch_size=4, epochs=2)
    c.join_all()
    c.run_until(lambda: c.state.metrics.last_aggregated == 0)
    assert folded == []
    assert c.state.metrics.history[0]["epoch"] == 0


@pytest.mark.parametrize("n", [3, 100])  # a plain loop, and the bulk fill
def test_send_each_of_numbers_in_order_and_stops_at_the_shorter(n):
    sends = Send.each(list(range(n, 0, -1)), 9, "update", _update, (1, 2))
    assert [(s.rank, s.control.command_id) for s in sends] == [(n - i, 9 + i) for i in range(n)]
    assert sends[0] == Send(n, pb.Control(command_id=9, update=pb.Control.Update(version=1, cycle=2)))
    short = Send.each_of(range(n), 0, "update", _update, [(1, 1), (2, 2)])
    assert [(s.rank, s.control.update.version) for s in short] == [(0, 1), (1, 2)]


def _old_final_window_alloc(rem, counts, alive):
    """The split as the old code made it (one rank at a time, every remainder sorted)."""
    ws = len(counts)
    alloc = [0] * ws
    total = sum(counts[r] for r in range(ws) if alive[r])
    if rem <= 0 or total == 0 or rem >= total:
        return _chunk_pool.final_window_alloc(rem, counts, alive)  # (unchanged branches)
    frac = []
    for r in range(ws):
        if alive[r]:
            exact = rem * counts[r] / total
            alloc[r] = math.floor(exact)
            frac.append((r, exact - alloc[r]))
    frac.sort(key=lambda rf: -rf[1])
    for i in range(rem - sum(alloc)):
        alloc[frac[i % len(frac)][0]] += 1
    return _chunk_pool.consolidate_lone_ones(alloc, alive)


@pytest.mark.parametrize("seed", range(40))
def test_the_bulk_sizing_and_splitting_match_one_rank_at_a_time(seed):
    """``compute_chunk_batches_each`` and the final-window split give, bit for bit, what
    the per-rank paths give (ties and remainders too)."""
    rng = random.Random(seed)
    ws, bs = rng.randint(1, 12), rng.choice([1, 4])
    counts = [rng.choice([0, 1, 2, 3, 5, 8]) for _ in range(ws)]
    ranks = rng.sample(range(ws), rng.randint(1, ws))
    steps = [rng.randint(0, 6) for _ in ranks]
    budgets = [rng.choice([0, c, c + 2]) for c in (counts[r] for r in ranks)]
    shared = dict(remaining_samples=rng.choice([0, 3, 40, 400]) * bs, counts=counts, batch_size=bs,
                  barrier_paced=rng.random() < 0.5, calibrated=rng.random() < 0.5, total_samples=4000,
                  final_alloc=rng.choice([None, [rng.randint(0, 4) for _ in range(ws)]]))  # fmt: skip
    each = _chunk_pool.compute_chunk_batches_each(ranks, steps, budgets, counts_total=sum(counts), **shared)
    one = [_chunk_pool.compute_chunk_batches(r, steps=s, budget=b, counts_total=sum(counts), **shared)
           for r, s, b in zip(ranks, steps, budgets)]  # fmt: skip
    assert each == one

    alive = [rng.random() < 0.8 for _ in range(ws)]
    for rem in (1, 2, 5, 17):
        assert _chunk_pool.final_window_alloc(rem, counts, alive) == _old_final_window_alloc(rem, counts, alive)


def test_a_cadence_window_start_sizes_without_a_call_per_rank(monkeypatch):
    """The step that forms a Cadence world hands every rank its first window: it used to
    size each by two keyword calls (``compute_chunk_batches``, ``explain_chunk_batches``)."""
    calls = []
    real = _chunk_pool.explain_chunk_batches
    monkeypatch.setattr(_chunk_pool, "explain_chunk_batches", lambda *a, **k: calls.append(a) or real(*a, **k))
    c = Cluster(policy="cadence", world_size=16, total=16 * 64, batch_size=4, epochs=2)
    for r in range(16):
        c.hello(r)
    assert len(c.state.cadence.in_flight) == 16  # every rank got its window
    assert calls == []


@pytest.mark.parametrize("policy", ["cadence", "async"])
def test_a_round_asks_who_is_held_in_one_pass(policy, monkeypatch):
    """Who gets a window at a trigger (and, under Cadence, in its ``Update``) was one
    ``_held`` call per participant."""
    c = Cluster(policy=policy, world_size=12, total=12 * 64, batch_size=4, epochs=2)
    c.join_all()
    held = []
    real = _dispatcher._held
    monkeypatch.setattr(_dispatcher, "_held", lambda st, r: held.append(r) or real(st, r))
    rounds = c.state.rounds
    seen = {"trigger": 0, "finish": 0}
    while min(seen.values()) < 2:
        cycle, version = rounds.cycle, rounds.version
        held.clear()
        assert c.pump_once()
        for kind, moved in (("trigger", rounds.cycle != cycle), ("finish", rounds.version != version)):
            if moved:
                seen[kind] += 1
                assert len(held) < 12, (kind, held)  # the old code asked every participant (12)
