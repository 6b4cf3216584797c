"""flodl_worker.buffers: which model buffers are averaged, and with what mass.

The reference rule (feature 23): a model's *f32* buffers (BatchNorm ``running_mean`` /
``running_var``) are averaged with equal weight among the ranks that stepped in the
window -- mass 1 for a rank that moved, 0 for an idle one, never ``n**gamma``: running
statistics must not inherit a fast rank's dominance. Buffers of other dtypes (the
int64 ``num_batches_tracked``) are counters and keep their local value.

On the wire the averaged buffers travel in the params round, after the parameters,
scaled by their mass (``RoundHeader.buffer_tensors`` / ``buffer_weight``); folds sum
them like the parameters and the root divides them once by the summed mover mass.
"""

from __future__ import annotations

import torch

__all__ = ["averaged_buffers", "mover_mass"]


def averaged_buffers(model: torch.nn.Module) -> list[torch.Tensor]:
    """The model's f32 buffers, in ``named_buffers`` order (the ones rounds carry)."""
    return [b for _, b in model.named_buffers() if b.dtype == torch.float32]


def mover_mass(weight: float) -> float:
    """A rank's buffer mass from its parameter mass: 1 if it stepped (weight > 0), else 0."""
    return 1.0 if weight > 0 else 0.0
