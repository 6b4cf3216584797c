"""flodl_worker.device: where a rank's model lives, and moving its batches there.

``run_rank(..., device="auto")`` (the default) puts each rank on ``cuda:LOCAL_RANK``
(modulo the visible GPUs: ``FLODL_LOCAL_RANK`` is the rank's index on its host) when
CUDA is visible, else on the CPU; ``"cpu"``, ``"cuda"``, ``"cuda:1"`` or a
``torch.device`` choose explicitly. A CUDA device on a machine without CUDA is a
configuration error that says so, not a crash in the first forward.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

__all__ = ["DeviceError", "choose_device", "to_device"]


class DeviceError(ValueError):
    """The requested device cannot be used here; ``str(e)`` names it and the fix."""


def choose_device(
    want: str | torch.device | None,
    local_rank: int,
    *,
    cuda_available: Callable[[], bool] = torch.cuda.is_available,
    device_count: Callable[[], int] = torch.cuda.device_count,
) -> torch.device:
    """The device for a rank: ``want`` ("auto"/None, or a device), its ``local_rank``."""
    if want is None or (isinstance(want, str) and want.strip().lower() == "auto"):
        if cuda_available() and device_count() > 0:
            return torch.device("cuda", local_rank % device_count())
        return torch.device("cpu")
    try:
        dev = want if isinstance(want, torch.device) else torch.device(str(want).strip())
    except (RuntimeError, TypeError) as e:
        raise DeviceError(f"device={want!r} is not a device ({e}); use 'auto', 'cpu', 'cuda' or 'cuda:N'") from None
    if dev.type == "cuda":
        if not cuda_available():
            raise DeviceError(f"device={want!r} but CUDA is not available here; use device='auto' or 'cpu'")
        n = device_count()
        if dev.index is not None and dev.index >= n:
            raise DeviceError(f"device={want!r} but this host has {n} visible GPU(s) (CUDA_VISIBLE_DEVICES?)")
        if dev.index is None:
            dev = torch.device("cuda", local_rank % n)
    return dev


def to_device(batch: Any, device: torch.device) -> Any:
    """``batch`` with every tensor in it (lists, tuples, dicts, nested) on ``device``.

    Tensors already there are returned as they are (no copy on the CPU path); pinned
    host tensors are copied without blocking."""
    if isinstance(batch, torch.Tensor):
        if batch.device == device:
            return batch
        return batch.to(device, non_blocking=batch.is_pinned())
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a namedtuple
        return type(batch)(*(to_device(v, device) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(v, device) for v in batch)
    return batch
