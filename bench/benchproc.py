"""What the process-driving benches share: start a service and wait for its READY line,
and follow a growing journal (another process's file) record by record."""

from __future__ import annotations

import json
import os
import subprocess
from typing import IO, Iterator, Optional

__all__ = ["start_ready", "JournalTail", "peer_env"]


def peer_env(peer: str, keep_path: bool = False) -> dict[str, str]:
    """This process's environment with another checkout's three package roots as
    ``PYTHONPATH`` (a ``--peer`` bench runs the code before in a subprocess); with
    ``keep_path`` the current ``PYTHONPATH`` follows them."""
    env = dict(os.environ)
    paths = [peer, os.path.join(peer, "coordinator"), os.path.join(peer, "worker")]
    if keep_path:
        paths += [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return env


def start_ready(cmd: list[str], log: IO[str], token: str = "COORDINATOR_READY", **popen) -> tuple[subprocess.Popen, str]:
    """Start ``cmd`` (stdout and stderr piped, text) and read its stdout up to the line that
    starts with ``token``; the lines before it go to ``log``. Returns (process, the line's
    second word: the endpoint). RuntimeError, naming the log, if it never says it."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1, **popen)
    for line in iter(proc.stdout.readline, ""):
        if line.startswith(token):
            return proc, line.split()[1]
        log.write(line)
    raise RuntimeError(f"{cmd[2] if len(cmd) > 2 else cmd[0]} never said {token}; see {getattr(log, 'name', 'its log')}")


class JournalTail:
    """The records appended to a JSON-lines journal since the last call (whole lines only:
    a line being written waits for its newline). ``marker``: only lines holding these
    bytes are parsed (the rest are skipped unread: the hot loop of a bench)."""

    def __init__(self, path, marker: Optional[bytes] = None) -> None:
        self.path, self.marker = path, marker
        self.pos, self.buf = 0, b""

    def new(self) -> Iterator[dict]:
        try:
            with open(self.path, "rb") as fh:
                fh.seek(self.pos)
                chunk = fh.read()
        except OSError:  # not created yet
            return
        self.pos += len(chunk)
        *whole, self.buf = (self.buf + chunk).split(b"\n")
        for line in whole:
            if line.strip() and (self.marker is None or self.marker in line):
                yield json.loads(line)
