"""Issue 9, items 6-8: nothing lost quietly, nothing forged.

A refused contribution leaves the round at once (no stall), a weight its steps do not
explain is refused (plain and folded), a point too far from the last consensus is
refused, and a consensus that is not finite is never sent."""

import numpy as np
import pytest

from flodl.wire import pack_round, unpack_round
from flodl_coordinator.reducer import BusReducer, RoundRefused, mass_bracket

A = (b"relay-a",)
ROUTES = {0: (b"relay-a", b"r0"), 1: (b"relay-a", b"r1"), 2: (b"r2",)}


def _contrib(value, weight, cycle=1, shape=(2, 2)):
    arr = np.full(shape, np.float32(value) * np.float32(weight), dtype=np.float32)
    return pack_round([arr], cycle=cycle, weight=weight)


def _nan(weight=1.0, cycle=1, shape=(2, 2)):
    header, blobs = _contrib(1.0, weight, cycle, shape)
    arr = np.full(shape, np.nan, dtype=np.float32)
    blobs = [arr.tobytes()]
    return header, blobs


def _mean(res):
    return unpack_round(res.header, res.blobs)[0]


# -- item 6: a refused contribution leaves the round at once ---------------------------


def test_a_non_finite_contribution_leaves_the_round_and_the_others_complete_it():
    red = BusReducer()
    red.open(1, [0, 1, 2])
    assert red.contribute(0, *_contrib(1.0, 1.0)) is None
    with pytest.raises(RoundRefused) as e:
        red.contribute(1, *_nan())
    assert e.value.ranks == (1,) and e.value.code == "non_finite"
    assert red.settle() is None  # rank 2 is still due
    res = red.contribute(2, *_contrib(3.0, 1.0))
    assert res is not None and res.to == (0, 1, 2) and res.contributors == (0, 2)
    np.testing.assert_allclose(_mean(res), 2.0)
    assert [(r, code) for r, code, _ in res.refused] == [(1, "non_finite")]
    # The refused rank is sent the consensus to reset to; the others the shared header.
    assert list(res.header.contributing_ranks) == [0, 2]
    assert res.header_for(0) is res.header
    own = res.header_for(1)
    assert list(own.contributing_ranks) == [] and own.weight == res.header.weight and own.cycle == 1
    # As sent: the shared header's bytes, written once for all; the refused rank's own header.
    shared = res.wire_for(0)
    assert shared == res.header.SerializeToString() and res.wire_for(2) is shared
    assert list(res.wire_for(1).contributing_ranks) == []
    assert red.refused_frames == 1


def test_a_refused_last_contribution_completes_the_round_on_settle():
    red = BusReducer()
    red.open(4, [0, 1])
    red.contribute(0, *_contrib(2.0, 1.0, cycle=4))
    with pytest.raises(RoundRefused) as e:
        red.contribute(1, *_contrib(1.0, 1.0, cycle=4, shape=(3,)))  # not the cohort's shapes
    assert e.value.ranks == (1,) and e.value.code == "shape"
    res = red.settle()
    assert res is not None and res.to == (0, 1) and res.contributors == (0,)
    np.testing.assert_allclose(_mean(res), 2.0)
    with pytest.raises(RoundRefused, match="open cycle is None") as again:
        red.contribute(1, *_contrib(1.0, 1.0, cycle=4))
    assert again.value.ranks == ()  # late: benign, no rank leaves anything


def test_a_late_or_duplicate_frame_is_not_a_refused_contribution():
    red = BusReducer()
    red.open(2, [0, 1])
    with pytest.raises(RoundRefused) as e:
        red.contribute(0, *_nan(cycle=1))  # an old cycle: not this round's
    assert e.value.ranks == ()
    red.contribute(0, *_contrib(1.0, 1.0, cycle=2))
    with pytest.raises(RoundRefused) as dup:
        red.contribute(0, *_nan(cycle=2))
    assert dup.value.ranks == ()
    res = red.contribute(1, *_contrib(3.0, 1.0, cycle=2))
    assert res.refused == () and res.contributors == (0, 1)


def test_a_rank_that_dies_after_its_refusal_is_not_sent_the_consensus():
    red = BusReducer()
    red.open(1, [0, 1, 2])
    red.contribute(0, *_contrib(1.0, 1.0))
    with pytest.raises(RoundRefused):
        red.contribute(1, *_nan())
    red.drop(1)
    res = red.contribute(2, *_contrib(1.0, 1.0))
    assert res.to == (0, 2) and res.refused == ()


# -- item 7: the coordinator's weight -------------------------------------------------------


def _weighed(seen, floor, gamma=1.0, **kw):
    red = BusReducer(steps_seen=seen.get, gamma=gamma, **kw)
    ranks = sorted(floor)
    red.folds.open(1, ranks, ROUTES.get)
    red.open(1, ranks, [floor[r] for r in ranks])
    return red


def test_a_forged_weight_is_refused_and_cannot_take_over_the_consensus():
    red = _weighed(seen={0: 4, 2: 4}, floor={0: 4, 2: 4})
    red.contribute(0, *_contrib(1.0, 4.0))
    with pytest.raises(RoundRefused, match="claimed weight 1e[+]09") as e:
        red.contribute(2, *_contrib(0.0, 1e9))  # zeros, weighted 1e9
    assert e.value.ranks == (2,) and e.value.code == "weight"
    res = red.settle()
    np.testing.assert_allclose(_mean(res), 1.0)  # rank 0's point, not zeros
    assert res.total_weight == 4.0 and res.contributors == (0,)


@pytest.mark.parametrize("gamma", [1.0, 0.5])
def test_honest_weights_inside_the_step_bracket_are_accepted(gamma):
    # The rank snapshotted after the trigger (3 steps then) and before its 5th step's
    # report: any n in 3..5 is honest.
    red = _weighed(seen={0: 5, 2: 3}, floor={0: 3, 2: 3}, gamma=gamma)
    red.contribute(0, *_contrib(1.0, 4.0**gamma))
    res = red.contribute(2, *_contrib(4.0, 3.0**gamma))
    assert res is not None and res.refused == ()
    assert res.total_weight == pytest.approx(4.0**gamma + 3.0**gamma)


@pytest.mark.parametrize("claimed", [0.0, 2.0, 6.0])
def test_a_weight_outside_the_bracket_is_refused(claimed):
    red = _weighed(seen={0: 5, 2: 3}, floor={0: 3, 2: 3})
    with pytest.raises(RoundRefused) as e:
        red.contribute(0, *_contrib(1.0, claimed))  # 0: its work would be committed unsummed
    assert e.value.code == "weight"


def test_a_folded_frame_must_weigh_the_sum_of_its_ranks_masses():
    honest = _weighed(seen={0: 2, 1: 3, 2: 1}, floor={0: 2, 1: 3, 2: 1})
    assert honest.contribute_folded(A, *_folded((0, 1), 5.0)) is None
    assert honest.contribute(2, *_contrib(1.0, 1.0)).refused == ()

    forged = _weighed(seen={0: 2, 1: 3, 2: 1}, floor={0: 2, 1: 3, 2: 1})
    with pytest.raises(RoundRefused) as e:
        forged.contribute_folded(A, *_folded((0, 1), 50.0))
    assert e.value.ranks == (0, 1) and e.value.code == "weight"
    res = forged.contribute(2, *_contrib(7.0, 1.0))
    assert res.contributors == (2,) and res.to == (0, 1, 2)
    assert [r for r, _, _ in res.refused] == [0, 1]
    assert res.fanout == ()  # refused ranks get their own copy (header_for), never the relay's
    np.testing.assert_allclose(_mean(res), 7.0)


def _folded(ranks, weight, value=1.0):
    arr = np.full((2, 2), np.float32(value) * np.float32(weight), dtype=np.float32)
    return pack_round([arr], cycle=1, weight=weight, contributing_ranks=ranks)


def test_mass_bracket_covers_every_honest_n():
    for gamma in (1.0, 0.5, 2.0, 0.0, -1.0):
        for floor in range(0, 4):
            for ceiling in range(floor, 6):
                lo, hi = mass_bracket(floor, ceiling, gamma)
                for n in range(floor, ceiling + 1):
                    m = 0.0 if n == 0 else float(n) ** gamma
                    assert lo - 1e-12 <= m <= hi + 1e-12, (gamma, floor, ceiling, n)


# -- item 8: finite but absurd ----------------------------------------------------------


def test_a_contribution_far_from_the_last_consensus_is_refused():
    red = BusReducer(max_contribution_ratio=10.0)
    red.open(1, [0, 1])
    red.contribute(0, *_contrib(1.0, 1.0))
    first = red.contribute(1, *_contrib(1.0, 1.0))
    np.testing.assert_allclose(_mean(first), 1.0)
    red.open(2, [0, 1])
    red.contribute(0, *_contrib(1.5, 1.0, cycle=2))
    res = red.contribute(1, *_contrib(3e38, 1.0, cycle=2))  # finite, absurd
    assert [(r, code) for r, code, _ in res.refused] == [(1, "too_far")]
    assert res.contributors == (0,) and res.to == (0, 1)
    np.testing.assert_allclose(_mean(res), 1.5)
    assert np.isfinite(_mean(res)).all()


def test_the_ratio_bound_is_relative_to_the_consensus_norm():
    # ||c|| = 2 * 100 (2x2 of 100): a move of 10 * 200 is allowed, one beyond is not.
    red = BusReducer(max_contribution_ratio=10.0)
    red.open(1, [0])
    red.contribute(0, *_contrib(100.0, 1.0))
    red.open(2, [0, 1])
    red.contribute(0, *_contrib(100.0 + 999.0, 1.0, cycle=2))  # ||x - c|| = 1998 <= 2000
    res = red.contribute(1, *_contrib(100.0 + 1001.0, 1.0, cycle=2))  # 2002 > 2000
    assert [r for r, _, _ in res.refused] == [1]


def test_the_first_round_compares_to_the_median_of_three_or_more():
    red = BusReducer(max_contribution_ratio=10.0)
    red.open(1, [0, 1, 2])
    red.contribute(0, *_contrib(1.0, 1.0))
    red.contribute(1, *_contrib(1.2, 1.0))
    res = red.contribute(2, *_contrib(3e38, 1.0))
    assert [r for r, _, _ in res.refused] == [2]
    np.testing.assert_allclose(_mean(res), 1.1, rtol=1e-6)


def test_ratio_zero_disables_the_bound():
    red = BusReducer(max_contribution_ratio=0.0)
    red.open(1, [0, 1, 2])
    red.contribute(0, *_contrib(1.0, 1.0))
    red.contribute(1, *_contrib(1.0, 1.0))
    res = red.contribute(2, *_contrib(3e38, 1.0))
    assert res.refused == () and res.contributors == (0, 1, 2)


def test_a_non_finite_average_is_never_sent():
    red = BusReducer(max_contribution_ratio=0.0)
    red.open(1, [0, 1])
    red.contribute(0, *_contrib(3e38, 1.0))
    res = red.contribute(1, *_contrib(3e38, 1.0))  # each finite, the f32 sum overflows
    assert res.nonfinite and res.total_weight == 0.0 and res.header.weight == 0.0
    assert all(t.elided for t in res.header.tensors)  # weight 0: everyone keeps local
    assert red.nonfinite_rounds == 1


def test_a_round_whose_every_frame_is_refused_still_names_the_models_schema():
    # (a relay's folded frame forged by one rank takes all of its host's ranks out: the
    # round completes with no mass; the ranks must be able to read the answer, or they
    # drop it, never ack, and the run stalls)
    red = BusReducer()
    red.open(1, [0])
    red.contribute(0, *_contrib(1.0, 1.0, cycle=1, shape=(3, 2)))
    red.open(2, [0])
    with pytest.raises(RoundRefused):
        red.contribute(0, *_nan(cycle=2, shape=(3, 2)))
    res = red.settle()
    assert res is not None and res.total_weight == 0.0 and res.contributors == ()
    assert [tuple(t.shape) for t in res.header.tensors] == [(3, 2)]
    np.testing.assert_array_equal(_mean(res), np.zeros((3, 2), dtype=np.float32))


def test_a_refused_frame_that_decodes_sets_the_schema_of_a_first_round():
    red = BusReducer(steps_seen=lambda r: 2)
    red.open(1, [0], {0: 2})
    with pytest.raises(RoundRefused) as e:
        red.contribute(0, *_contrib(0.0, 1e9, cycle=1, shape=(4,)))
    assert e.value.code == "weight"
    res = red.settle()
    assert res.total_weight == 0.0 and [tuple(t.shape) for t in res.header.tensors] == [(4,)]
