"""flodl_worker.collective against real gloo process groups, in one process.

Three ``CollectiveAverager``s over test doubles of the rank runtime; the test plays the
coordinator (``Rendezvous``, ``RequestParams``). Group formation runs in the averagers'
own threads and the all-reduce is asynchronous, so one test thread drives them all:
every wait below is ``wait()`` polled against a deadline, never a sleep.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import zmq

from flodl.rank import Admitted, BatchTrained, ControlReceived, RankMachine
from flodl.wire import pb
from flodl_worker.collective import CollectiveAverager
from flodl_worker.shell import MachineShell

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

DEADLINE_S = 60.0  # thread start + gloo rendezvous on a loaded machine: seconds


class FakeRank(MachineShell):
    """What the averager uses of ``flodl_worker.rank._Rank``: the rank machine and the shell."""

    def __init__(self, ctx, rank: int, params: list[np.ndarray], steps: int, gamma: float = 1.0, buffers=()):
        self.cfg = SimpleNamespace(rank=rank, store_host="127.0.0.1", fault_exit_cycle=None)
        self.spec = pb.RunSpec(gamma=gamma, policy=pb.POLICY_CADENCE, plane=pb.PLANE_COLLECTIVE, total_samples=1)
        self.params = [torch.nn.Parameter(torch.from_numpy(a.copy())) for a in params]
        self.buffers = [torch.from_numpy(b.copy()) for b in buffers]  # f32 buffers (BN running stats)
        self.m = RankMachine(rank)
        self.m.handle(Admitted(spec=self.spec))
        for _ in range(steps):
            self.m.handle(BatchTrained(epoch=0, offset=0, samples=1))
        self.sock = ctx.socket(zmq.PULL)  # polled alongside the wake-up fd; never readable
        self.sock.bind(f"inproc://fake-rank-{id(self)}")
        self.applied: list[int] = []
        self.timings: list[tuple[str, object]] = []
        self.averager = None  # set by _cluster

    @property
    def local_step(self) -> int:
        return self.m.local_step

    @property
    def steps_since_avg(self) -> int:
        return self.m.steps_since_avg

    def consensus_ready(self, cycle, arrays):
        super().consensus_ready(cycle, arrays)
        self.applied.append(cycle)

    def _timing(self, **event):
        ((kind, msg),) = event.items()
        self.timings.append((kind, msg))

    def _drop(self, reason, detail):
        raise AssertionError(f"dropped: {reason}: {detail}")

    def got(self, kind):
        return [m for k, m in self.timings if k == kind]

    def step(self, delta: float) -> None:
        """One local optimizer step: every parameter moves by ``delta``."""
        with torch.no_grad():
            for p in self.params:
                p.add_(delta)
        self.m.handle(BatchTrained(epoch=0, offset=0, samples=1))


@pytest.fixture
def ctx():
    c = zmq.Context()
    yield c
    c.term()


def _params(seed: int) -> list[np.ndarray]:
    g = np.random.default_rng(seed)
    return [g.standard_normal((3, 4)).astype(np.float32), g.standard_normal(5).astype(np.float32)]


def _cluster(ctx, steps, gamma=1.0, buffers=None):
    ranks = [
        FakeRank(ctx, r, _params(r), n, gamma, buffers(r) if buffers else ()) for r, n in enumerate(steps)
    ]
    avs = [CollectiveAverager(r) for r in ranks]
    for r, av in zip(ranks, avs):
        r.averager = r.collective = av
    return ranks, avs


def _request(av, cycle):
    """The coordinator's RequestParams{cycle}, through the rank machine."""
    av.rank.feed(ControlReceived(control=pb.Control(request_params=pb.Control.RequestParams(cycle=cycle))))


def _until(avs, done, what):
    deadline = time.monotonic() + DEADLINE_S
    while not done():
        if time.monotonic() > deadline:
            raise AssertionError(f"never: {what}")
        for av in avs:
            av.wait(5)


def _form(ranks, avs, generation, members, *, timeout_s=30.0, seed_ranks=(), seed_cycle=0):
    """Announce ``generation`` to ``members`` (global indices, store host first), answer
    the store host's StoreReady with the address: the test is the coordinator."""
    size = len(members)
    seed = dict(seed_ranks=seed_ranks, seed_cycle=seed_cycle)
    for i, m in enumerate(members):
        avs[m].on_rendezvous(
            pb.Control.Rendezvous(generation=generation, new_rank=i, new_world_size=size, backend="gloo",
                                  timeout_s=timeout_s, **seed)  # fmt: skip
        )
    host = ranks[members[0]]
    ready = [s for s in host.got("store_ready") if s.generation == generation]
    assert len(ready) == 1 and ready[0].addr.startswith("127.0.0.1:")
    for i, m in enumerate(members):
        avs[m].on_rendezvous(
            pb.Control.Rendezvous(
                generation=generation, store_addr=ready[0].addr, new_rank=i, new_world_size=size,
                backend="gloo", timeout_s=timeout_s, **seed,
            )
        )  # fmt: skip


def _acks(rank, cycle):
    return [a for a in rank.got("sync_ack") if a.cycle == cycle]


def _close(avs):
    for av in avs:
        av.close()
        av.rank.sock.close(0)


def test_consensus_is_the_work_weighted_average_and_steps_since_the_snapshot_are_kept(ctx):
    ranks, avs = _cluster(ctx, steps=[1, 2, 3])
    try:
        _form(ranks, avs, 1, [0, 1, 2])
        before = [[p.detach().numpy().copy() for p in r.params] for r in ranks]
        # The request comes before the group has formed: it waits for it (queued).
        for av in avs:
            _request(av, 1)
        ranks[1].step(0.5)  # rank 1 trains on while the reduce is in flight
        _until(avs, lambda: all(_acks(r, 1) for r in ranks), "cycle 1 acked everywhere")
        w = np.array([1.0, 2.0, 3.0])
        want = [sum(w[r] * before[r][i] for r in range(3)) / w.sum() for i in range(2)]
        for r in ranks:
            (ack,) = _acks(r, 1)
            assert ack.step_count == [1, 2, 3][r.cfg.rank]  # the snapshot's step: its work is in
            assert r.applied == [1]
            expect = [x + (0.5 if r.cfg.rank == 1 else 0.0) for x in want]
            for p, e in zip(r.params, expect):
                np.testing.assert_allclose(p.detach().numpy(), e, rtol=1e-5, atol=1e-6)
        assert ranks[1].steps_since_avg == 1 and ranks[0].steps_since_avg == 0  # credit of the overlap kept
        # Every rank divided the same reduced sum by the same total: bit-identical consensus.
        a, c = (np.concatenate([p.detach().numpy().ravel() for p in r.params]) for r in (ranks[0], ranks[2]))
        assert a.tobytes() == c.tobytes()
        # An idle rank (n = 0, weight 0) contributes nothing and adopts the consensus.
        ranks[0].step(1.0)
        ranks[2].step(-1.0)
        before = [[p.detach().numpy().copy() for p in r.params] for r in ranks]
        for av in avs:
            _request(av, 2)
        _until(avs, lambda: all(_acks(r, 2) for r in ranks), "cycle 2 acked everywhere")
        w = np.array([1.0, 1.0, 1.0])  # rank 1: the overlap step; ranks 0, 2: one step each
        want = [sum(w[r] * before[r][i] for r in range(3)) / 3.0 for i in range(2)]
        for r in ranks:
            for p, e in zip(r.params, want):
                np.testing.assert_allclose(p.detach().numpy(), e, rtol=1e-5, atol=1e-6)
        assert all(av.stats.reduced == 2 for av in avs)
    finally:
        _close(avs)


def test_f32_buffers_are_an_equal_weight_mean_over_the_ranks_that_moved(ctx):
    # gamma 1, steps 1/3/0: the parameters are work-weighted, the buffers are not; the
    # idle rank 2 neither counts in the buffers' mean nor keeps its own.
    bufs = lambda r: [np.full(4, float(r + 1) * 10, np.float32), np.full((2, 2), float(r), np.float32)]  # noqa: E731
    ranks, avs = _cluster(ctx, steps=[1, 3, 0], buffers=bufs)
    try:
        _form(ranks, avs, 1, [0, 1, 2])
        for av in avs:
            _request(av, 1)
        _until(avs, lambda: all(_acks(r, 1) for r in ranks), "cycle 1 acked everywhere")
        for r in ranks:
            np.testing.assert_allclose(r.buffers[0].numpy(), np.full(4, 15.0))  # (10 + 20) / 2, not (10 + 60) / 4
            np.testing.assert_allclose(r.buffers[1].numpy(), np.full((2, 2), 0.5))
        want = [(1.0 * _params(0)[i] + 3.0 * _params(1)[i]) / 4.0 for i in range(2)]
        for p, e in zip(ranks[2].params, want):
            np.testing.assert_allclose(p.detach().numpy(), e, rtol=1e-5, atol=1e-6)
        assert ranks[0].buffers[0].numpy().tobytes() == ranks[2].buffers[0].numpy().tobytes()
    finally:
        _close(avs)


def test_nobody_stepped_keeps_local_parameters(ctx):
    ranks, avs = _cluster(ctx, steps=[0, 0])
    try:
        _form(ranks, avs, 1, [0, 1])
        before = [[p.detach().numpy().copy() for p in r.params] for r in ranks]
        for av in avs:
            _request(av, 1)
        _until(avs, lambda: all(_acks(r, 1) for r in ranks), "acked")
        for r, b in zip(ranks, before):
            assert _acks(r, 1)[0].step_count == 0
            for p, x in zip(r.params, b):
                assert np.array_equal(p.detach().numpy(), x)
    finally:
        _close(avs)


def test_a_newer_generation_abandons_a_pending_reduce_and_the_survivors_reform(ctx):
    ranks, avs = _cluster(ctx, steps=[2, 4, 6])
    try:
        _form(ranks, avs, 1, [0, 1, 2])
        _until(avs, lambda: all(av.gen.group is not None for av in avs), "generation 1 formed")
        before = [[p.detach().numpy().copy() for p in r.params] for r in ranks[:2]]
        _request(avs[0], 1)
        _request(avs[1], 1)  # rank 2 hangs: it never joins the all-reduce of cycle 1
        for av in avs[:2]:
            av.wait(0)
        assert all(len(av.ops) == 1 for av in avs[:2]) and not _acks(ranks[0], 1)
        # The coordinator declared rank 2 dead: generation 2 among the survivors.
        _form(ranks, avs, 2, [0, 1])
        for r, b in zip(ranks[:2], before):
            (ack,) = _acks(r, 1)
            assert ack.step_count == 0  # nothing new committed: its work is in no consensus
            for p, x in zip(r.params, b):
                assert np.array_equal(p.detach().numpy(), x)  # local parameters kept
            assert r.steps_since_avg == [2, 4][r.cfg.rank]  # and the credit
        assert all(av.stats.abandoned == 1 and len(av.parked) == 1 for av in avs[:2])
        assert not ranks[0].got("collective_failed")  # abandoned, not failed: nothing to report
        for av in avs[:2]:
            _request(av, 2)
        _until(avs[:2], lambda: all(_acks(r, 2) for r in ranks[:2]), "cycle 2 in generation 2")
        want = [(2 * before[0][i] + 4 * before[1][i]) / 6 for i in range(2)]
        for r in ranks[:2]:
            assert _acks(r, 2)[0].step_count == [2, 4][r.cfg.rank]
            for p, e in zip(r.params, want):
                np.testing.assert_allclose(p.detach().numpy(), e, rtol=1e-5, atol=1e-6)
    finally:
        _close(avs)  # the abandoned gloo work is still pending: leaked, not waited for


def test_a_coordinator_restart_abandons_pending_reduces_without_acks_and_a_new_generation_reduces(ctx):
    """The old coordinator's RequestParams(1) reached ranks 0 and 1, not rank 2 (it died
    with the process): their reduce can never complete in generation 1. On the restart
    (the rank's resync) it is dropped without an ack, with its snapshot and the credit
    kept; rank 2's queued request too. Generation 2 then reduces everyone's work."""
    ranks, avs = _cluster(ctx, steps=[2, 4, 6])
    try:
        _form(ranks, avs, 1, [0, 1, 2])
        _until(avs, lambda: all(av.gen.group is not None for av in avs), "generation 1 formed")
        before = [[p.detach().numpy().copy() for p in r.params] for r in ranks]
        _request(avs[0], 1)
        _request(avs[1], 1)
        for av in avs[:2]:
            av.wait(0)
        assert all(len(av.ops) == 1 for av in avs[:2])
        assert [av.on_coordinator_restart() for av in avs] == [1, 1, 0]
        for r, av, b in zip(ranks, avs, before):
            assert not r.got("sync_ack") and not av.snapshots and not av.ops and not av.requests
            assert r.steps_since_avg == [2, 4, 6][r.cfg.rank]
            for p, x in zip(r.params, b):
                assert np.array_equal(p.detach().numpy(), x)
        assert [len(av.parked) for av in avs] == [1, 1, 0]
        _form(ranks, avs, 2, [0, 1, 2])  # the restarted coordinator's new generation
        for av in avs:
            _request(av, 2)
        _until(avs, lambda: all(_acks(r, 2) for r in ranks), "cycle 2 in generation 2")
        assert not any(_acks(r, 1) for r in ranks)  # the dead round is never acked
        want = [(2 * before[0][i] + 4 * before[1][i] + 6 * before[2][i]) / 12 for i in range(2)]
        for r in ranks:
            assert _acks(r, 2)[0].step_count == [2, 4, 6][r.cfg.rank]
            for p, e in zip(r.params, want):
                np.testing.assert_allclose(p.detach().numpy(), e, rtol=1e-5, atol=1e-6)
    finally:
        _close(avs)  # generation 1's abandoned work is still pending: leaked, not waited for


def test_a_coordinator_restart_applies_a_reduce_that_already_completed(ctx):
    ranks, avs = _cluster(ctx, steps=[1, 3])
    try:
        _form(ranks, avs, 1, [0, 1])
        _until(avs, lambda: all(av.gen.group is not None for av in avs), "generation 1 formed")
        for av in avs:
            _request(av, 1)
        # Completed (both launched, gloo finishes it in its threads) but not yet handled
        # by rank 0's pump: its reduce could not finish before rank 1 launched. Rank 1's
        # launch may find it done at once and apply it then (a race gloo decides).
        assert len(avs[0].ops) == 1
        for av in avs:
            if av.ops:
                av.ops[0].future.wait()
        assert [av.on_coordinator_restart() for av in avs] == [0, 0]
        for r, av in zip(ranks, avs):
            (ack,) = _acks(r, 1)
            assert ack.step_count == r.local_step and av.folded_step == r.local_step
            assert r.steps_since_avg == 0
    finally:
        _close(avs)


def test_a_request_of_a_replaced_generation_is_acked_without_a_reduce(ctx):
    ranks, avs = _cluster(ctx, steps=[3])
    try:
        avs[0].on_rendezvous(pb.Control.Rendezvous(generation=1, new_rank=0, new_world_size=1, backend="gloo", timeout_s=30))
        _request(avs[0], 1)  # bound to generation 1, whose group never formed
        avs[0].on_rendezvous(pb.Control.Rendezvous(generation=2, new_rank=0, new_world_size=1, backend="gloo", timeout_s=30))
        (ack,) = _acks(ranks[0], 1)
        assert ack.step_count == 0 and avs[0].stats.skipped == 1
        # A stale rendezvous (generation 1 again) is ignored.
        avs[0].on_rendezvous(pb.Control.Rendezvous(generation=1, new_rank=0, new_world_size=1, backend="gloo", timeout_s=30))
        assert avs[0].gen.number == 2
        # The store host answers StoreReady once per generation, from the store it already runs.
        addrs = [s.addr for s in ranks[0].got("store_ready")]
        assert [s.generation for s in ranks[0].got("store_ready")] == [1, 2] and addrs[0] == addrs[1]
    finally:
        _close(avs)


def test_a_reduce_that_times_out_is_reported_and_acked_without_a_reduce(ctx):
    ranks, avs = _cluster(ctx, steps=[1, 1])
    try:
        _form(ranks, avs, 1, [0, 1], timeout_s=1.0)
        _until(avs, lambda: all(av.gen.group is not None for av in avs), "formed")
        _request(avs[0], 5)  # rank 1 never joins: gloo gives up after 1 s
        _until(avs[:1], lambda: _acks(ranks[0], 5), "the timed-out reduce acked")
        assert _acks(ranks[0], 5)[0].step_count == 0
        (failed,) = ranks[0].got("collective_failed")
        assert (failed.generation, failed.cycle) == (1, 5) and failed.reason
        assert avs[0].gen.broken and avs[0].stats.failed == 1
        _request(avs[0], 6)  # the broken group is never used again
        assert _acks(ranks[0], 6)[0].step_count == 0
    finally:
        _close(avs)


def test_a_finished_reduce_wakes_a_blocked_wait(ctx):
    # Rank 0 blocks in its pump (throttled, waiting for a plan) with a long timeout while
    # rank 1 joins the reduce from another thread: the completion must wake rank 0 and be
    # handled then, not at the next timeout. A missing (or too early) wake-up shows as no
    # ack after that one wait (the poll would have run out its 30 s).
    import threading

    ranks, avs = _cluster(ctx, steps=[1, 3])
    try:
        _form(ranks, avs, 1, [0, 1])
        _until(avs, lambda: all(av.gen.group is not None for av in avs), "formed")
        _request(avs[0], 1)
        assert len(avs[0].ops) == 1  # launched; it cannot finish before rank 1 joins

        def rank1():
            _request(avs[1], 1)
            _until([avs[1]], lambda: _acks(ranks[1], 1), "rank 1 acked")

        t = threading.Thread(target=rank1)
        t.start()
        assert avs[0].wait(30_000) is False  # woken by the reduce, not by the socket
        t.join()
        assert len(_acks(ranks[0], 1)) == 1 and len(_acks(ranks[1], 1)) == 1
    finally:
        _close(avs)


def test_a_joiner_is_seeded_by_the_new_generations_broadcast_then_all_reduces_with_the_members(ctx):
    """Generation 2 adds rank 2, joining the running world (``seed_ranks``): the group's
    first collective broadcasts rank 0's live parameters and f32 buffers; the joiner loads
    them and says so (``seeded``); rank 1 relays and keeps its own; then a round reduces
    all three (the broadcast came first on every member: gloo pairs ops by order)."""
    bufs = lambda r: [np.full(3, float(r + 1), np.float32)]  # noqa: E731
    ranks, avs = _cluster(ctx, steps=[2, 2, 0], buffers=bufs)
    joiner = ranks[2]
    joiner.spec = pb.RunSpec(gamma=1.0, policy=pb.POLICY_CADENCE, plane=pb.PLANE_COLLECTIVE, total_samples=1,
                             join_running=True)  # fmt: skip
    joiner.m = RankMachine(2)
    joiner.m.handle(Admitted(spec=joiner.spec))
    try:
        _form(ranks, avs, 1, [0, 1])
        _until(avs[:2], lambda: all(av.gen.group is not None for av in avs[:2]), "generation 1 formed")
        ranks[0].step(0.25)  # the source trained since: the joiner gets its parameters now, not a consensus
        source = [p.detach().numpy().copy() for p in ranks[0].params]
        own = [p.detach().numpy().copy() for p in ranks[1].params]
        _form(ranks, avs, 2, [0, 1, 2], seed_ranks=[2], seed_cycle=7)
        _until(avs, lambda: bool(joiner.got("seeded")), "the joiner seeded")
        (seeded,) = joiner.got("seeded")
        assert seeded.cycle == 7 and not joiner.m.awaiting_seed and avs[2].stats.seeded
        for p, x in zip(joiner.params, source):
            assert np.array_equal(p.detach().numpy(), x)
        assert np.array_equal(joiner.buffers[0].numpy(), np.full(3, 1.0, np.float32))  # rank 0's
        for p, x in zip(ranks[1].params, own):
            assert np.array_equal(p.detach().numpy(), x)  # a member relays the seed, keeps its own
        assert not ranks[0].got("seeded") and not ranks[1].got("seeded")
        total = sum(a.size for a in _params(0)) + 3
        _until(avs, lambda: all(av.stats.seed_broadcasts == 1 for av in avs), "every member saw the broadcast end")
        assert all(av.stats.seed_bytes == 4 * total for av in avs)
        joiner.step(1.0)
        for av in avs:
            _request(av, 1)
        _until(avs, lambda: all(_acks(r, 1) for r in ranks), "cycle 1 reduced by the three")
        a, c = (np.concatenate([p.detach().numpy().ravel() for p in r.params]) for r in (ranks[0], ranks[2]))
        assert a.tobytes() == c.tobytes() and all(av.stats.reduced == 1 for av in avs)
    finally:
        _close(avs)


def test_a_failed_seed_broadcast_is_reported_as_seeding(ctx):
    ranks, avs = _cluster(ctx, steps=[1, 0])
    try:
        # A group of one seeding rank 1 (not a member here): the broadcast completes alone;
        # then its gloo work is made to have raised, as when a peer's connection closed.
        _form(ranks, avs, 1, [0], seed_ranks=[1])
        _until(avs[:1], lambda: avs[0].stats.seed_broadcasts == 1, "the lone broadcast")
        assert not ranks[0].got("collective_failed") and not ranks[0].got("seeded")  # rank 0 is no joiner
        avs[0]._seeded(_FailedSeed(avs[0].gen.number))
        (failed,) = ranks[0].got("collective_failed")
        assert failed.seeding and failed.cycle == 0 and "Connection closed by peer" in failed.reason
        assert avs[0].gen.broken  # the group is not used again: the coordinator re-forms
    finally:
        _close(avs)


class _FailedSeed:
    """A seed broadcast whose gloo work raised (a peer's connection closed)."""

    def __init__(self, generation):
        self.generation, self.cycle, self.load = generation, 0, False
        self.future = SimpleNamespace(value=self._raise, done=lambda: True)

    @staticmethod
    def _raise():
        raise RuntimeError("Connection closed by peer")
