"""Protocol 1.2: a round's trigger carries a rank's lone next window in its RequestParams.

The core takes out of the trigger's commands exactly the plans that were a rank's one
command of the step, and only those (``_carried_plans``); the bytes it writes for the
carrying RequestParams are protobuf's; the rank applies the carried window before its
snapshot, as it applied the frame that used to come first; and a restarted coordinator
counts a carried window as in flight, as it counted the frame."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from flodl.core._carried_plans import NO_PLAN, carry_lone_plans, request_params, request_params_wire
from flodl.core._commands import Notice, Send
from flodl.core._dispatch import _start_epoch, _start_epoch_wire
from flodl.wire import pb

U64 = st.integers(min_value=0, max_value=2**64 - 1)
SMALL = st.integers(min_value=0, max_value=2**22)


def _start(rank, cid, epoch, off, size, role=None):
    return Send.built(rank, cid, "start_epoch", _start_epoch, (epoch, off, size, role))


def _extend(rank, cid, epoch, off, size):
    return Send(rank, pb.Control(command_id=cid, extend_partition=pb.Control.ExtendPartition(
        epoch=epoch, partition_offset=off, partition_size=size)))  # fmt: skip


def test_only_a_ranks_lone_plan_is_carried_and_the_rest_keep_their_order():
    note = Notice(kind="window", data={})
    planned = [
        _start(0, 10, 1, 0, 4),  # rank 0: its one command -> carried
        note,
        _start(1, 11, 1, 4, 4), _extend(1, 12, 1, 40, 2),  # rank 1: two ranges -> both kept, in order
        _start(2, 13, 1, 8, 4, role=2),  # rank 2: a plan telling the epoch role -> kept
        _extend(3, 14, 1, 50, 3),  # rank 3: a lone extension -> carried
        _start(9, 15, 1, 60, 1),  # rank 9: not in the round -> kept
    ]
    kept, carried = carry_lone_plans(planned, (0, 1, 2, 3))
    assert carried == {0: ("next_plan", 1, 0, 4), 3: ("extend", 1, 50, 3)}
    assert kept == [note, planned[2], planned[3], planned[4], planned[6]]
    assert carry_lone_plans([], (0, 1)) == ([], {})


@settings(max_examples=300, deadline=None)
@given(cid=st.one_of(SMALL, U64), cycle=st.one_of(SMALL, U64), kind=st.sampled_from(["", "next_plan", "extend"]),
       epoch=SMALL, off=st.one_of(SMALL, U64), size=st.one_of(SMALL, U64))  # fmt: skip
def test_a_carrying_request_params_is_written_as_protobuf_writes_it(cid, cycle, kind, epoch, off, size):
    args = (cycle, kind, epoch, off, size) if kind else (cycle, *NO_PLAN)
    ref = pb.Control(command_id=cid)
    request_params(ref, *args)
    assert request_params_wire(cid, *args) == ref.SerializeToString()
    s = Send.built(0, cid, "request_params", request_params, args)
    assert s.recipe == ("request_params", args)  # (read before ``control``, which builds it)
    assert s.control == ref and s.kind == "request_params" and s.recipe is None


def test_the_start_epoch_recipe_is_read_without_building_it():
    s = _start(0, 7, 1, 2, 3)
    assert s.recipe == ("start_epoch", (1, 2, 3, None))
    assert _start_epoch_wire(7, 1, 2, 3, None) == s.control.SerializeToString()
    assert Send(0, pb.Control(command_id=1)).recipe is None  # a ready Control: read ``control``
