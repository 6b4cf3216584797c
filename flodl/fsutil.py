"""Durable-file helpers shared by the coordinator and the worker (checkpoints)."""

from __future__ import annotations

import hashlib
import os

__all__ = ["fsync_dir", "sha256_file"]


def fsync_dir(path: str) -> None:
    """Make a rename/creation inside ``path`` durable (no-op where dirs can't be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def sha256_file(path: str) -> "hashlib._Hash":
    """The sha256 of a file's bytes, read in 1 MiB blocks (``.hexdigest()`` / ``.digest()``)."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h
