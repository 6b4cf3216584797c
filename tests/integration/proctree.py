"""A process tree seen through /proc: descendants of a pid, and whether pids are gone."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path


def _ppid_state(pid: int) -> tuple[int, str] | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    rest = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) "
    return int(rest[1]), rest[0]


def descendants(root: int) -> set[int]:
    """Every live process below ``root`` (children in their own sessions included)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            ps = _ppid_state(int(entry))
            if ps is not None and ps[1] != "Z":
                children.setdefault(ps[0], []).append(int(entry))
    out, todo = set(), [root]
    while todo:
        for c in children.get(todo.pop(), []):
            if c not in out:
                out.add(c)
                todo.append(c)
    return out


def alive(pids) -> set[int]:
    """Those of ``pids`` that still run (a zombie awaiting its reaper counts as gone)."""
    return {p for p in pids if (ps := _ppid_state(p)) is not None and ps[1] != "Z"}


def commands(pids) -> dict[int, str]:
    """Each live pid's command line (what a failure names: a bare pid says nothing once
    the tree is killed)."""
    out = {}
    for p in pids:
        try:
            out[p] = Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()[:200]
        except OSError:
            pass
    return out


def wait_gone(pids, timeout: float) -> set[int]:
    """Wait up to ``timeout`` s for every pid to end; return those still alive."""
    end = time.monotonic() + timeout
    left = alive(pids)
    while left and time.monotonic() < end:
        time.sleep(0.1)  # polling other processes' exits: nothing to wait on
        left = alive(left)
    return left


def kill_all(pids) -> None:
    for p in alive(pids):
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
