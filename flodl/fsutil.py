"""Durable-file helpers shared by the coordinator and the worker (checkpoints)."""

from __future__ import annotations

import errno
import hashlib
import os
import secrets
from typing import IO, Callable, Optional

__all__ = ["fsync_dir", "sha256_file", "atomic_write", "NO_SPACE", "no_space", "describe_write_error"]

# A full disk or an exhausted quota: the two ways a write fails for want of room.
NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


def _os_error(e: Optional[BaseException]) -> Optional[OSError]:
    """The first ``OSError`` in ``e``'s chain (torch.save raises a RuntimeError whose
    context is the OSError of the failed write)."""
    seen = 0
    while e is not None and seen < 16:
        if isinstance(e, OSError) and e.errno is not None:
            return e
        e = e.__cause__ or e.__context__
        seen += 1
    return None


def no_space(e: BaseException) -> bool:
    """Whether ``e`` (or what caused it) is a write that failed for want of room."""
    oe = _os_error(e)
    return oe is not None and oe.errno in NO_SPACE


def describe_write_error(e: BaseException, path: str, what: str) -> str:
    """One line naming why writing ``path`` (``what``: journal, checkpoint, ...) failed:
    ``no space left on device: PATH (what)`` for a full disk, else the OS's words."""
    oe = _os_error(e)
    if oe is not None and oe.errno in NO_SPACE:
        word = "no space left on device" if oe.errno == errno.ENOSPC else "disk quota exceeded"
        return f"{word}: {path} ({what})"
    if oe is not None:
        return f"cannot write {path} ({what}): {oe.strerror or oe}"
    text = str(e).strip().splitlines()
    return f"cannot write {path} ({what}): {type(e).__name__}: {text[0] if text else ''}"


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
