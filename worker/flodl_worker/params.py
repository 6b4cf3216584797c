"""flodl_worker.params: stateless helpers over a model's parameters.

Public because tests and tools compute the same values as the rank: the signature that
admission compares, the digest a rank reports on exit, the contribution mass.
"""

from __future__ import annotations

import hashlib
import warnings

import numpy as np
import torch

__all__ = ["model_signature", "f32", "param_digest", "gamma_mass", "l2_norm", "as_tensor"]


def model_signature(model: torch.nn.Module) -> bytes:
    """sha256 over the model's structure: every module's name and type (a Tanh where the
    cohort has a ReLU is another model, though its parameters look the same), then
    ``name shape dtype`` of every parameter and buffer, in registration order."""
    h = hashlib.sha256()
    for name, m in model.named_modules():
        h.update(f"module|{name}|{type(m).__module__}.{type(m).__qualname__}\n".encode())
    for name, p in model.named_parameters():
        h.update(f"{name}|{tuple(p.shape)}|{p.dtype}\n".encode())
    for name, b in model.named_buffers():
        h.update(f"buffer|{name}|{tuple(b.shape)}|{b.dtype}\n".encode())
    return h.digest()


def f32(p: torch.Tensor) -> np.ndarray:
    """A detached little-endian f32 view/copy of ``p`` on the CPU (may share memory)."""
    return p.detach().to(device="cpu", dtype=torch.float32).contiguous().numpy().astype("<f4", copy=False)


def param_digest(params) -> bytes:
    """sha256 of the concatenated little-endian f32 bytes of ``params``, in order."""
    h = hashlib.sha256()
    for p in params:
        h.update(f32(p).tobytes())
    return h.digest()


def gamma_mass(n: int, gamma: float) -> float:
    """Contribution mass n**gamma with the idle guard: 0 when n <= 0 (never 0**0 = 1)."""
    if n <= 0:
        return 0.0
    return float(n) if gamma == 1.0 else float(n) ** gamma


def l2_norm(arrays) -> float:
    total = 0.0
    for a in arrays:
        v = a.ravel().astype(np.float64)
        total += float(np.dot(v, v))
    return float(np.sqrt(total))


def as_tensor(a: np.ndarray) -> torch.Tensor:
    # Consensus arrays view read-only ZeroMQ frames; torch warns on wrapping them even
    # though we only ever read (copy_ into the parameter).
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(a)
