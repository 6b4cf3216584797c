"""The agent's side of ``flodl_worker.prefork``: rank processes forked from a preloaded
interpreter, each seen through the part of ``subprocess.Popen`` the agent uses.

``Prefork.start(env)`` starts the server (``python -m flodl_worker.prefork``) with the
ranks' environment (less their ``FLODL_*`` variables, which it never reads), and
``Prefork.serves(argv, env)`` says whether a command can be forked from it: the agent's
own interpreter running ``-m MODULE`` or a script, in an environment that differs from
the server's only in ``FLODL_*``, and that fits the room the server keeps for what
``/proc`` shows of a child. Anything else is a plain ``Popen``, as it always was.

``Prefork.spawn(argv, env)`` returns a ``ForkedProcess`` at once (the server may still
be importing torch: the request waits in the socket). Its ``stdout`` / ``stderr`` are the
read ends of pipes the agent made, ``poll()`` / ``wait()`` / ``returncode`` follow what the
server reports, and ``send_signal`` goes through the server, which alone can tell a
running child from a reaped one. The agent polls ``fileno()`` with its other sockets: a
report wakes it as SIGCHLD does for its own children.

If the server dies, the children die with it (their death signal): each is reported
ended by SIGKILL, once, with the cause logged, and the agent starts any later rank as a
plain process.
"""

from __future__ import annotations

import array
import json
import logging
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import time

from flodl.procutil import death_signal_hook

from .prefork import MAX_PACKET, fits, room, server_command, server_env

__all__ = ["ForkedProcess", "Prefork", "start_prefork"]

log = logging.getLogger("flodl.agent")

STOP_TIMEOUT_S = 5.0


class ForkedProcess:
    """A rank forked by the prefork server: the ``Popen`` subset the agent uses."""

    def __init__(self, server: "Prefork", rid: int, stdout, stderr):
        self._server = server
        self.id = rid
        self.pid: int | None = None  # known once the server forked it
        self.returncode: int | None = None
        self.stdout = stdout
        self.stderr = stderr

    def poll(self) -> int | None:
        self._server.pump(0.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        end = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            left = None if end is None else end - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(f"forked rank {self.pid}", timeout)
            self._server.pump(0.2 if left is None else min(0.2, left))
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            self._server.signal(self, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


class Prefork:
    def __init__(self, proc: subprocess.Popen, sock: socket.socket, env: dict[str, str], room: tuple[int, int]):
        self.proc = proc
        self.sock = sock
        self.env = env  # the server's: what a forked rank's environment may differ from only in FLODL_*
        self._room = room  # bytes of argv and environment it was exec'd with: what a child can show
        self.children: dict[int, ForkedProcess] = {}
        self.next_id = 0
        self.dead = False

    @classmethod
    def start(cls, env: dict[str, str], preexec=None) -> "Prefork":
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        shared = _shared(env)
        argv, started_env = server_command(sys.executable, theirs.fileno()), server_env(shared)
        try:
            proc = subprocess.Popen(
                argv, env=started_env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                pass_fds=(theirs.fileno(),), start_new_session=True, preexec_fn=preexec,
            )  # fmt: skip
        finally:
            theirs.close()
        ours.setblocking(False)
        return cls(proc, ours, shared, room(argv, started_env))

    @staticmethod
    def eligible(argv: list[str]) -> bool:
        """Could ``argv`` run forked (its environment aside): this interpreter running
        ``-m MODULE`` or a script, no interpreter options."""
        if len(argv) < 2 or not _is_our_python(argv[0]):
            return False
        if argv[1] == "-m":
            return len(argv) >= 3
        return not argv[1].startswith("-") and os.path.isfile(argv[1])

    def fileno(self) -> int:
        return self.sock.fileno()

    def serves(self, argv: list[str], env: dict[str, str]) -> bool:
        """Can ``argv`` in ``env`` be forked from this server (see the module doc)?"""
        return (not self.dead and self.eligible(argv) and _shared(env) == self.env
                and fits(argv, env, self._room))  # fmt: skip

    def spawn(self, argv: list[str], env: dict[str, str]) -> ForkedProcess:
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        null = os.open(os.devnull, os.O_RDONLY)
        rid, self.next_id = self.next_id, self.next_id + 1
        msg = {"op": "spawn", "id": rid, "argv0": argv[0], "argv": list(argv[1:]), "env": dict(env), "cwd": os.getcwd()}
        try:
            self._send(msg, [null, out_w, err_w])
        except OSError:
            for f in (out_r, err_r):
                os.close(f)
            raise
        finally:
            for f in (null, out_w, err_w):
                os.close(f)
        child = ForkedProcess(self, rid, os.fdopen(out_r, "rb", 0), os.fdopen(err_r, "rb", 0))
        self.children[rid] = child
        return child

    def signal(self, child: ForkedProcess, sig: int) -> None:
        try:
            self._send({"op": "signal", "id": child.id, "sig": int(sig)}, [])
        except OSError:
            self.pump(0.0)  # the server is gone: so is the child (reported there)

    def pump(self, timeout: float) -> None:
        """Take in the server's reports (waiting up to ``timeout`` for the first)."""
        if self.dead:
            return
        if timeout > 0:
            select.select([self.sock], [], [], timeout)
        while True:
            try:
                data = self.sock.recv(MAX_PACKET)
            except BlockingIOError:
                return
            except OSError:
                data = b""
            if not data:
                self._lost()
                return
            msg = json.loads(data)
            child = self.children.get(msg.get("id"))
            if child is None:
                continue
            if "pid" in msg:
                child.pid = msg["pid"]
            if "code" in msg:
                child.returncode = int(msg["code"])
                del self.children[child.id]

    def close(self) -> None:
        """End the server (its children are ended already, or end with it)."""
        self.sock.close()
        try:
            self.proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def _send(self, msg: dict, fds: list[int]) -> None:
        data = json.dumps(msg).encode()
        anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
        self.sock.setblocking(True)
        try:
            self.sock.sendmsg([data], anc)
        finally:
            self.sock.setblocking(False)

    def _lost(self) -> None:
        self.dead = True
        try:
            code = self.proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:  # closed its end without exiting: end it
            self.proc.kill()
            code = self.proc.wait()
        running = [c for c in self.children.values() if c.returncode is None]
        if running:
            log.error("the prefork server exited (%s) with %d rank(s) it had started: they end with it "
                      "(reported as killed by signal 9); later ranks start as plain processes",
                      f"code {code}" if code >= 0 else f"signal {-code}", len(running))  # fmt: skip
        for c in running:
            c.returncode = -signal.SIGKILL
        self.children.clear()


def start_prefork(command: list[str], env: dict[str, str]) -> Prefork | None:
    """The server for ranks that run ``command`` in ``env`` (a rank's, ``FLODL_*`` aside),
    dying with this process; None when the command cannot be forked, or when the server
    cannot start (logged: the ranks then start as plain processes)."""
    if not Prefork.eligible(command):
        return None
    try:
        return Prefork.start(env, death_signal_hook())
    except OSError as e:
        log.error("cannot start the prefork server (%s): the ranks start as plain processes", e)
        return None


def _shared(env: dict[str, str]) -> dict[str, str]:
    """What a forked rank shares with the server: its environment less ``FLODL_*``."""
    return {k: v for k, v in env.items() if not k.startswith("FLODL_")}


def _is_our_python(word: str) -> bool:
    """``word`` runs this interpreter: sys.executable, or a ``python*`` name beside it
    (a venv's python / python3) that is the same binary."""
    path = shutil.which(word)
    if path is None:
        return False
    here = os.path.abspath(sys.executable)
    path = os.path.abspath(path)
    if path == here:
        return True
    return (os.path.dirname(path) == os.path.dirname(here) and os.path.basename(path).startswith("python")
            and os.path.realpath(path) == os.path.realpath(here))  # fmt: skip
