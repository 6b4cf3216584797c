"""flodl-worker: the per-host side of flodl.

- ``flodl_worker.rank``: ``run_rank(model_fn, optimizer_fn, step_fn, train_dataset, ...)``,
  the torch rank runtime a training script hands its model to;
- ``flodl_worker.progress()``: the run's global step / samples committed / epoch
  fraction, inside a rank (``flodl_worker.progress``; ``run_rank(lr_schedule=...)``);
- ``flodl_worker.relay``: the per-host relay (``flodl-worker relay``);
- ``flodl_worker.agent``: the per-host agent (``flodl-worker agent ... -- python train.py``);
- ``flodl_worker.examples``: ``digits`` and ``synthetic`` tasks.

Importing this package does not import torch (the agent and relay do not need it).
"""

from .run_progress import Progress, progress

__all__: list[str] = ["Progress", "progress"]
