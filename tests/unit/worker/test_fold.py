"""The relay's fold as pure state: what it keeps, what it forwards, what it sends up.

The fold's sum must be the sum the coordinator would have made of the unfolded frames
(f32), a rank dropped mid-fold must not block the rest, and anything that is not a
round the fold waits for passes through untouched.
"""

from __future__ import annotations

import numpy as np
import pytest

from flodl.wire import Endpoint, decode, pack_round, pb, split_routing, unpack_round
from flodl_coordinator.reducer import BusReducer
from flodl_worker.fold import Folder

SESSION = "fold-test"
SHAPES = [(3, 4), (5,)]
COORD = Endpoint(SESSION, pb.Sender.KIND_COORDINATOR, host="c")


def relay_msg(**kw) -> list:
    msg = pb.RelayMsg(**kw)
    return COORD.frames("relay", msg)[1:]  # [envelope]: the relay's own (no route)


def fold_open(folder: Folder, cycle: int, ranks) -> None:
    ident = [f"id-{r}".encode() for r in ranks]
    assert folder.on_coordinator(relay_msg(fold_open=pb.RelayMsg.FoldOpen(cycle=cycle, ranks=ranks, identities=ident))) == []


def fold_drop(folder: Folder, cycle: int, rank: int) -> list:
    return folder.on_coordinator(relay_msg(fold_drop=pb.RelayMsg.FoldDrop(cycle=cycle, rank=rank)))


_EPS: dict[int, Endpoint] = {}


def rank_round(rank: int, cycle: int, params, weight: float, *, bf16: bool = False, ident=None) -> list:
    """What the relay's frontend receives from rank ``rank``: [id, b"", envelope, blobs...]."""
    ep = _EPS.setdefault(rank, Endpoint(SESSION, pb.Sender.KIND_RANK, rank=rank, incarnation=1))
    scaled = [p * np.float32(weight) for p in params]
    header, blobs = pack_round(scaled, cycle=cycle, weight=weight, bf16=bf16)
    frames = ep.frames("round", header, [bytes(b) for b in blobs])
    return [ident or f"id-{rank}".encode(), *frames]


def params_of(seed: int):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(s).astype(np.float32) for s in SHAPES]


def decoded(msg: list):
    route, payload = split_routing(msg)
    assert route == ()  # the relay's own frame: the coordinator sees the relay's route
    d = decode(payload, session=SESSION)
    assert d.envelope.sender.kind == pb.Sender.KIND_RELAY
    return d.envelope.round, d.blobs


def test_nothing_is_looked_at_without_an_open_fold():
    f = Folder("relay-test-1")
    msg = rank_round(0, 1, params_of(0), 1.0)
    assert not f.active and f.offer(msg) == (False, [])


@pytest.mark.parametrize("bf16", [False, True])
def test_fold_equals_the_unfolded_weighted_average(bf16):
    """Folded then reduced == reduced unfolded, to f32 tolerance (bf16: its precision)."""
    weights = {0: 3.0, 1: 1.0, 2: 0.0, 3: 2.5}  # rank 2 did no work: elided, still named
    ps = {r: params_of(r) for r in weights}
    f = Folder("relay-test-1")
    fold_open(f, 5, [0, 1, 2])
    ups = []
    for r in (2, 0, 1):  # any arrival order; summed in rank order
        kept, up = f.offer(rank_round(r, 5, ps[r], weights[r], bf16=bf16))
        assert kept
        ups += up
    assert len(ups) == 1 and not f.active
    header, blobs = decoded(ups[0])
    assert list(header.contributing_ranks) == [0, 1, 2] and header.weight == 4.0
    assert all(m.dtype == (pb.DTYPE_BF16 if bf16 else pb.DTYPE_F32) for m in header.tensors)

    # Ranks 0-2 behind relay R (folded), rank 3 direct; the same frames, unfolded, to another reducer.
    folded, plain = BusReducer(), BusReducer()
    routes = {0: (b"R", b"id-0"), 1: (b"R", b"id-1"), 2: (b"R", b"id-2"), 3: (b"id-3",)}
    assert [relay for relay, _ in folded.folds.open(5, list(weights), routes.get)] == [(b"R",)]
    folded.open(5, weights)
    plain.open(5, weights)
    assert folded.contribute_folded((b"R",), header, blobs) is None
    a = folded.contribute(3, *decoded_rank(rank_round(3, 5, ps[3], 2.5, bf16=bf16)))
    for r in weights:
        b = plain.contribute(r, *decoded_rank(rank_round(r, 5, ps[r], weights[r], bf16=bf16)))
    assert a.contributors == b.contributors == (0, 1, 2, 3) and a.total_weight == b.total_weight == 6.5
    exact = [sum(ps[r][i] * weights[r] for r in weights) / 6.5 for i in range(len(SHAPES))]
    tol = 2e-2 if bf16 else 1e-6
    for x, y, e in zip(unpack_round(a.header, a.blobs), unpack_round(b.header, b.blobs), exact):
        np.testing.assert_allclose(x, y, rtol=tol, atol=tol)
        np.testing.assert_allclose(x, e, rtol=tol, atol=tol)


def decoded_rank(msg: list):
    d = decode(msg[2:], session=SESSION)
    return d.envelope.round, d.blobs


def test_f32_fold_is_the_f32_sum_bit_for_bit():
    f = Folder("relay-test-1")
    fold_open(f, 1, [0, 1])
    f.offer(rank_round(0, 1, params_of(0), 2.0))
    _, up = f.offer(rank_round(1, 1, params_of(1), 3.0))
    got = unpack_round(*decoded(up[0]))
    for i, g in enumerate(got):
        want = params_of(0)[i] * np.float32(2.0) + params_of(1)[i] * np.float32(3.0)
        assert np.array_equal(g, want)


def test_a_rank_dropped_mid_fold_is_removed_exactly_and_the_rest_flushes():
    f = Folder("relay-test-1")
    fold_open(f, 2, [0, 1, 2])
    assert f.offer(rank_round(0, 2, params_of(0), 1.0))[0]
    assert f.offer(rank_round(1, 2, params_of(1), 1.0)) == (True, [])  # still waiting for 2
    up = fold_drop(f, 2, 1)  # rank 1 died after sending: its part goes, 2 still awaited
    assert up == [] and f.active
    _, up = f.offer(rank_round(2, 2, params_of(2), 1.0))
    header, blobs = decoded(up[0])
    assert list(header.contributing_ranks) == [0, 2] and header.weight == 2.0
    np.testing.assert_array_equal(unpack_round(header, blobs)[0], params_of(0)[0] + params_of(2)[0])
    # Dropping the last awaited rank flushes at once; a drop for a fold that left is a no-op.
    fold_open(f, 3, [0, 1])
    f.offer(rank_round(0, 3, params_of(0), 1.0))
    (msg,) = fold_drop(f, 3, 1)
    assert list(decoded(msg)[0].contributing_ranks) == [0]
    assert fold_drop(f, 3, 0) == [] and not f.active


def test_everyone_dropped_sends_nothing():
    f = Folder("relay-test-1")
    fold_open(f, 4, [0, 1])
    assert fold_drop(f, 4, 0) == [] and fold_drop(f, 4, 1) == [] and not f.active


def test_other_traffic_passes_untouched_while_a_fold_is_open():
    f = Folder("relay-test-1")
    fold_open(f, 6, [0, 1])
    timing = [b"id-0", *Endpoint(SESSION, pb.Sender.KIND_RANK, rank=0).frames("timing", pb.Timing(rank=0))]
    assert f.offer(timing) == (False, [])
    assert f.offer(rank_round(0, 5, params_of(0), 1.0)) == (False, [])  # another cycle
    assert f.offer(rank_round(1, 6, params_of(1), 1.0, ident=b"id-0")) == (False, [])  # wrong id
    assert f.offer(rank_round(7, 6, params_of(1), 1.0, ident=b"id-7")) == (False, [])  # not in the fold
    assert f.active


def test_a_broken_part_goes_up_raw_and_is_not_folded():
    f = Folder("relay-test-1")
    fold_open(f, 1, [0, 1])
    f.offer(rank_round(0, 1, params_of(0), 1.0))
    bad = rank_round(1, 1, params_of(1), 1.0)
    bad[-1] = bytes(bad[-1])[:-4]  # a truncated tensor
    kept, up = f.offer(bad)
    assert not kept  # forwarded as it came, now: the bytes are checked on arrival
    assert list(decoded(up[0])[0].contributing_ranks) == [0]


@pytest.mark.parametrize("forge", ["nan", "negative_weight", "truncated"])
def test_a_refusable_part_goes_up_at_once_in_its_rank_s_order(forge):
    # A part that waited for the flush went up behind the frames its rank sent after it:
    # the coordinator dropped it as out of sequence, and the round waited for it forever
    # (a hostile-peers run hung so). It must leave before the rank's next frame can.
    f = Folder("relay-test-1")
    fold_open(f, 3, [0, 1])
    params = params_of(1)
    if forge == "nan":
        params[0][0, 0] = np.nan
    bad = rank_round(1, 3, params, -1.0 if forge == "negative_weight" else 1.0)
    if forge == "truncated":
        bad[-1] = bytes(bad[-1])[:-4]
    assert f.offer(bad) == (False, [])  # up as it came, before anything else of rank 1
    assert f.active  # still folding the others
    kept, up = f.offer(rank_round(0, 3, params_of(0), 1.0))
    assert kept and list(decoded(up[0])[0].contributing_ranks) == [0]
    # A part shaped unlike the others is forwarded at once.
    fold_open(f, 2, [0, 1])
    f.offer(rank_round(0, 2, params_of(0), 1.0))
    odd = rank_round(1, 2, [np.ones(7, np.float32)], 1.0)
    kept, up = f.offer(odd)
    assert not kept and list(decoded(up[0])[0].contributing_ranks) == [0]


def test_superseded_fold_is_discarded_and_release_returns_raw_parts():
    f = Folder("relay-test-1")
    fold_open(f, 1, [0, 1])
    f.offer(rank_round(0, 1, params_of(0), 1.0))
    fold_open(f, 2, [0, 1])  # the coordinator abandoned round 1
    assert f.folds_discarded == 1
    part = rank_round(1, 2, params_of(1), 1.0)
    f.offer(part)
    assert f.release() == [part] and not f.active


def test_zero_mass_fold_is_schema_only():
    f = Folder("relay-test-1")
    fold_open(f, 1, [0, 1])
    f.offer(rank_round(0, 1, params_of(0), 0.0))
    _, up = f.offer(rank_round(1, 1, params_of(1), 0.0))
    header, blobs = decoded(up[0])
    assert header.weight == 0.0 and blobs == [] and all(m.elided for m in header.tensors)
    assert list(header.contributing_ranks) == [0, 1]


def test_bf16_fold_accumulates_in_f32():
    """1 + 16 x 2**-8, all exact in bf16: a bf16 running sum stays at 1.0 (each 1 + 2**-8
    rounds back to 1), the f32 sum is 1.0625 -- exact in bf16 again on the way up."""
    n = 17
    f = Folder("relay-test-1")
    fold_open(f, 1, list(range(n)))
    up = []
    for r in range(n):
        value = 1.0 if r == 0 else 2.0**-8
        up += f.offer(rank_round(r, 1, [np.full(s, value, np.float32) for s in SHAPES], 1.0, bf16=True))[1]
    header, blobs = decoded(up[0])
    assert all(m.dtype == pb.DTYPE_BF16 for m in header.tensors)
    np.testing.assert_array_equal(unpack_round(header, blobs)[0], np.full(SHAPES[0], 1.0625, np.float32))


def test_fan_out_maps_deliver_to_onto_the_fold_s_frontend_ids():
    f = Folder("relay-test-1")
    fold_open(f, 4, [0, 1, 2])
    header, blobs = pack_round([np.ones(s, np.float32) for s in SHAPES], cycle=4, weight=3.0, contributing_ranks=[0, 1])
    header.deliver_to.extend([0, 1])
    payload = COORD.frames("round", header, blobs)[1:]
    up, ids = f.from_coordinator(payload)
    assert up == [] and ids == [b"id-0", b"id-1"] and (f.fanouts, f.fanout_copies) == (1, 2)
    header.deliver_to.append(7)  # a rank this relay never folded: not delivered, the others are
    assert f.from_coordinator(COORD.frames("round", header, blobs)[1:]) == ([], [b"id-0", b"id-1"])
    header.cycle = 3  # not the cycle of the last FoldOpen: nowhere to deliver
    assert f.from_coordinator(COORD.frames("round", header, blobs)[1:]) == ([], [])
    assert f.on_coordinator(payload) == []  # the old entry point: upstream frames only


def test_each_folded_round_carries_the_relay_s_counters_so_far():
    f = Folder("relay-test-1")
    fold_open(f, 4, [0, 1])
    header, blobs = pack_round([np.ones(s, np.float32) for s in SHAPES], cycle=4, weight=2.0, contributing_ranks=[0, 1])
    header.deliver_to.extend([0, 1])
    f.from_coordinator(COORD.frames("round", header, blobs)[1:])  # a fan-out of an earlier consensus
    ups = []
    for r in (0, 1):
        ups += f.offer(rank_round(r, 4, params_of(r), 1.0))[1]
    (up,) = ups
    stats = decoded(up)[0].relay_stats
    assert (stats.folds_sent, stats.ranks_folded, stats.fanouts, stats.fanout_copies) == (1, 2, 1, 2)
    assert (stats.parts_forwarded, stats.folds_discarded) == (0, 0)
