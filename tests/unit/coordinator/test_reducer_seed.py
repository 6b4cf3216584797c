"""The bus reducer keeps its latest consensus as the seed a joining rank starts from."""

import numpy as np

from flodl.wire import pack_round, unpack_round
from flodl_coordinator.reducer import BusReducer


def _contrib(value, weight, cycle):
    return pack_round([np.full((3,), value * weight, dtype=np.float32)], cycle=cycle, weight=weight)


def test_the_seed_is_the_latest_consensus_marked_seed_for_no_round():
    red = BusReducer()
    assert red.seed_frame() is None  # no consensus yet: a joiner waits for the next one
    for cycle, (a, b) in ((1, (1.0, 3.0)), (2, (5.0, 7.0))):
        red.open(cycle, [0, 1])
        red.contribute(0, *_contrib(a, 1.0, cycle))
        res = red.contribute(1, *_contrib(b, 1.0, cycle))
        assert res is not None
    header, blobs = red.seed_frame()
    assert header.seed and header.cycle == 2 and list(header.contributing_ranks) == []
    np.testing.assert_allclose(unpack_round(header, blobs)[0], 6.0)  # the consensus of cycle 2
    assert red.seeds_sent == 1 and red.seed_bytes == sum(len(b) for b in blobs) > 0


def test_a_round_without_mass_leaves_the_previous_seed():
    red = BusReducer()
    red.open(1, [0])
    red.contribute(0, *_contrib(2.0, 1.0, 1))
    red.open(2, [0])
    red.contribute(0, *_contrib(9.0, 0.0, 2))  # weight 0: everyone keeps local, nothing new to seed
    header, blobs = red.seed_frame()
    assert header.cycle == 1
    np.testing.assert_allclose(unpack_round(header, blobs)[0], 2.0)
