"""``Send.wire``: the bytes the shell sends, written without building the message where
the core knows how (a broadcast's shared body, a round's ``Update``), must be the bytes
protobuf writes for the message ``Send.control`` builds -- byte for byte, so a rank
parses the same command and nothing downstream can tell the two paths apart."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

import pytest

from flodl.core._averaging import _request_params, _throttle, _update, _update_wire
from flodl.core._commands import Send, command_id_field
from flodl.core._dispatch import _start_epoch, _start_epoch_wire
from flodl.core._events import ChunkDone
from flodl.core._membership import _beat
from flodl.core._metrics import _add, _epoch_aggregated, _per_rank_wire, aggregate_sums, to_pb
from flodl.core._state import EpochSums
from flodl.wire import pb, varint

U64 = st.integers(min_value=0, max_value=2**64 - 1)
SMALL = st.integers(min_value=0, max_value=2**22)  # every varint length up to 4 bytes, often
IDS = st.one_of(SMALL, U64)


def test_the_command_id_field_is_protobufs_at_every_length():
    for n in [0, 1, 127, 128, 16383, 16384, 2**21 - 1, 2**21, 2**35, 2**64 - 1]:
        assert command_id_field(n) == pb.Control(command_id=n).SerializeToString(), n


def test_a_varint_out_of_uint64_is_refused_not_written_wrong():
    with pytest.raises(ValueError, match="unsigned"):
        varint(-1)
    with pytest.raises(ValueError, match="64 bits"):
        varint(2**64)  # (a rank would read it wrapped)
    assert varint(2**64 - 1) == pb.Envelope(seq=2**64 - 1).SerializeToString()[1:]


@pytest.mark.parametrize(
    "build,args",
    [
        (_request_params, (7,)),
        (_throttle, ()),
        (_beat, (123456,)),
        (_epoch_aggregated, (pb.EpochMetrics(epoch=3, avg_loss=0.25, epoch_ms=12.5, scalars={"acc": 0.9}),)),
    ],
    ids=["request_params", "throttle", "coord_heartbeat", "epoch_aggregated"],
)
def test_a_broadcast_s_shared_body_gives_each_send_protobufs_bytes(build, args):
    ranks = list(range(40))  # above Send's bulk threshold: the mapped path
    for first in (0, 1, 100, 20_000, 2**40):
        sends = Send.each(ranks, first, "k", build, args)
        few = Send.each(ranks[:3], first, "k", build, args)  # the plain loop
        for s in sends + few:
            assert s.wire == s.control.SerializeToString()
            ctl = pb.Control(command_id=s.control.command_id)
            build(ctl, *args)
            assert pb.Control.FromString(s.wire) == ctl
        assert [s.control.command_id for s in sends] == list(range(first, first + len(ranks)))


def test_wire_does_not_build_the_control_and_reading_it_later_still_does():
    sends = Send.each(list(range(40)), 5, "request_params", _request_params, (9,))
    wire = sends[0].wire
    assert type(sends[0]._body) is tuple  # not built by wire
    assert sends[0].control == pb.Control.FromString(wire)
    assert sends[0].wire == wire  # and from the built control, the same bytes


PLANS = st.one_of(
    st.none(),
    st.builds(lambda e, o, n: pb.EpochPlan(epoch=e, partition_offset=o, partition_size=n), SMALL, U64, SMALL),
    st.just(pb.EpochPlan()),  # an empty plan is still a plan (present, zero length)
)


@settings(max_examples=400, deadline=None)
@given(IDS, SMALL, SMALL, SMALL, PLANS, IDS, U64)
def test_a_round_s_update_is_written_as_protobuf_writes_it(cid, version, cycle, at, plan, global_step, committed):
    args = (version, cycle, at, plan, global_step, committed)
    ctl = pb.Control(command_id=cid)
    _update(ctl, *args)
    assert _update_wire(cid, *args) == ctl.SerializeToString()
    [s] = Send.each_of([4], cid, "update", _update, [args], _update_wire)
    assert s.wire == ctl.SerializeToString() and s.control == ctl


def _reference_to_pb(m):  # a ScalarMap per rank, as to_pb built them before
    return pb.EpochMetrics(
        epoch=m["epoch"], scalars=m["scalars"], per_rank=[pb.ScalarMap(values=v) for v in m["per_rank"]],
        avg_loss=m["avg_loss"], epoch_ms=m["epoch_ms"], per_rank_throughput=m["per_rank_throughput"],
        per_rank_batch_share=m["per_rank_batch_share"],
        per_rank_loss=[x if x is not None else 0.0 for x in m["per_rank_loss"]],
        per_rank_samples=m["per_rank_samples"], per_rank_batches=m["per_rank_batches"],
    )  # fmt: skip


@settings(max_examples=100, deadline=None)
@given(st.integers(min_value=1, max_value=40), st.data())
def test_the_whole_metrics_per_rank_maps_are_the_maps_one_by_one(world, data):
    # Some ranks report scalars (their own maps), the rest share aggregate_sums' zeros map.
    sums = EpochSums()
    for r in data.draw(st.sets(st.integers(min_value=0, max_value=world - 1))):
        names = data.draw(st.sets(st.sampled_from(["acc", "lr", "grad_norm"])))
        scal = tuple((k, data.draw(st.floats(-1e6, 1e6)), data.draw(st.integers(0, 5))) for k in names)
        _add(sums, ChunkDone(now=0.0, rank=r, epoch=2, chunk_seq=0, batches=3, samples=48, avg_loss=0.5,
                             epoch_ms=10.0, share_complete_ms=8.0, scalars=scal))  # fmt: skip
    m = aggregate_sums(2, sums, world)
    assert to_pb(m) == _reference_to_pb(m)
    assert len(to_pb(m).per_rank) == world


def test_per_rank_wire_of_no_ranks_is_empty():
    assert _per_rank_wire([]) == b""


@settings(max_examples=400, deadline=None)
@given(IDS, SMALL, U64, SMALL, st.one_of(st.none(), st.integers(min_value=0, max_value=2**32 - 1)))
def test_a_dispatch_s_start_epoch_is_written_as_protobuf_writes_it(cid, epoch, offset, size, role):
    args = (epoch, offset, size, role)
    ctl = pb.Control(command_id=cid)
    _start_epoch(ctl, *args)
    assert _start_epoch_wire(cid, *args) == ctl.SerializeToString()
    assert _start_epoch_wire(cid, 0, 0, 0, None) == pb.Control(command_id=cid, start_epoch={"plan": {}}).SerializeToString()
