"""Process helpers shared by the launcher (``flodl run``), the agent and the ranks:
children that die with their parent, and a process that ends without its teardown.

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

``process_age_s()`` is how long ago this process started (Linux: its start time in
``/proc/self/stat`` against CLOCK_BOOTTIME, the clock it is counted in), so that a
service can say when its first batch came *since it was started* (imports included).

``exit_now(code)`` ends the process as a normal exit does -- non-daemon threads
joined, ``atexit`` handlers run, logs, open files and stdio flushed -- but skips the interpreter's
teardown of every module, which for a process that imported torch took 1.3-1.5 s on an
idle 2-core machine (3.5 s on a loaded one) after the rank had nothing left to do.
"""

from __future__ import annotations

import ctypes
import gc
import io
import os
import signal
import sys
import time
from typing import Callable, NoReturn

__all__ = ["death_signal_hook", "exit_now", "process_age_s", "PR_SET_PDEATHSIG"]

PR_SET_PDEATHSIG = 1
_IO_BASE = getattr(io, "_IOBase", None) or io.IOBase.__mro__[1]  # _io._IOBase: what every file object derives from


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


def exit_now(code: int) -> NoReturn:
    """End the process with ``code`` once what a normal exit guarantees is done (see above)."""
    import atexit
    import logging
    import threading

    for t in threading.enumerate():
        if t is not threading.current_thread() and not t.daemon:
            t.join()
    atexit._run_exitfuncs()
    logging.shutdown()
    # The teardown would have flushed files the user's code left open (a log opened at
    # module level, never closed): flush every one that is still open, stdio last. The
    # test is on the type, the C base every file object has: isinstance would ask each
    # object for __class__ (deprecation shims such as torch.distributed's reduce_op warn
    # on that) and go through the ABC machinery of io.IOBase (0.2 s over torch's 300k
    # objects; this takes 0.08 s). A prefork server froze what it imported: not scanned.
    files = [obj for obj in gc.get_objects() if issubclass(type(obj), _IO_BASE)]
    for obj in files:
        if obj not in (sys.stdout, sys.stderr):
            _flush(obj)
    for stream in (sys.stdout, sys.stderr):
        _flush(stream)
    os._exit(code)


def _flush(f) -> None:
    try:
        if not f.closed:
            f.flush()
    except (OSError, ValueError, AttributeError):  # closed, gone, or not writable: nothing to keep
        pass


def process_age_s() -> float:
    """Seconds since this process started (0.0 where the platform does not say)."""
    try:
        with open("/proc/self/stat", encoding="ascii") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22: starttime, in ticks since boot
        return max(0.0, time.clock_gettime(time.CLOCK_BOOTTIME) - started)
    except (OSError, ValueError, IndexError, AttributeError):
        return 0.0
