"""A rank's half of a checkpoint: ``model.pt``, written atomically, read back safely.

Theory of operation
-------------------
The coordinator decides when and where (``Control.Checkpoint{version, path, cycle}``,
see ``flodl_worker.rank``); this module only does the file work, so it can be tested
without sockets.

* ``save_model_file(path, model, optimizer, **info)``: ``torch.save`` of
  ``{"format", "format_version", "model": state_dict, "optimizer": state_dict, **info}``
  into a temp file next to ``path``, ``fsync``, hash the bytes *as written* (sha256,
  reported to the coordinator, which re-hashes what it sees: a torn or unshared file
  is caught before the checkpoint is committed), then ``os.replace`` onto ``path`` and
  fsync the directory. A crash leaves either no ``model.pt`` or a whole one.
* ``load_model_file(path, model, optimizer)``: ``torch.load(weights_only=True)`` --
  a checkpoint is data and must not be able to run code -- then strict
  ``load_state_dict`` into the freshly built model and optimizer. Any defect is a
  ``CheckpointLoadError`` whose message is one line.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from flodl.fsutil import atomic_write, sha256_file

__all__ = ["FORMAT", "FORMAT_VERSION", "CheckpointLoadError", "save_model_file", "load_model_file"]

FORMAT = "flodl-model"
FORMAT_VERSION = 1


class CheckpointLoadError(Exception):
    """``model.pt`` cannot be loaded into this model; ``str(e)`` is one line."""


def save_model_file(
    path: str, model: torch.nn.Module, optimizer: Any, *, model_state: dict | None = None, **info: Any
) -> bytes:
    """Write model + optimizer state to ``path`` atomically; return the file's sha256.

    ``model_state``: the state dict to save instead of ``model.state_dict()`` (the
    consensus the rank holds, ``flodl_worker.checkpoint_duty``)."""
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    payload = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "model": model.state_dict() if model_state is None else model_state,
        "optimizer": optimizer.state_dict() if optimizer is not None else None,
        **info,
    }
    atomic_write(path, lambda fh: torch.save(payload, fh))
    return sha256_file(path).digest()


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}".rstrip(": ")


def load_model_file(path: str, model: torch.nn.Module, optimizer: Any) -> dict[str, Any]:
    """Load ``path`` into ``model`` (strict) and ``optimizer``; return the other fields."""
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise CheckpointLoadError(f"{path} does not exist (is the checkpoint dir shared with this host?)") from None
    except Exception as e:  # a torn or foreign file: torch raises many types
        raise CheckpointLoadError(f"{path} is not a loadable checkpoint ({_first_line(e)})") from None
    if not isinstance(obj, dict) or obj.get("format") != FORMAT or "model" not in obj:
        raise CheckpointLoadError(f"{path} is not a flodl model checkpoint")
    if obj.get("format_version", 0) > FORMAT_VERSION:
        raise CheckpointLoadError(f"{path} has format_version {obj['format_version']}, newer than {FORMAT_VERSION}")
    try:
        model.load_state_dict(obj["model"])
    except Exception as e:
        raise CheckpointLoadError(f"the model does not match {path} ({_first_line(e)})") from None
    if optimizer is not None and obj.get("optimizer") is not None:
        try:
            optimizer.load_state_dict(obj["optimizer"])
        except Exception as e:
            raise CheckpointLoadError(f"the optimizer does not match {path} ({_first_line(e)})") from None
    return {k: v for k, v in obj.items() if k not in ("model", "optimizer")}
