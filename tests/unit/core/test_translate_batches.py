"""A frame of batches is translated column by column (``_translate._batches``, built by
``_events.batches_done``): the events must be those ``_batch`` builds one by one, field
for field, whatever a rank (or a hostile peer) wrote in them."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flodl.core import BatchDone, BatchesDone
from flodl.core._events import batches_done
from flodl.core._translate import _batch, timing_event
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


@settings(max_examples=200, deadline=None)
@given(st.lists(BATCH, min_size=1, max_size=64), st.floats(min_value=0, max_value=1e6), st.integers(0, 4095))
def test_a_frame_of_batches_is_each_batch_as_one_frame_would_say_it(batches, now, rank):
    t = pb.Timing(rank=rank)
    for b in batches:
        t.batches.batch.add(**b)
    ev = timing_event(now, t)
    assert type(ev) is BatchesDone and len(ev.batches) == len(batches)
    for got, b in zip(ev.batches, t.batches.batch):
        assert _same(got, _batch(now, rank, b))
    # a hostile wait is none, as one frame says it
    assert all(0.0 <= x.wait_ms < math.inf for x in ev.batches)


def test_batches_done_refuses_columns_that_leave_a_field_unset():
    with pytest.raises(TypeError, match="columns"):
        batches_done(1.0, 0, 1, {"batch_ms": [1.0]})


def test_a_column_built_event_compares_hashes_and_pickles_as_a_constructed_one():
    import pickle

    cols = {"batch_ms": [1.0], "data_ms": [0.5], "step_count": [3], "loss": [0.25], "samples": [32], "epoch": [0],
            "offset": [64], "lr": [0.1], "sync_divergence": [None], "wait_ms": [0.0]}  # fmt: skip
    (got,) = batches_done(2.0, 5, 1, cols)
    ref = BatchDone(now=2.0, rank=5, **{k: v[0] for k, v in cols.items()})
    assert got == ref and hash(got) == hash(ref) and pickle.loads(pickle.dumps(got)) == ref
    with pytest.raises(AttributeError):  # still frozen
        got.rank = 1  # type: ignore[misc]
