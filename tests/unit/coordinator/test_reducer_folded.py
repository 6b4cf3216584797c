"""Bus reducer with relay folding: folded frames credit their ranks, refusals name why,
a death after the fold left takes the whole frame out of the round without blocking it."""

import numpy as np
import pytest

from flodl.wire import bf16_to_f32, f32_to_bf16, pack_round, pb, unpack_round
from flodl_coordinator.folding import FoldPlan
from flodl_coordinator.reducer import BusReducer, RoundRefused

A, B = (b"relay-a",), (b"relay-b",)
# ranks 0, 1 behind relay a; 2, 3 behind relay b; 4 alone behind relay c; 5 dials directly
ROUTES = {0: (b"relay-a", b"r0"), 1: (b"relay-a", b"r1"), 2: (b"relay-b", b"r2"), 3: (b"relay-b", b"r3"),
          4: (b"relay-c", b"r4"), 5: (b"r5",)}  # fmt: skip


def opened(cycle=1, ranks=(0, 1, 2, 3), **kw) -> BusReducer:
    red = BusReducer(**kw)
    red.folds.open(cycle, ranks, ROUTES.get)
    assert red.open(cycle, ranks) is None
    return red


def folded(ranks, values, weights, cycle=1, shape=(2, 2), bf16=False):
    """What a relay sends: sum of value_r * w_r, weight = sum w_r, contributing_ranks."""
    total = sum(np.float32(v) * np.float32(w) for v, w in zip(values, weights))
    arr = np.full(shape, total, dtype=np.float32)
    return pack_round([arr], cycle=cycle, weight=float(sum(weights)), bf16=bf16, contributing_ranks=ranks)


def single(value, weight, cycle=1, shape=(2, 2)):
    return pack_round([np.full(shape, value * weight, dtype=np.float32)], cycle=cycle, weight=weight)


def mean(res):
    return float(unpack_round(res.header, res.blobs)[0][0, 0])


def test_plan_folds_relays_with_two_or_more_ranks_in_the_round():
    plan = FoldPlan()
    msgs = dict(plan.open(3, [0, 1, 2, 3, 4, 5], ROUTES.get))
    assert set(msgs) == {A, B}  # relay-c has one rank: nothing to fold; rank 5 has no relay
    assert list(msgs[A].fold_open.ranks) == [0, 1] and list(msgs[A].fold_open.identities) == [b"r0", b"r1"]
    assert msgs[A].fold_open.cycle == 3
    assert plan.relay_of(3, 0) == A and plan.relay_of(3, 4) is None and plan.relay_of(2, 0) is None
    relay, drop = plan.drop(3, 2)
    assert relay == B and (drop.fold_drop.cycle, drop.fold_drop.rank) == (3, 2)
    assert plan.drop(3, 5) is None and plan.drop(None, 0) is None


def test_folded_frames_credit_every_rank_they_name_and_divide_once():
    red = opened()
    assert red.contribute_folded(A, *folded([0, 1], [1.0, 4.0], [1.0, 2.0])) is None
    res = red.contribute_folded(B, *folded([2, 3], [10.0, 0.0], [1.0, 0.0]))
    assert res.to == res.contributors == (0, 1, 2, 3) and res.total_weight == 4.0 and res.excluded == ()
    assert mean(res) == pytest.approx((1 * 1 + 4 * 2 + 10 * 1) / 4.0)
    assert list(res.header.contributing_ranks) == [0, 1, 2, 3]
    assert red.folded_in == 2


def test_folded_and_unfolded_contributions_mix():
    red = opened(ranks=(0, 1, 4, 5))
    red.contribute(4, *single(3.0, 1.0))
    red.contribute(5, *single(5.0, 1.0))
    res = red.contribute_folded(A, *folded([0, 1], [1.0, 1.0], [1.0, 1.0]))
    assert res.contributors == (0, 1, 4, 5) and mean(res) == pytest.approx(2.5)


@pytest.mark.parametrize(
    "relay, ranks, cycle, match",
    [
        (A, [0, 1], 2, "sent cycle 2, open cycle is 1"),
        (A, [0, 2], 1, "does not fold rank 2"),  # rank 2 is relay b's
        (B, [0, 1], 1, "does not fold rank 0"),
        (A, [], 1, "names no contributing ranks"),
        (A, [0, 0], 1, "names a rank twice"),
        ((b"r5",), [5], 1, "does not fold rank 5"),  # a rank pretending to be a relay
    ],
)
def test_folded_refusals_name_the_cause(relay, ranks, cycle, match):
    red = opened(ranks=(0, 1, 2, 3, 5))
    with pytest.raises(RoundRefused, match=match):
        red.contribute_folded(relay, *folded(ranks, [1.0] * len(ranks), [1.0] * len(ranks), cycle=cycle))


def test_a_rank_counted_twice_is_refused_whichever_way_it_came():
    red = opened()
    red.contribute(0, *single(1.0, 1.0))  # rank 0's own frame (its relay did not fold it)
    with pytest.raises(RoundRefused, match="rank 0 already contributed"):
        red.contribute_folded(A, *folded([0, 1], [1.0, 1.0], [1.0, 1.0]))
    red = opened()
    red.contribute_folded(A, *folded([0, 1], [1.0, 1.0], [1.0, 1.0]))
    with pytest.raises(RoundRefused, match="rank 1 already contributed"):
        red.contribute(1, *single(1.0, 1.0))
    red = BusReducer()
    red.folds.open(1, [0, 1, 2, 3], ROUTES.get)
    red.open(1, [0, 2, 3])  # the plan and the round disagree: the reducer's set wins
    with pytest.raises(RoundRefused, match="rank 1 is not expected"):
        red.contribute_folded(A, *folded([0, 1], [1.0, 1.0], [1.0, 1.0]))


def test_death_mid_fold_excludes_nothing_else():
    """FoldDrop path: the rank died before its relay flushed; the relay sends the others."""
    red = opened()
    assert red.drop(1) is None
    red.contribute_folded(B, *folded([2, 3], [3.0, 3.0], [1.0, 1.0]))
    res = red.contribute_folded(A, *folded([0], [1.0], [1.0]))
    assert res.to == (0, 2, 3) and res.excluded == () and mean(res) == pytest.approx(7.0 / 3)


def test_death_after_the_fold_left_drops_the_whole_frame_and_does_not_block():
    """The race: the fold naming rank 1 is already on its way when rank 1 dies."""
    red = opened()
    red.contribute_folded(B, *folded([2, 3], [3.0, 5.0], [1.0, 1.0]))
    assert red.drop(1) is None  # before the frame arrives
    res = red.contribute_folded(A, *folded([0, 1], [100.0, 100.0], [1.0, 1.0]))
    assert res is not None, "the round must not wait for rank 0 once its frame is gone"
    assert res.contributors == (2, 3) and list(res.header.contributing_ranks) == [2, 3]
    assert res.excluded == (0,) and res.to == (0, 2, 3)  # rank 0 still gets it, keeps its weights
    assert res.total_weight == 2.0 and mean(res) == pytest.approx(4.0)
    assert red.folds_discarded == 1


def test_death_after_the_fold_was_accepted_removes_its_mass_and_tensors():
    red = opened()
    red.contribute_folded(A, *folded([0, 1], [100.0, 100.0], [1.0, 1.0]))
    assert red.drop(0) is None  # relay b still owes its frame
    with pytest.raises(RoundRefused, match="rank 1 is excluded"):
        red.contribute(1, *single(1.0, 1.0))
    res = red.contribute_folded(B, *folded([2, 3], [2.0, 4.0], [1.0, 1.0]))
    assert res.contributors == (2, 3) and res.excluded == (1,) and res.to == (1, 2, 3)
    assert mean(res) == pytest.approx(3.0)


def test_the_last_frame_discarded_finishes_the_round_with_zero_mass_when_nothing_is_left():
    red = opened(ranks=(0, 1, 2))  # rank 2 alone behind relay b: not folded
    assert red.drop(1) is None
    assert red.contribute_folded(A, *folded([0, 1], [1.0, 1.0], [1.0, 1.0])) is None  # the race
    res = red.drop(2)
    assert res is not None and res.contributors == () and res.excluded == (0,) and res.to == (0,)
    assert res.header.weight == 0.0  # keep local: nobody's work is in it


def test_bf16_halves_the_bytes_both_ways_and_accumulates_f32():
    """Same round, f32 vs bf16 on the wire: bytes in and out halve; the consensus differs
    from the exact f32 mean by at most bf16's half-ulp."""
    rng = np.random.default_rng(1)
    shape = (64, 32)
    ps = [rng.standard_normal(shape).astype(np.float32) for _ in range(4)]
    results = {}
    for bf16 in (False, True):
        red = BusReducer(bf16_wire=bf16)
        red.open(1, [0, 1, 2, 3])
        for r, p in enumerate(ps):
            res = red.contribute(r, *pack_round([p * np.float32(r + 1)], cycle=1, weight=r + 1.0, bf16=bf16))
        assert all(m.dtype == (pb.DTYPE_BF16 if bf16 else pb.DTYPE_F32) for m in res.header.tensors)
        results[bf16] = (red.bytes_in, red.bytes_out, unpack_round(res.header, res.blobs)[0])
    (in32, out32, c32), (in16, out16, c16) = results[False], results[True]
    assert (in16 * 2, out16 * 2) == (in32, out32)
    assert in32 == 4 * 64 * 32 * 4 and out32 == 4 * 64 * 32 * 4
    np.testing.assert_allclose(c16, c32, atol=float(np.abs(c32).max()) * 2**-6)  # inputs rounded too
    # Accumulated in f32 from what arrived, divided once, rounded to bf16 once at the end.
    arrived = [bf16_to_f32(f32_to_bf16(p * np.float32(r + 1))) for r, p in enumerate(ps)]
    acc = arrived[0].copy()
    for a in arrived[1:]:
        acc += a
    acc /= np.float32(10.0)
    np.testing.assert_array_equal(c16, bf16_to_f32(f32_to_bf16(acc)))


def test_fan_out_one_copy_per_folding_relay_and_bytes_out_counts_copies():
    """Ranks whose work came through a relay's fold get the consensus via that relay, once;
    a relay left with one rank in ``to``, and unfolded ranks, get their own copies."""
    red = opened(ranks=(0, 1, 2, 3, 5))
    assert red.contribute_folded(A, *folded([0, 1], [1.0, 1.0], [1.0, 1.0])) is None
    assert red.contribute(2, *single(1.0, 1.0)) is None  # relay b forwarded rank 2 unfolded (--no-fold)
    assert red.contribute(3, *single(1.0, 1.0)) is None
    res = red.contribute(5, *single(1.0, 1.0))
    assert res.fanout == ((A, (0, 1)),) and res.direct == (2, 3, 5)
    per_copy = sum(len(b) for b in res.blobs)
    assert red.bytes_out == per_copy * 4  # 1 fan-out + 3 direct, not 5
    h = res.relay_header((0, 1))
    assert list(h.deliver_to) == [0, 1] and list(res.header.deliver_to) == []  # the shared header is untouched
    assert list(h.contributing_ranks) == list(res.header.contributing_ranks) and h.cycle == res.header.cycle

    # 2 ranks per relay, both folding: bytes out halve.
    red = opened()
    red.contribute_folded(A, *folded([0, 1], [1.0, 1.0], [1.0, 1.0]))
    res = red.contribute_folded(B, *folded([2, 3], [1.0, 1.0], [1.0, 1.0]))
    assert res.fanout == ((A, (0, 1)), (B, (2, 3))) and res.direct == ()
    assert red.bytes_out == sum(len(b) for b in res.blobs) * 2


def test_fan_out_leaves_out_the_dead_and_keeps_the_excluded():
    red = opened(ranks=(0, 1, 2, 3), cycle=2)
    assert red.contribute_folded(B, *folded([2, 3], [1.0, 1.0], [1.0, 1.0], cycle=2)) is None
    res = red.drop(3)  # rank 3 dies after relay b's fold left: 2 is excluded, alone on b
    assert res is None
    res = red.contribute_folded(A, *folded([0, 1], [1.0, 1.0], [1.0, 1.0], cycle=2))
    assert res.to == (0, 1, 2) and res.excluded == (2,)
    assert res.fanout == ((A, (0, 1)),) and res.direct == (2,)
