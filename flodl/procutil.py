"""Process helpers shared by the launcher (``flodl run``) and the agent: children that
die with their parent.

``death_signal_hook(sig)`` is a ``preexec_fn`` for ``subprocess.Popen`` that asks Linux
(``prctl(PR_SET_PDEATHSIG)``) to send the child ``sig`` when its parent dies — kill -9
of a launcher or an agent included, which no handler of the parent can catch. Without
it, a dead launcher leaves its coordinator, agent, relay and ranks running.

Careful, as ``preexec_fn`` must be: the hook runs in the child between fork and exec,
where only async-signal-safe work is sound. libc is loaded here, in the parent (no
dlopen in the child, whose locks another thread may hold at fork time); the child only
makes three system calls. The parent's pid is taken before the fork: had the parent
already died by the time the child arms the signal, the child is orphaned and signals
itself at once (the race the man page warns about). The death signal fires when the
*thread* that forked the child ends, so spawn from the thread that lives as long as the
process (the main thread, as the launcher and the agent do).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from typing import Callable

__all__ = ["death_signal_hook", "PR_SET_PDEATHSIG"]

PR_SET_PDEATHSIG = 1


def death_signal_hook(sig: int = signal.SIGTERM) -> Callable[[], None] | None:
    """A ``preexec_fn`` that makes the child get ``sig`` when its parent dies (Linux), or None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()
    signum = int(sig)
    getppid, getpid, kill = os.getppid, os.getpid, os.kill

    def hook() -> None:  # pragma: no cover - runs in the child
        prctl(PR_SET_PDEATHSIG, signum)
        if getppid() != parent:  # the parent died before the signal was armed
            kill(getpid(), signum)

    return hook
