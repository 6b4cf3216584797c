"""Which buffers a round carries, the signature over them, and the flat staging copy."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from flodl_worker.buffers import averaged_buffers, mover_mass
from flodl_worker.params import model_signature
from flodl_worker.staging import FlatStaging


def bn_model(track: bool = True) -> nn.Module:
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4, track_running_stats=track), nn.Linear(4, 2))


def test_only_f32_buffers_are_averaged_in_named_buffers_order():
    m = bn_model()
    m.register_buffer("mask", torch.ones(2, dtype=torch.bool))
    m.register_buffer("scale", torch.full((2,), 2.0))
    bufs = averaged_buffers(m)
    assert [b is x for b, x in zip(bufs, (m.scale, m[1].running_mean, m[1].running_var))] == [True] * 3
    assert len(bufs) == 3  # num_batches_tracked (int64) and mask (bool) keep their local value
    assert (mover_mass(0.0), mover_mass(3.7), mover_mass(1e-9)) == (0.0, 1.0, 1.0)


def test_the_model_signature_covers_buffers():
    torch.manual_seed(0)
    assert model_signature(bn_model()) != model_signature(bn_model(track=False))  # same parameters


def test_flat_staging_is_one_deep_copy_viewed_per_tensor():
    m = bn_model()
    tensors = list(m.parameters()) + averaged_buffers(m)
    st = FlatStaging(tensors)
    flat = st.gather()
    assert flat.size == sum(t.numel() for t in tensors) and st.offsets[-1] == flat.size
    views = st.views(flat)
    for v, t in zip(views, tensors):
        assert v.shape == tuple(t.shape) and np.array_equal(v, t.detach().numpy())
        assert np.shares_memory(v, flat)
    with torch.no_grad():
        tensors[0].add_(1.0)  # a snapshot, not a view of the model
    assert not np.array_equal(views[0], tensors[0].detach().numpy())
