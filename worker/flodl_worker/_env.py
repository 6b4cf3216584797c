"""The rank's identity, parsed once from the environment (torchrun-style).

Every variable is read here and nowhere else; the runtime sees typed fields. A missing
or malformed variable is an ``EnvError`` whose message is one line naming the variable,
what it holds and what was wrong — the rank prints it and exits 2.

=====================  ==========  =====================================================
Variable               Required    Meaning
=====================  ==========  =====================================================
FLODL_RANK             no          global rank, 0 <= rank < world size. Unset: the
                                   coordinator gives this process the lowest free slot
                                   (an agent without --rank-offset leaves it unset)
FLODL_WORLD_SIZE       yes         number of ranks in the run (>= 1)
FLODL_CONNECT          yes         endpoint to dial: the host's relay frontend or the
                                   coordinator itself (tcp://HOST:PORT or ipc://PATH)
FLODL_SESSION          no          run id every frame names (default ``flodl``, the
                                   coordinator's default)
FLODL_HOST             no          logical host name (default: socket.gethostname())
FLODL_LOCAL_RANK       no          index of this rank on its host (default 0): device="auto" picks cuda:LOCAL_RANK;
                                   without FLODL_RANK the hello names it (its agent's
                                   exit reports name the process by it)
FLODL_SLOWDOWN         no          emulated device speed: every batch additionally sleeps
                                   FLODL_BASE_MS x factor. Unset = no emulation.
FLODL_BASE_MS          no          base of the emulated sleep in ms (default 10)
FLODL_TRACE_DIR        no          append "epoch sample_id" per trained sample to
                                   ``<dir>/rank<R>.trace`` (coverage checks in tests)
FLODL_HELLO_TIMEOUT_S  no          how long to wait for the coordinator's hello_ack
                                   (default 60: covers a coordinator that starts late)
FLODL_STORE_HOST       no          collective plane: the address other ranks reach this
                                   rank's TCPStore at, when it hosts one (default: what
                                   the host name resolves to, as gloo itself uses; set it
                                   on multi-host runs, with GLOO_SOCKET_IFNAME/NCCL_...)
FLODL_CURVE_SERVER_KEY no          CURVE, only for a rank that dials the coordinator
                                   directly over the network: the coordinator's public
                                   certificate (NAME.key). Set with the next, or neither
FLODL_CURVE_SECRET_KEY no          CURVE: this rank's own secret certificate
                                   (NAME.key_secret), allowlisted at the coordinator.
                                   A rank behind its host's relay needs neither (ipc /
                                   loopback to the relay; the agent does not pass them)
FLODL_MAX_MESSAGE_BYTES no         the largest message part (one tensor) this rank
                                   accepts (ZeroMQ MAXMSGSIZE; default 2 GiB, 0 = no
                                   limit; flodl.limits). Same variable as the
                                   coordinator's max_message_bytes
FLODL_AGENT_TOKEN      no          set by the agent that launched this rank (hex); the
                                   rank's hello names it, and only that agent's exit
                                   reports about this rank are then believed
FLODL_RESTART_COUNT    no          set by the agent when it starts a failed rank again
                                   (1, 2, ...); the hello carries it (the join record)
FLODL_FAULT            no          test failpoint, never in production:
                                   ``exit_in_collective:CYCLE[@RANK]`` SIGKILLs the rank
                                   (only RANK, if given) as it launches the all-reduce
                                   of averaging cycle CYCLE, before its part leaves
=====================  ==========  =====================================================
"""

from __future__ import annotations

import math
import re
import socket
from dataclasses import dataclass, field
from typing import Mapping

from flodl.curve import ENV_SECRET_KEY, ENV_SERVER_KEY, ClientKeys, CurveError, client_keys
from flodl.limits import DEFAULT_MAX_MESSAGE_BYTES, ENV_MAX_MESSAGE_BYTES, parse_max_message_bytes

__all__ = ["EnvError", "RankEnv", "DEFAULT_SESSION", "UNPINNED"]

UNPINNED = -1  # RankEnv.rank without FLODL_RANK: the coordinator gives the slot

DEFAULT_SESSION = "flodl"  # the coordinator's default session (flodl_coordinator.settings)
DEFAULT_BASE_MS = 10.0
# A coordinator may start after its ranks (ZeroMQ queues the hello until it binds), so
# this is generous; a rank must still never wait forever.
DEFAULT_HELLO_TIMEOUT_S = 60.0


class EnvError(Exception):
    """The environment does not describe a rank. The message is one printable line."""


def _required(env: Mapping[str, str], name: str, hint: str) -> str:
    v = env.get(name, "").strip()
    if not v:
        raise EnvError(f"{name} is not set ({hint}); the agent or launcher sets it")
    return v


def _int(env: Mapping[str, str], name: str, value: str, *, lo: int) -> int:
    try:
        n = int(value)
    except ValueError:
        raise EnvError(f"{name}={value!r} is not an integer") from None
    if n < lo:
        raise EnvError(f"{name}={n} must be >= {lo}")
    return n


def _float(name: str, value: str, *, lo: float, above: bool = False) -> float:
    try:
        x = float(value)
    except ValueError:
        raise EnvError(f"{name}={value!r} is not a number") from None
    if not math.isfinite(x) or x < lo or (above and x == lo):
        raise EnvError(f"{name}={value!r} must be a finite number {'>' if above else '>='} {lo:g}")
    return x


@dataclass(frozen=True, slots=True)
class RankEnv:
    rank: int  # UNPINNED (-1): FLODL_RANK unset, the coordinator picks (HelloAck.rank)
    world_size: int
    connect: str
    session: str
    host: str
    local_rank: int = 0
    slowdown: float | None = None
    base_ms: float = DEFAULT_BASE_MS
    trace_dir: str | None = None
    hello_timeout_s: float = DEFAULT_HELLO_TIMEOUT_S
    store_host: str = ""  # FLODL_STORE_HOST ("" = resolve the host name)
    fault_exit_cycle: int | None = None  # FLODL_FAULT aimed at this rank: die in this cycle's all-reduce
    curve: ClientKeys | None = None  # FLODL_CURVE_SERVER_KEY + FLODL_CURVE_SECRET_KEY, loaded
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES  # FLODL_MAX_MESSAGE_BYTES (0 = no limit)
    agent_token: bytes = field(default=b"", repr=False)  # FLODL_AGENT_TOKEN: who may report our exit
    coordinator: str = ""  # FLODL_COORDINATOR: the address the user gave the agent (messages name it)
    restart_count: int = 0  # FLODL_RESTART_COUNT: the agent started this rank again this many times

    @property
    def pinned(self) -> bool:
        return self.rank != UNPINNED

    @property
    def coordinator_name(self) -> str:
        """The coordinator as the user knows it: its address, and how we reach it."""
        if self.coordinator and self.coordinator != self.connect:
            return f"{self.coordinator} (via the relay at {self.connect})"
        return self.connect

    @property
    def emulated_ms(self) -> float:
        """Extra sleep per batch emulating a slower device (0 = none)."""
        return 0.0 if self.slowdown is None else self.base_ms * self.slowdown

    @classmethod
    def from_environ(cls, env: Mapping[str, str]) -> "RankEnv":
        pinned = env.get("FLODL_RANK", "").strip()
        rank = _int(env, "FLODL_RANK", pinned, lo=0) if pinned else UNPINNED
        world = _int(
            env, "FLODL_WORLD_SIZE", _required(env, "FLODL_WORLD_SIZE", "number of ranks in the run"), lo=1
        )
        if rank >= world:
            raise EnvError(f"FLODL_RANK={rank} is out of range for FLODL_WORLD_SIZE={world}")
        connect = _required(env, "FLODL_CONNECT", "endpoint of the relay or coordinator, e.g. tcp://127.0.0.1:5555")
        if not connect.startswith(("tcp://", "ipc://", "inproc://")):
            raise EnvError(f"FLODL_CONNECT={connect!r} must start with tcp://, ipc:// or inproc://")
        session = env.get("FLODL_SESSION", "").strip() or DEFAULT_SESSION
        host = env.get("FLODL_HOST", "").strip() or socket.gethostname()
        local = env.get("FLODL_LOCAL_RANK", "").strip()
        slow = env.get("FLODL_SLOWDOWN", "").strip()
        base = env.get("FLODL_BASE_MS", "").strip()
        hello = env.get("FLODL_HELLO_TIMEOUT_S", "").strip()
        restarts = env.get("FLODL_RESTART_COUNT", "").strip()
        return cls(
            rank=rank,
            world_size=world,
            connect=connect,
            session=session,
            host=host,
            local_rank=_int(env, "FLODL_LOCAL_RANK", local, lo=0) if local else 0,
            slowdown=_float("FLODL_SLOWDOWN", slow, lo=0.0) if slow else None,
            base_ms=_float("FLODL_BASE_MS", base, lo=0.0) if base else DEFAULT_BASE_MS,
            trace_dir=env.get("FLODL_TRACE_DIR", "").strip() or None,
            coordinator=env.get("FLODL_COORDINATOR", "").strip(),
            restart_count=_int(env, "FLODL_RESTART_COUNT", restarts, lo=0) if restarts else 0,
            hello_timeout_s=_float("FLODL_HELLO_TIMEOUT_S", hello, lo=0.0, above=True)
            if hello
            else DEFAULT_HELLO_TIMEOUT_S,
            store_host=env.get("FLODL_STORE_HOST", "").strip(),
            fault_exit_cycle=_fault(env.get("FLODL_FAULT", "").strip(), rank),
            curve=_curve(env),
            max_message_bytes=_max_message_bytes(env),
            agent_token=_agent_token(env),
        )


def _agent_token(env: Mapping[str, str]) -> bytes:
    text = env.get("FLODL_AGENT_TOKEN", "").strip()
    try:
        token = bytes.fromhex(text)
    except ValueError:
        raise EnvError("FLODL_AGENT_TOKEN is not hex (the agent sets it; do not set it by hand)") from None
    if len(token) > 64:
        raise EnvError(f"FLODL_AGENT_TOKEN holds {len(token)} bytes, at most 64")
    return token


def _max_message_bytes(env: Mapping[str, str]) -> int:
    text = env.get(ENV_MAX_MESSAGE_BYTES, "").strip()
    try:
        return parse_max_message_bytes(text) if text else DEFAULT_MAX_MESSAGE_BYTES
    except ValueError as e:
        raise EnvError(str(e)) from None


def _curve(env: Mapping[str, str]) -> ClientKeys | None:
    """The CURVE client keys named by FLODL_CURVE_SERVER_KEY / FLODL_CURVE_SECRET_KEY, or None."""
    try:
        return client_keys(
            env.get(ENV_SERVER_KEY, "").strip(), env.get(ENV_SECRET_KEY, "").strip(),
            names=(ENV_SERVER_KEY, ENV_SECRET_KEY),
        )
    except CurveError as e:
        raise EnvError(str(e)) from None


def _fault(value: str, rank: int) -> int | None:
    """FLODL_FAULT=exit_in_collective:CYCLE[@RANK] -> CYCLE for that rank (None: no fault here)."""
    if not value:
        return None
    m = re.fullmatch(r"exit_in_collective:(\d+)(?:@(\d+))?", value)
    if m is None:
        raise EnvError(f"FLODL_FAULT={value!r} is not a known failpoint (exit_in_collective:CYCLE[@RANK])")
    if m.group(2) is not None and int(m.group(2)) != rank:
        return None
    return int(m.group(1))
