"""Tensor frames: f32 zero-copy, bf16 rounding, elision, and refusals."""

import numpy as np
import pytest

from flodl.wire import BadTensor, bf16_to_f32, f32_to_bf16, pack_round, pb, unpack_round


def test_f32_roundtrip_is_exact():
    a = [np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32), np.arange(5, dtype=np.float32)]
    h, blobs = pack_round(a, cycle=3, weight=2.0)
    out = unpack_round(h, blobs)
    assert h.cycle == 3 and h.weight == 2.0
    for x, y in zip(a, out):
        np.testing.assert_array_equal(x, y)


def test_bf16_halves_the_bytes_and_rounds_to_nearest_even():
    a = np.array([1.0, 1.00390625, 1.01171875, -2.5, 3.0e38], dtype=np.float32)
    h, blobs = pack_round([a], cycle=1, weight=1.0, bf16=True)
    assert h.tensors[0].dtype == pb.DTYPE_BF16 and len(blobs[0]) == a.size * 2
    back = unpack_round(h, blobs)[0]
    # 1 + 2^-8 is a tie between 1 and 1 + 2^-7: even mantissa (1.0) wins.
    assert back[1] == 1.0
    assert back[2] == np.float32(1.015625)
    np.testing.assert_allclose(back, a, rtol=2**-8)


def test_bf16_keeps_nan_quiet():
    bits = f32_to_bf16(np.array([np.nan], dtype=np.float32))
    assert np.isnan(bf16_to_f32(bits))[0]


def test_zero_weight_elides_every_tensor():
    h, blobs = pack_round([np.ones(4, np.float32)], cycle=1, weight=0.0)
    assert blobs == [] and h.tensors[0].elided
    np.testing.assert_array_equal(unpack_round(h, blobs)[0], np.zeros(4, np.float32))


def test_length_mismatch_is_refused():
    h, blobs = pack_round([np.ones(4, np.float32)], cycle=1, weight=1.0)
    with pytest.raises(BadTensor, match="needs 16 bytes"):
        unpack_round(h, [b"\x00" * 12])


def test_missing_blob_and_double_claim_are_refused():
    h, blobs = pack_round([np.ones(2, np.float32), np.ones(2, np.float32)], cycle=1, weight=1.0)
    with pytest.raises(BadTensor, match="missing"):
        unpack_round(h, blobs[:1])
    h.tensors[1].blob_index = 0
    with pytest.raises(BadTensor, match="claimed twice"):
        unpack_round(h, blobs)


def test_negative_or_nonfinite_weight_is_refused():
    h, blobs = pack_round([np.ones(2, np.float32)], cycle=1, weight=1.0)
    h.weight = -1.0
    with pytest.raises(BadTensor, match="finite and >= 0"):
        unpack_round(h, blobs)


def test_nonfinite_values_are_refused():
    h, blobs = pack_round([np.array([1.0, np.inf], np.float32)], cycle=1, weight=1.0)
    with pytest.raises(BadTensor, match="non-finite"):
        unpack_round(h, blobs)
