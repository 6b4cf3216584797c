"""Fixtures for the worker tests: a scripted fake coordinator and process helpers.

The fake coordinator is a ROUTER on tcp://127.0.0.1 port 0 that the *test thread*
drives with ``flodl.wire``: every wait is a poll with a deadline, never a sleep.
"""

from __future__ import annotations

import os
import re
import select
import signal
import subprocess
import sys
import time

import pytest
import zmq

from flodl.wire import Decoded, Endpoint, SeqTracker, decode, pb, split_routing

SESSION = "worker-test"
REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))


class FakeCoordinator:
    def __init__(self, session: str = SESSION):
        self.session = session
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.sock.bind("tcp://127.0.0.1:0")
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.ep = Endpoint(session, pb.Sender.KIND_COORDINATOR, host="fake")
        self.seq = SeqTracker()
        self.command_id = 0
        self.agents_heard: set = set()

    def recv(self, timeout: float = 10.0, *, skip_heartbeats: bool = True) -> tuple[tuple, Decoded]:
        """Next decoded frame (route, Decoded); heartbeats skipped unless asked for."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self.sock.poll(int(left * 1000) + 1):
                raise AssertionError(f"fake coordinator: nothing within {timeout}s")
            route, payload = split_routing(self.sock.recv_multipart())
            d = decode(payload, session=self.session)
            self.seq.check(d.envelope)
            env = d.envelope
            if skip_heartbeats and env.WhichOneof("body") == "timing" and env.timing.WhichOneof("event") == "heartbeat":
                continue
            if env.WhichOneof("body") == "agent" and env.agent.WhichOneof("msg") == "hello":
                # Like the real one: an agent's hello is answered (else it is resent), once.
                ack = pb.AgentMsg(hello_ack=pb.AgentMsg.HelloAck(accepted=True))
                self.send(route, "agent", ack)
                if route in self.agents_heard:
                    continue
                self.agents_heard.add(route)
            return route, d

    def expect(self, body: str, event: str | None = None, timeout: float = 10.0, **kw):
        route, d = self.recv(timeout, **kw)
        env = d.envelope
        got = env.WhichOneof("body")
        if got == "timing":
            got_event = env.timing.WhichOneof("event")
        elif got == "agent":
            got_event = env.agent.WhichOneof("msg")
        else:
            got_event = None
        assert (got, got_event if event else None) == (body, event), f"expected {body}.{event}, got {got}.{got_event}"
        return route, d

    def send(self, route, body_field: str, body, blobs=()) -> None:
        self.sock.send_multipart(self.ep.frames(body_field, body, blobs, route=route))

    def control(self, route, **cmd) -> None:
        self.command_id += 1
        self.send(route, "control", pb.Control(command_id=self.command_id, **cmd))

    def raw(self, route, *frames) -> None:
        self.sock.send_multipart([*route, b"", *frames])

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


class LineReader:
    """Read lines from a child's pipe with a deadline (select, no sleeps).

    ``wait_for`` matches against every line read so far, not only new ones: children
    print concurrently, so lines arrive in any order.
    """

    def __init__(self, pipe):
        self.fd = pipe.fileno()
        os.set_blocking(self.fd, False)
        self.buf = b""
        self.seen: list[str] = []

    def wait_for(self, pattern: str, timeout: float = 10.0) -> re.Match:
        rx = re.compile(pattern)
        deadline = time.monotonic() + timeout
        while True:
            while b"\n" in self.buf:
                line, self.buf = self.buf.split(b"\n", 1)
                self.seen.append(line.decode(errors="replace"))
            for text in self.seen:
                m = rx.search(text)
                if m:
                    return m
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no line matching {pattern!r} within {timeout}s; saw {self.seen[-20:]}")
            ready, _, _ = select.select([self.fd], [], [], left)
            if ready:
                try:
                    data = os.read(self.fd, 65536)
                except BlockingIOError:
                    continue
                if not data:
                    raise AssertionError(f"EOF before a line matching {pattern!r}; saw {self.seen[-20:]}")
                self.buf += data


class Procs:
    """Start child processes; whatever is still alive at teardown is killed."""

    def __init__(self):
        self.procs: list[subprocess.Popen] = []

    def start(self, argv, *, env=None, **kw) -> subprocess.Popen:
        full_env = dict(os.environ)
        full_env.update(env or {})
        full_env.setdefault("OMP_NUM_THREADS", "1")
        full_env["PYTHONUNBUFFERED"] = "1"
        p = subprocess.Popen(
            argv, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, cwd=REPO, **kw
        )
        self.procs.append(p)
        return p

    def kill_all(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL) if p.pid == os.getpgid(p.pid) else p.kill()
                except ProcessLookupError:
                    pass
                p.wait(5)


@pytest.fixture
def coordinator():
    c = FakeCoordinator()
    yield c
    c.close()


@pytest.fixture
def procs():
    p = Procs()
    yield p
    p.kill_all()


def python_m(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", module, *args]


@pytest.fixture
def py():
    return python_m


@pytest.fixture
def lines():
    """``lines(proc.stdout)`` -> a LineReader over that pipe."""
    return LineReader
