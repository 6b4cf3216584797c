"""Bus reducer: weighted mean, one division, deaths, refusals."""

import numpy as np
import pytest

from flodl.wire import pack_round, unpack_round
from flodl_coordinator.reducer import BusReducer, RoundRefused


def _contrib(value, weight, cycle=1, shape=(2, 2)):
    arr = np.full(shape, value * weight, dtype=np.float32)  # ranks pre-multiply by their mass
    return pack_round([arr], cycle=cycle, weight=weight)


def test_weighted_mean_divides_once_by_accepted_mass():
    red = BusReducer()
    assert red.open(1, [0, 1, 2]) is None
    assert red.contribute(0, *_contrib(1.0, 1.0)) is None
    assert red.contribute(1, *_contrib(4.0, 2.0)) is None
    res = red.contribute(2, *_contrib(10.0, 1.0))
    assert res.to == (0, 1, 2) and res.total_weight == 4.0
    out = unpack_round(res.header, res.blobs)[0]
    np.testing.assert_allclose(out, (1 * 1 + 4 * 2 + 10 * 1) / 4.0)
    assert list(res.header.contributing_ranks) == [0, 1, 2]


def test_dead_rank_mid_round_completes_with_survivors_and_excludes_its_tensors():
    red = BusReducer()
    red.open(7, [0, 1, 2])
    red.contribute(0, *_contrib(1.0, 1.0, cycle=7))
    red.contribute(2, *_contrib(100.0, 5.0, cycle=7))  # rank 2 sends, then dies
    assert red.drop(2) is None  # still waiting for rank 1
    res = red.contribute(1, *_contrib(3.0, 1.0, cycle=7))
    assert res.to == (0, 1) and res.total_weight == 2.0
    np.testing.assert_allclose(unpack_round(res.header, res.blobs)[0], 2.0)


def test_drop_of_the_last_missing_rank_finishes_the_round():
    red = BusReducer()
    red.open(1, [0, 1])
    red.contribute(0, *_contrib(2.0, 1.0))
    res = red.drop(1)
    assert res is not None and res.to == (0,)
    np.testing.assert_allclose(unpack_round(res.header, res.blobs)[0], 2.0)


def test_zero_total_mass_means_keep_local():
    red = BusReducer()
    red.open(1, [0, 1])
    red.contribute(0, *_contrib(1.0, 0.0))
    res = red.contribute(1, *_contrib(1.0, 0.0))
    assert res.total_weight == 0.0 and res.header.weight == 0.0
    assert all(t.elided for t in res.header.tensors)


@pytest.mark.parametrize(
    "setup, rank, cycle, match",
    [
        ("none", 0, 1, "open cycle is None"),
        ("open", 0, 2, "sent cycle 2, open cycle is 1"),
        ("open", 5, 1, "not expected"),
        ("dup", 0, 1, "already contributed"),
    ],
)
def test_refusals_name_the_cause(setup, rank, cycle, match):
    red = BusReducer()
    if setup in ("open", "dup"):
        red.open(1, [0, 1])
    if setup == "dup":
        red.contribute(0, *_contrib(1.0, 1.0))
    with pytest.raises(RoundRefused, match=match):
        red.contribute(rank, *_contrib(1.0, 1.0, cycle=cycle))


def test_shape_mismatch_is_refused():
    red = BusReducer()
    red.open(1, [0, 1, 2])
    red.contribute(0, *_contrib(1.0, 1.0, shape=(2, 2)))
    with pytest.raises(RoundRefused, match="shapes differ"):
        red.contribute(1, *_contrib(1.0, 1.0, shape=(3,)))


def test_bf16_consensus_is_within_bf16_precision():
    red = BusReducer(bf16_wire=True)
    red.open(1, [0])
    res = red.contribute(0, *_contrib(0.123456, 1.0))
    assert len(res.blobs[0]) == 4 * 2
    np.testing.assert_allclose(unpack_round(res.header, res.blobs)[0], 0.123456, rtol=2**-8)
