"""Durable-file helpers shared by the coordinator and the worker (checkpoints)."""

from __future__ import annotations

import hashlib
import os
import secrets
from typing import IO, Callable

__all__ = ["fsync_dir", "sha256_file", "atomic_write"]


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


def atomic_write(path: str, write: Callable[[IO], None], *, binary: bool = True) -> None:
    """Write ``path`` so readers see the old file or the new one, never half of either.

    ``write(fh)`` fills a temp file next to ``path``; it is fsynced, renamed over ``path``
    and the directory entry is made durable. On any error the temp file is removed.
    """
    d = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(d, f".{os.path.basename(path)}.tmp-{os.getpid()}-{secrets.token_hex(3)}")
    try:
        with open(tmp, "wb" if binary else "w", **({} if binary else {"encoding": "utf-8"})) as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    fsync_dir(d)
