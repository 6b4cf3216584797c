"""The epoch permutation: a pure function of (seed, epoch, n).

Every rank rebuilds the same permutation independently, so a plan is just a range of
positions ``[offset, offset+size)``; coverage survives checkpoint and resume because
nothing random is stored. The keys are a splitmix64 hash of the index, so the result
depends only on integer arithmetic and a stable sort — not on numpy's RNG streams,
which may change between numpy versions.
"""

from __future__ import annotations

import numpy as np

__all__ = ["epoch_permutation", "positions_to_samples"]

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        z = x + _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * _M1
        z = (z ^ (z >> np.uint64(27))) * _M2
        return z ^ (z >> np.uint64(31))


def epoch_permutation(seed: int, epoch: int, n: int) -> np.ndarray:
    """Sample ids in training order for ``epoch`` (int64 array of length ``n``)."""
    if n < 0:
        raise ValueError(f"dataset length must be >= 0, got {n}")
    with np.errstate(over="ignore"):
        salt = _splitmix64(np.array([seed], dtype=np.uint64))[0] ^ _splitmix64(
            np.array([epoch + 0x51ED], dtype=np.uint64)
        )[0]
        keys = _splitmix64(np.arange(n, dtype=np.uint64) ^ salt)
    return np.argsort(keys, kind="stable").astype(np.int64)


def positions_to_samples(seed: int, epoch: int, n: int, offset: int, size: int) -> np.ndarray:
    if offset < 0 or size < 0 or offset + size > n:
        raise ValueError(f"plan [{offset}, {offset + size}) is outside the epoch of {n} samples")
    return epoch_permutation(seed, epoch, n)[offset : offset + size]
