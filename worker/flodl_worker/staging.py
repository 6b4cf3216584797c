"""flodl_worker.staging: a model's averaged tensors gathered into ONE flat f32 host array.

A bus round needs a deep host copy of the parameters (the snapshot the consensus is
applied against) and that copy scaled by the rank's mass (what goes on the wire). Done
per tensor it costs an allocation, a device-to-host transfer and a scaled temporary for
each of them, every round. Here a snapshot is one allocation and one pass: each tensor
is copied into its slice of a flat buffer (pinned, non-blocking, one synchronize at the
end when the model lives on a GPU), and the scaled frame is one vectorised multiply into
a second flat array whose slices are handed to the wire without another copy.
"""

from __future__ import annotations

import numpy as np
import torch

from .params import f32

__all__ = ["FlatStaging"]


class FlatStaging:
    """The layout of ``tensors`` (parameters, then f32 buffers) in one flat f32 array."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.tensors = tensors
        self.shapes = [tuple(t.shape) for t in tensors]
        self.sizes = [t.numel() for t in tensors]
        self.offsets = [0]
        for n in self.sizes:
            self.offsets.append(self.offsets[-1] + n)
        self.total = self.offsets[-1]
        self.cuda = any(t.is_cuda for t in tensors)

    def gather(self) -> np.ndarray:
        """A new flat f32 host copy of every tensor (one allocation, one transfer pass)."""
        if not self.cuda:  # host tensors: one numpy pass over f32 views (no temporaries)
            flat = np.empty(self.total, dtype=np.float32)
            np.concatenate([f32(t).reshape(-1) for t in self.tensors], out=flat)
            return flat
        flat = torch.empty(self.total, dtype=torch.float32, pin_memory=True)
        with torch.no_grad():
            for t, off, n in zip(self.tensors, self.offsets, self.sizes):
                flat[off : off + n].copy_(t.detach().reshape(-1), non_blocking=True)
        torch.cuda.synchronize()  # once, for every transfer
        return flat.numpy()

    def views(self, flat: np.ndarray) -> list[np.ndarray]:
        """Per-tensor views (no copy) of a flat array in this layout."""
        return [flat[a:b].reshape(s) for a, b, s in zip(self.offsets, self.offsets[1:], self.shapes)]
