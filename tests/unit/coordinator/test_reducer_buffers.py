"""f32 buffers in a round (reference feature 23): the reducer and the relay's fold divide
them by the mover mass (equal weight among the ranks that stepped), never by n**gamma."""

from __future__ import annotations

import numpy as np
import pytest

from flodl.wire import Endpoint, decode, pack_round, pb, split_buffers, split_routing, unpack_round
from flodl_coordinator.reducer import BusReducer, RoundRefused
from flodl_worker.fold import Folder

SESSION = "s"
COORD = Endpoint(SESSION, pb.Sender.KIND_COORDINATOR, host="c")


def contribution(param: float, buf: float, weight: float, cycle: int = 1, bf16: bool = False):
    """A rank's frame: one parameter tensor x weight, one buffer tensor x mover."""
    mover = 1.0 if weight > 0 else 0.0
    arrays = [np.full((2, 3), param * weight, np.float32), np.full(4, buf * mover, np.float32)]
    return pack_round(arrays, cycle=cycle, weight=weight, bf16=bf16, buffers=1, buffer_weight=mover)


@pytest.mark.parametrize("bf16", [False, True])
def test_buffers_are_the_mean_over_movers_and_params_the_weighted_mean(bf16):
    red = BusReducer(bf16_wire=bf16)
    red.open(1, [0, 1, 2])
    red.contribute(0, *contribution(1.0, 2.0, 1.0, bf16=bf16))
    red.contribute(1, *contribution(4.0, 6.0, 3.0, bf16=bf16))  # fast rank: 3 steps
    res = red.contribute(2, *contribution(9.0, 100.0, 0.0, bf16=bf16))  # idle: in neither mean
    assert res.header.buffer_tensors == 1 and res.header.buffer_weight == 2.0
    params, bufs = split_buffers(res.header, unpack_round(res.header, res.blobs))
    np.testing.assert_allclose(params[0], (1.0 * 1 + 4.0 * 3) / 4.0, rtol=1e-2 if bf16 else 1e-6)
    np.testing.assert_allclose(bufs[0], (2.0 + 6.0) / 2.0)  # gamma-weighted would be 5.0


def test_a_buffer_weight_that_is_not_one_per_mover_is_refused():
    red = BusReducer()
    red.open(1, [0, 1])
    arrays = [np.full((2, 3), 1.0, np.float32), np.full(4, 50.0, np.float32)]
    forged = pack_round(arrays, cycle=1, weight=1.0, buffers=1, buffer_weight=50.0)  # to dominate the stats
    with pytest.raises(RoundRefused) as e:
        red.contribute(0, *forged)
    assert e.value.code == "weight" and "buffer weight 50" in e.value.reason
    res = red.settle() or red.contribute(1, *contribution(2.0, 3.0, 1.0))
    assert res.contributors == (1,) and res.header.buffer_weight == 1.0


def test_a_frame_splitting_its_tensors_otherwise_is_a_shape_refusal():
    red = BusReducer()
    red.open(1, [0, 1])
    red.contribute(0, *contribution(1.0, 1.0, 1.0))
    arrays = [np.full((2, 3), 1.0, np.float32), np.full(4, 1.0, np.float32)]
    with pytest.raises(RoundRefused) as e:
        red.contribute(1, *pack_round(arrays, cycle=1, weight=1.0))  # no buffers declared
    assert e.value.code == "shape"


def _rank_msg(rank: int, header, blobs) -> list:
    ep = Endpoint(SESSION, pb.Sender.KIND_RANK, rank=rank, incarnation=1)
    return [f"id-{rank}".encode(), *ep.frames("round", header, [bytes(b) for b in blobs])]


def test_a_fold_sums_the_mover_mass_and_reduces_to_the_unfolded_result():
    f = Folder("relay-buffers")
    ranks = [0, 1, 2]
    ident = [f"id-{r}".encode() for r in ranks]
    f.on_coordinator(COORD.frames("relay", pb.RelayMsg(fold_open=pb.RelayMsg.FoldOpen(cycle=1, ranks=ranks, identities=ident)))[1:])
    frames = {0: contribution(1.0, 2.0, 2.0), 1: contribution(3.0, 4.0, 1.0), 2: contribution(5.0, 9.0, 0.0)}
    ups = []
    for r in ranks:
        kept, up = f.offer(_rank_msg(r, *frames[r]))
        assert kept
        ups += up
    (up,) = ups
    _route, payload = split_routing(up)
    d = decode(payload, session=SESSION)
    h = d.envelope.round
    assert h.weight == 3.0 and h.buffer_weight == 2.0 and h.buffer_tensors == 1
    folded, plain = BusReducer(), BusReducer()
    routes = {r: (b"R", f"id-{r}".encode()) for r in ranks}
    folded.folds.open(1, ranks, routes.get)
    folded.open(1, ranks)
    plain.open(1, ranks)
    a = folded.contribute_folded((b"R",), h, d.blobs)
    for r in ranks:
        b = plain.contribute(r, *frames[r])
    for x, y in zip(unpack_round(a.header, a.blobs), unpack_round(b.header, b.blobs)):
        assert x.tobytes() == y.tobytes()
    np.testing.assert_allclose(split_buffers(a.header, unpack_round(a.header, a.blobs))[1][0], 3.0)
