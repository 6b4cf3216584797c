"""A batch is translated by setting its event's slots one by one (``_translate._batch``,
``_events.BATCH_DONE_SETTERS``, not the frozen dataclass's ``__init__``): the events must
be those the constructor builds, field for field and type for type, whatever a rank (or
a hostile peer) wrote in them -- one batch to a frame, or many."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flodl.core import BatchDone, BatchesDone
from flodl.core._translate import timing_event
from flodl.wire import pb

FLOATS = st.floats(allow_nan=True, allow_infinity=True, width=32)
U = st.integers(min_value=0, max_value=2**32 - 1)

BATCH = st.fixed_dictionaries(
    {"batch_ms": FLOATS, "data_ms": FLOATS, "step_count": U, "batch_loss": FLOATS, "samples": U, "epoch": U,
     "offset": U, "lr": FLOATS, "wait_ms": FLOATS},
    optional={"sync_divergence": FLOATS},
)  # fmt: skip


def _same(a: BatchDone, b: BatchDone) -> bool:  # field by field, NaN equal to NaN
    for name in BatchDone.__dataclass_fields__:
        x, y = getattr(a, name), getattr(b, name)
        if not (x == y or (isinstance(x, float) and isinstance(y, float) and math.isnan(x) and math.isnan(y))):
            return False
        if type(x) is not type(y):
            return False
    return True


def _reference(now: float, rank: int, b: pb.Timing.Batch) -> BatchDone:  # as the constructor built it before
    w = b.wait_ms
    return BatchDone(now=now, rank=rank, batch_ms=b.batch_ms, data_ms=b.data_ms, step_count=b.step_count,
                     loss=b.batch_loss, samples=b.samples, epoch=b.epoch, offset=b.offset, lr=b.lr,
                     sync_divergence=b.sync_divergence if b.HasField("sync_divergence") else None,
                     wait_ms=w if 0.0 < w < math.inf else 0.0)  # fmt: skip


@settings(max_examples=200, deadline=None)
@given(st.lists(BATCH, min_size=1, max_size=64), st.floats(min_value=0, max_value=1e6), st.integers(0, 4095))
def test_a_frame_s_batches_are_the_events_the_constructor_builds(batches, now, rank):
    t = pb.Timing(rank=rank)
    for b in batches:
        t.batches.batch.add(**b)
    ev = timing_event(now, t)
    assert type(ev) is BatchesDone and len(ev.batches) == len(batches)
    for got, b in zip(ev.batches, t.batches.batch):
        assert _same(got, _reference(now, rank, b))
    assert all(0.0 <= x.wait_ms < math.inf for x in ev.batches)  # a hostile wait is none
    one = timing_event(now, pb.Timing(rank=rank, batch=t.batches.batch[0]))
    assert type(one) is BatchDone and _same(one, _reference(now, rank, t.batches.batch[0]))


def test_a_slot_built_event_compares_hashes_pickles_and_stays_frozen_as_a_constructed_one():
    import pickle

    b = pb.Timing.Batch(batch_ms=1.0, data_ms=0.5, step_count=3, batch_loss=0.25, samples=32, offset=64, lr=0.1)
    got = timing_event(2.0, pb.Timing(rank=5, batch=b))
    ref = _reference(2.0, 5, b)
    assert got == ref and hash(got) == hash(ref) and pickle.loads(pickle.dumps(got)) == ref and repr(got) == repr(ref)
    with pytest.raises(AttributeError):
        got.rank = 1  # type: ignore[misc]
