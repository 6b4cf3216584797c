"""flodl-worker: the per-host side of flodl.

- ``flodl_worker.rank``: ``run_rank(model_fn, optimizer_fn, step_fn, train_dataset, ...)``,
  the torch rank runtime a training script hands its model to;
- ``flodl_worker.progress()``: the run's global step / samples committed / epoch
  fraction, inside a rank (``flodl_worker.progress``; ``run_rank(lr_schedule=...)``);
- ``flodl_worker.world_size()``: the run's world size, for an ``optimizer_fn`` that scales
  its LR by it (``flodl_worker.run_world``);
- ``flodl_worker.load_consensus(path, model)``: load a run's output model
  (``flodl_worker.output``);
- ``flodl_worker.relay``: the per-host relay (``flodl-worker relay``);
- ``flodl_worker.agent``: the per-host agent (``flodl-worker agent ... -- python train.py``);
- ``flodl_worker.examples``: ``digits`` and ``synthetic`` tasks, and models that look
  like real work: ``cnn`` (BatchNorm + dropout on digits) and ``tinylm`` (a transformer LM).

Importing this package does not import torch (the agent and relay do not need it).
"""

from typing import Any

from .run_progress import Progress, progress
from .run_world import world_size

__all__: list[str] = ["Progress", "progress", "world_size", "load_consensus"]


def load_consensus(path: str, model: Any, *, strict: bool = True) -> dict:
    """Load a run's output model (``model.pt`` or its directory) into ``model``; return
    its metadata (``model.json``). See ``flodl_worker.output.load_consensus``."""
    from .output import load_consensus as load  # torch only when asked

    return load(path, model, strict=strict)
