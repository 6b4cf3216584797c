"""flodl_worker.prefork: one interpreter that imports torch once and forks the host's ranks.

    python -m flodl_worker.prefork FD     # started by the agent; FD: its end of a socketpair

Why: a rank process spends its first 3-4 s of CPU importing torch (1.9 s) and, at its
first optimizer, ``torch._dynamo`` (1.6 s). Three ranks on two cores paid that side by
side: 5-6 s before the world could form. Here the imports are paid once, and each rank
is a ``fork`` of an interpreter that already holds them (copy-on-write: no memory for
what they share).

Theory of operation
-------------------
One process, one thread, one loop, no torch op ever run (a fork after one -- an OpenMP
pool started -- can hang the child's first parallel region) and no CUDA initialised (a
child forked after that cannot use the GPU: "Cannot re-initialize CUDA in forked
subprocess"; the imports touch neither, and the tests check a child is not in a bad fork), no flodl module imported
(those read ``FLODL_*`` at import, which differ per rank). The agent talks over a
``SOCK_SEQPACKET`` socketpair, one JSON message per packet:

* agent -> here ``{"op": "spawn", "id", "argv0", "argv", "env", "cwd"}`` with three file
  descriptors (the child's stdin, stdout, stderr) -- then here -> agent ``{"id", "pid"}``.
  The child runs the command as ``python -m MODULE ARGS`` or ``python SCRIPT ARGS``
  would (``runpy``; ``sys.argv``, ``sys.path[0]``, ``__main__``), in the command's own
  environment, in its own session, and gets SIGTERM when this process dies (as the
  agent's other children do when the agent dies: ``flodl.procutil``).
* agent -> here ``{"op": "signal", "id", "sig"}``: sent to that child (a child reaped
  already is not signalled again: no pid reuse).
* here -> agent ``{"id", "code"}`` when a child ends: ``subprocess.Popen`` semantics
  (negative: the signal that killed it).

What ``ps``, ``pgrep -f`` and ``/proc/PID/environ`` show of a forked child is rewritten to
its own command and environment (the kernel shows the strings a process was exec'd
with: the server's), in place, in room the server was started with (``ARGV_ROOM`` bytes
of argv, ``ENV_ROOM`` of environment, blank padding it clears from its own view): a
forked rank is found as a fresh one is. ``fits`` says whether a command does; the agent
starts one that does not as a plain process.

The agent closing its end ends this process (the children run on, each until its own
end or this process's: see above). ``flodl_worker.forked`` is the agent's side.
"""

from __future__ import annotations

import array
import gc
import json
import os
import select
import signal
import socket
import sys

__all__ = ["ARGV_ROOM", "ENV_ROOM", "MAX_PACKET", "ROOM_VAR", "fits", "preload", "room", "serve", "server_command",
           "server_env"]

MAX_PACKET = 1 << 20  # one spawn request: an environment and an argv
PRELOAD = ("torch", "torch._dynamo")  # what every rank imports; the second is torch.optim's first step
# Bytes of argv and environment a forked child may show as its own (see the module doc):
# a rank's command is a few hundred bytes, its FLODL_* variables 1-2 KiB more than ours.
ARGV_ROOM = 4096
ENV_ROOM = 16384
ROOM_VAR = "FLODL_PREFORK_ROOM"  # the environment's room: a variable of blanks


def server_command(python: str, fd: int) -> list[str]:
    """How the agent starts this server: its last word is the argv room (blanks)."""
    return [python, "-m", "flodl_worker.prefork", str(fd), " " * ARGV_ROOM]


def server_env(env: dict[str, str]) -> dict[str, str]:
    return {**env, ROOM_VAR: " " * ENV_ROOM}


def _block(words) -> bytes:
    return b"".join(os.fsencode(w) + b"\0" for w in words)


def _env_words(env: dict[str, str]) -> list[str]:
    return [f"{k}={v}" for k, v in env.items()]


def room(argv: list[str], env: dict[str, str]) -> tuple[int, int]:
    """Bytes of argv and of environment a process exec'd with these shows in /proc."""
    return len(_block(argv)), len(_block(_env_words(env)))


def fits(argv: list[str], env: dict[str, str], server_room: tuple[int, int]) -> bool:
    """Do ``argv`` and ``env`` fit in the room of a server (``room`` of what it was exec'd with)?"""
    need = room(argv, env)
    return need[0] <= server_room[0] and need[1] <= server_room[1]


def _show_as(argv: list[str], env: dict[str, str] | None) -> None:
    """Make /proc/self/cmdline read ``argv`` and /proc/self/environ ``env`` (None: left
    as it is; so is what does not fit: the agent only sends what fits). The environment's
    strings are overwritten only once nothing points into them: ``os.environ.clear()``
    unset them all, and what was set after is the C library's own copies."""
    try:
        with open("/proc/self/stat", "rb") as fh:
            stat = fh.read()
        # Fields 48-51 (arg_start, arg_end, env_start, env_end); field 3 follows the ")".
        arg_start, arg_end, env_start, env_end = (int(f) for f in stat[stat.rindex(b")") + 2 :].split()[45:49])
    except (OSError, ValueError):
        return
    import ctypes

    blocks = [(arg_start, arg_end, _block(argv))]
    if env is not None:
        blocks.append((env_start, env_end, _block(_env_words(env))))
    for start, end, data in blocks:
        if start and len(data) <= end - start:
            ctypes.memmove(start, data + b"\0" * (end - start - len(data)), end - start)


def preload() -> None:
    """Import what every rank will. A module that cannot be imported is skipped: the
    rank that needs it fails the same way a fresh process would."""
    for name in PRELOAD:
        try:
            __import__(name)
        except Exception:  # noqa: BLE001 - the child says why, as a fresh interpreter would
            break


def _send(sock: socket.socket, msg: dict) -> None:
    try:
        sock.send(json.dumps(msg).encode())
    except OSError:
        pass  # the agent is gone: nobody left to tell


def _recv(sock: socket.socket) -> tuple[dict | None, list[int]]:
    """One request and its descriptors; (None, []) at EOF."""
    fds = array.array("i")
    data, anc, _flags, _addr = sock.recvmsg(MAX_PACKET, socket.CMSG_LEN(16 * fds.itemsize))
    for level, kind, payload in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
    if not data:
        return None, list(fds)
    return json.loads(data), list(fds)


def serve(fd: int) -> int:
    sock = socket.socket(fileno=fd)
    _show_as(server_command(sys.executable, fd)[:-1], None)  # the argv room (its last word), out of sight
    preload()
    # What the imports made lives as long as every child: out of their collector's sight
    # (no copy-on-write of pages a collection would touch, no walk over them at a child's
    # exit_now scan: 0.3 s with torch's 300k objects), as the gc docs advise before a fork.
    gc.freeze()
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # only to wake the select
    children: dict[int, int] = {}  # pid -> request id, while it runs
    by_id: dict[int, int] = {}
    while True:
        ready, _, _ = select.select([sock, wake_r], [], [], 1.0)
        if wake_r in ready:
            try:
                while os.read(wake_r, 4096):
                    pass
            except BlockingIOError:
                pass
        _reap(sock, children, by_id)
        if sock not in ready:
            continue
        try:
            msg, fds = _recv(sock)
        except (OSError, ValueError) as e:
            print(f"flodl prefork: unreadable request: {e}", file=sys.stderr, flush=True)
            return 1
        if msg is None:
            return 0  # the agent closed its end
        try:
            _handle(sock, msg, fds, children, by_id, [sock.fileno(), wake_r, wake_w])
        finally:
            for f in fds:  # the child has its own copies
                os.close(f)


def _handle(sock: socket.socket, msg: dict, fds: list[int], children: dict[int, int], by_id: dict[int, int],
            close: list[int]) -> None:  # fmt: skip
    op = msg.get("op")
    if op == "spawn":
        pid = _fork(msg, fds, close)
        children[pid] = msg["id"]
        by_id[msg["id"]] = pid
        _send(sock, {"id": msg["id"], "pid": pid})
    elif op == "signal":
        pid = by_id.get(msg["id"])
        if pid is not None and pid in children:  # reaped: its pid may be another's now
            try:
                os.kill(pid, int(msg["sig"]))
            except ProcessLookupError:
                pass


def _reap(sock: socket.socket, children: dict[int, int], by_id: dict[int, int]) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        rid = children.pop(pid, None)
        if rid is not None:
            _send(sock, {"id": rid, "code": os.waitstatus_to_exitcode(status)})


def _fork(msg: dict, fds: list[int], close: list[int]) -> int:
    parent = os.getpid()
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:  # the child: never returns into the loop above
        _become(msg, fds, close, parent)
        code = _run(list(msg["argv"]))
    except BaseException:  # noqa: BLE001 - a child that could not even start
        import traceback

        traceback.print_exc()
    from flodl.procutil import exit_now  # (imported in the child: its FLODL_* environment)

    exit_now(code)


def _become(msg: dict, fds: list[int], close: list[int], parent: int) -> None:
    """Turn this forked child into what ``Popen(argv, env=env, start_new_session=True)``
    with the agent's death hook would have started."""
    signal.set_wakeup_fd(-1)
    for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGPIPE, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)  # as the interpreter sets it at start-up
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.setsid()
    _die_with(parent)
    for target, f in enumerate(fds[:3]):
        os.dup2(f, target)
    for f in set(fds) | set(close):
        if f > 2:
            os.close(f)
    os.environ.clear()
    os.environ.update(msg["env"])
    _show_as([msg["argv0"], *msg["argv"]], msg["env"])
    os.chdir(msg.get("cwd") or os.getcwd())
    if os.environ.get("PYTHONUNBUFFERED"):
        for stream in (sys.stdout, sys.stderr):
            stream.reconfigure(write_through=True)


def _die_with(parent: int) -> None:
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG
    if os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGTERM)


def _run(argv: list[str]) -> int:
    """Run ``python -m MODULE ARGS`` / ``python SCRIPT ARGS`` (``argv`` without the
    interpreter) as the interpreter would; the exit code it would have."""
    import runpy

    try:
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]  # runpy puts the module's file in argv[0]
            sys.path[0] = os.getcwd()
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as e:
        if e.code is None:
            return 0
        if isinstance(e.code, int):
            return e.code
        print(e.code, file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        import traceback

        traceback.print_exc()
        signal.signal(signal.SIGINT, signal.SIG_DFL)  # as the interpreter does: die of it
        os.kill(os.getpid(), signal.SIGINT)
        return 130
    except BaseException:  # noqa: BLE001 - the interpreter prints it and exits 1
        import traceback

        traceback.print_exc()
        return 1
    return 0


if __name__ == "__main__":
    code = serve(int(sys.argv[1]))
    sys.stderr.flush()
    os._exit(code)  # not the interpreter's teardown of torch: 1.3-1.5 s, and nothing here to flush
