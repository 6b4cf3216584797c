"""The coordinator's journal: append-only JSON lines, and when they are made durable.

Theory of operation
-------------------
Every decoded event is appended (``write``) *before* the core steps it, and flushed to
the kernel at once: a killed process (kill -9, OOM) loses nothing it stepped. A *host*
crash (power, kernel panic, a VM reset) loses what the kernel had not written to the
disk yet, so the journal is also ``fsync``\\ ed -- not per event (an fsync costs a disk
round trip) but at the points where losing the tail would be *unsafe*:

**Durability policy (write-ahead for everything that leaves).** Replay derives every
command from the events before it, so a command a rank saw must be derivable from the
durable journal: before any frame leaves the coordinator (a ``Control`` command, a
``hello_ack``, a consensus, a relay's fold), every record written so far is fsynced.
That covers every decision a rank can act on and report back -- admissions (the
``hello_ack``), averaging rounds opened (``RequestParams``) and finished (``Update``),
epochs aggregated, checkpoints asked and committed, shutdowns -- because each one goes
out as a frame. The service groups it: frames produced while it drains a batch of
inbound frames (up to ``DRAIN_BATCH``) or runs a tick are held, the journal is fsynced
once, then they are sent in order (``service._flush_outbox``). Events that send nothing
(most heartbeats, many batch reports) ride on the next fsync; losing them in a host
crash is what the ranks' resync already repairs (``flodl.core._resync``), since no
command was derived from them.

A journal that cannot be written (full disk, quota, I/O error) raises ``JournalError``
naming the path and the cause; the service then stops the run cleanly, since it can
no longer promise to recover it (``service``, README "Faults").
"""

from __future__ import annotations

import json
import os
import time
from typing import IO, Optional

from flodl.fsutil import describe_write_error

__all__ = ["Journal", "JournalError"]


class JournalError(Exception):
    """The journal cannot be written; ``str(e)`` is one line naming the path and why."""


class Journal:
    """One append-only journal file (created owner-only, 0600: it holds every rank's
    incarnation, which is what a forged frame would need to pass for that rank)."""

    def __init__(self, path: str) -> None:
        self.path = path
        try:
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        except OSError as e:
            raise JournalError(describe_write_error(e, path, "journal")) from None
        self._fh: Optional[IO[str]] = os.fdopen(fd, "a", encoding="utf-8")
        self.dirty = False  # records written since the last fsync
        self.fsyncs = 0
        # What /metrics shows (flodl_coordinator.metrics): size, records, durability lag.
        self.bytes = os.fstat(fd).st_size
        self.records = 0  # appended by this process
        self.unsynced = 0  # records not fsynced yet
        self.unsynced_since: Optional[float] = None  # time.monotonic() of the oldest of them

    def write(self, record: dict) -> None:
        """Append one record and hand it to the kernel (survives the process, not the host)."""
        if self._fh is None:
            return
        line = json.dumps(record, sort_keys=True) + "\n"
        try:
            self._fh.write(line)
            self._fh.flush()
        except OSError as e:
            raise JournalError(describe_write_error(e, self.path, "journal")) from None
        self.dirty = True
        self.bytes += len(line.encode())
        self.records += 1
        self.unsynced += 1
        if self.unsynced_since is None:
            self.unsynced_since = time.monotonic()

    def sync(self) -> None:
        """Make every record written so far durable (one fsync; nothing to do if clean)."""
        if self._fh is None or not self.dirty:
            return
        try:
            self._fh.flush()
            os.fsync(self._fh.fileno())
        except OSError as e:
            raise JournalError(describe_write_error(e, self.path, "journal")) from None
        self.dirty = False
        self.fsyncs += 1
        self.unsynced, self.unsynced_since = 0, None

    def close(self) -> None:
        fh, self._fh = self._fh, None
        if fh is None:
            return
        try:
            if self.dirty:
                fh.flush()
                os.fsync(fh.fileno())
        except OSError:
            pass  # what could not be written is lost either way; the caller was told
        try:
            fh.close()
        except OSError:
            pass
