"""Fault injection for real process trees: find a rank's process, wait for progress, strike."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path


def rank_pid(trace_dir: Path, rank: int) -> int | None:
    """The pid of the rank process started with this trace dir (scans /proc environ)."""
    return pid_with_env(f"FLODL_TRACE_DIR={trace_dir}", f"FLODL_RANK={rank}")


def pid_with_env(*assignments: str) -> int | None:
    """The pid of a rank process (an example task) whose environment holds every
    ``NAME=value`` given (scans /proc environ)."""
    want = {a.encode() for a in assignments}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            env = set(Path(f"/proc/{entry}/environ").read_bytes().split(b"\0"))
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        if want <= env and b"flodl_worker.examples" in cmd:
            return int(entry)
    return None


def lines_in(path: Path) -> int:
    try:
        with open(path, "rb") as fh:
            return sum(1 for _ in fh)
    except OSError:
        return 0


def strike_after(trace_dir: Path, rank: int, samples: int, sig: int, deadline_s: float = 120.0) -> dict:
    """Wait until ``rank`` traced ``samples`` samples, then send ``sig`` to it.

    Polls the rank's own trace file (its progress), not a clock: the strike point is a
    number of trained samples, so it is the same on a fast or a slow machine.
    """
    t_end = time.monotonic() + deadline_s
    trace = trace_dir / f"rank{rank}.trace"
    while time.monotonic() < t_end:
        if lines_in(trace) >= samples:
            pid = rank_pid(trace_dir, rank)
            if pid is not None:
                os.kill(pid, sig)
                return {"pid": pid, "at_samples": lines_in(trace), "t": time.monotonic()}
        time.sleep(0.02)  # polling another process's progress; nothing to wait on
    raise AssertionError(f"rank {rank} never reached {samples} traced samples")


def kill_quietly(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


class LineWatch:
    """Reads a process's text output on a thread (so the pipe never fills) and lets a test
    wait for a line to appear -- an event, not a clock."""

    def __init__(self, stream) -> None:
        self._lines: list[str] = []
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._pump, args=(stream,), daemon=True)
        self._thread.start()

    def _pump(self, stream) -> None:
        for line in stream:
            with self._cond:
                self._lines.append(line)
                self._cond.notify_all()
        with self._cond:
            self._lines.append("")  # EOF marker: nothing more will come
            self._cond.notify_all()

    def wait_for(self, text: str, timeout: float) -> bool:
        """True once a line holding ``text`` was seen; False at EOF or after ``timeout`` s."""
        with self._cond:
            return self._cond.wait_for(
                lambda: any(text in line for line in self._lines) or (self._lines and self._lines[-1] == ""),
                timeout,
            ) and any(text in line for line in self._lines)

    def text(self, timeout: float) -> str:
        """All of the output, once the stream ended (within ``timeout`` s)."""
        self._thread.join(timeout)
        with self._cond:
            return "".join(self._lines)
