"""flodl_worker.output: the run's output model, a plain torch ``state_dict`` file.

At the end of a run the coordinator asks the rank that runs the final eval to write the
model it has just evaluated (``ExecuteEval.save_model_path``, stamped by the
coordinator's ``flodl_coordinator.output``). That rank holds the last consensus, and
the file is exactly the model the summary's accuracy measures. The coordinator writes
the metadata beside it (``model.json``: run, epochs, accuracy, coverage, policy, world,
the file's sha256).

The file is ``torch.save`` of ``{name: tensor}`` (CPU tensors, parameters and buffers),
nothing else: ``model.load_state_dict(torch.load(path, weights_only=True))`` loads it
without flodl. ``load_consensus(path, model)`` does that and returns the metadata.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

from flodl.fsutil import atomic_write, sha256_file

__all__ = ["MODEL_FILE", "META_FILE", "save_output_model", "load_consensus", "OutputModelError"]

MODEL_FILE = "model.pt"
META_FILE = "model.json"


class OutputModelError(Exception):
    """The output model cannot be read or does not fit the model; ``str(e)`` is one line."""


def save_output_model(path: str, model: torch.nn.Module) -> bytes:
    """Write ``model``'s state_dict (detached CPU copies) to ``path`` atomically; its sha256."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    atomic_write(path, lambda fh: torch.save(state, fh))
    return sha256_file(path).digest()


def _meta_path(path: str) -> str:
    return os.path.join(os.path.dirname(os.path.abspath(path)), META_FILE)


def load_consensus(path: str, model: torch.nn.Module, *, strict: bool = True) -> dict[str, Any]:
    """Load a run's output model into ``model``; return its metadata (``{}`` if none).

    ``path``: the ``model.pt`` file, or the run's output directory holding it. The
    metadata's sha256, when present, is checked against the file (a torn or swapped
    file is refused by name)."""
    if os.path.isdir(path):
        path = os.path.join(path, MODEL_FILE)
    meta: dict[str, Any] = {}
    meta_path = _meta_path(path)
    if os.path.exists(meta_path):
        try:
            with open(meta_path, encoding="utf-8") as fh:
                meta = json.load(fh)
        except (OSError, ValueError) as e:
            raise OutputModelError(f"{meta_path} is not readable JSON ({e})") from None
    try:
        digest = sha256_file(path).hexdigest()
    except FileNotFoundError:
        raise OutputModelError(f"{path} does not exist") from None
    want = meta.get("sha256")
    if want and meta.get("file") == os.path.basename(path) and want != digest:
        raise OutputModelError(f"{path} does not match {meta_path} (sha256 {digest[:12]} != {want[:12]})")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # a torn or foreign file: torch raises many types
        raise OutputModelError(f"{path} is not a loadable state_dict ({type(e).__name__})") from None
    try:
        model.load_state_dict(state, strict=strict)
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise OutputModelError(f"the model does not match {path} ({first})") from None
    return meta
