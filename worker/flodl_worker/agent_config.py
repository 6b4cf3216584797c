"""The agent's configuration and the environment it gives each rank.

Its own module, light on imports (no zmq, no protobuf, no numpy), so that the agent's
command line can start the prefork server (``flodl_worker.forked``) with the ranks'
environment before it imports the rest of the agent: the server's torch import is the
longest part of a host's start-up, and every tenth of a second before it starts is on
the path to the first batch.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

from flodl.curve import ENV_SECRET_KEY, ENV_SERVER_KEY
from flodl.limits import DEFAULT_MAX_MESSAGE_BYTES, ENV_MAX_MESSAGE_BYTES

__all__ = ["AgentConfig", "rank_env", "ranks_prefork", "slowdown_for"]


@dataclass(frozen=True, slots=True)
class AgentConfig:
    coordinator: str
    ranks: int
    command: tuple[str, ...]
    # The global rank of the first rank (the next get offset+1, ...); None: no rank is
    # pinned -- FLODL_RANK is unset and the coordinator gives each process the lowest free
    # slot in admission order (HelloAck.rank); exit reports name the process by its local rank.
    rank_offset: int | None = None
    world_size: int = 0  # 0: rank_offset + ranks (unpinned: ranks)
    session: str = "flodl"
    host: str = ""
    slowdown: tuple[float, ...] = ()
    base_ms: float | None = None
    trace_dir: str | None = None
    relay_bind: str | None = None  # None: ipc:// in a private temporary directory
    no_relay: bool = False
    fold: bool = True  # the relay folds the host's averaging rounds (False: --no-fold)
    term_timeout_s: float = 10.0
    # CURVE (flodl.curve): the coordinator's public certificate and this host's secret
    # certificate. They secure the agent's own DEALER and the relay's uplink; with
    # --no-relay the ranks get them as FLODL_CURVE_SERVER_KEY / FLODL_CURVE_SECRET_KEY.
    curve_server_key: str | None = None
    curve_secret_key: str | None = None
    # ZeroMQ MAXMSGSIZE (per part) of the relay's and the ranks' sockets (flodl.limits)
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    # A rank process that fails (a signal, or a code other than 0 and 2 = refused / bad
    # configuration) is started again up to this many times, after RESTART_BACKOFF_S
    # doubling, with FLODL_RESTART_COUNT in its environment (torchrun's --max-restarts).
    # Before the world forms its slot is free again and the new process joins; once the
    # run has formed the coordinator refuses it by name (it exits 2 and is not retried).
    max_restarts: int = 0
    # Each rank exit is appended here as one JSON line (rank, code, restarts, last_lines):
    # what a launcher reads to say why its ranks ended (``flodl run``); None: not written.
    exit_log: str | None = None
    # Fork the ranks from one interpreter that imported torch once (flodl_worker.prefork)
    # when the command is this interpreter running a module or a script; False
    # (--no-prefork): every rank is a fresh process.
    prefork: bool = True

    @property
    def world(self) -> int:
        return self.world_size or (self.rank_offset or 0) + self.ranks

    def rank_of(self, local: int) -> int | None:
        """The global rank local rank ``local`` is pinned to; None when unpinned."""
        return None if self.rank_offset is None else self.rank_offset + local

    @property
    def host_name(self) -> str:
        return self.host or socket.gethostname()


def slowdown_for(factors: tuple[float, ...], local: int, rank: int | None, ranks: int, world: int) -> float | None:
    """The slowdown factor of one rank: a single factor applies to all; N factors are
    indexed by local rank; world-size factors by global rank (one list for many agents:
    pinned ranks only -- ``rank`` None is an unpinned one)."""
    if not factors:
        return None
    if len(factors) == 1:
        return factors[0]
    if len(factors) == ranks:
        return factors[local]
    if len(factors) == world and rank is not None:
        return factors[rank]
    if len(factors) == world:
        raise ValueError(f"--slowdown has {len(factors)} factors, one per global rank: that needs --rank-offset "
                         f"(unpinned ranks get their global rank from the coordinator); give 1 or {ranks}")
    counts = sorted({1, ranks, world})
    raise ValueError(
        f"--slowdown has {len(factors)} factors; give {', '.join(map(str, counts))} "
        f"(one for all, one per local rank, or one per global rank)"
    )


def rank_env(cfg: AgentConfig, local: int, connect: str, base: dict[str, str], token: bytes = b"") -> dict[str, str]:
    """The environment of local rank ``local`` (torchrun-style identity + emulation).

    ``token``: the agent's own (FLODL_AGENT_TOKEN); the rank's hello names it, which is
    what makes the coordinator believe this agent's exit reports about the rank."""
    env = dict(base)
    rank = cfg.rank_of(local)
    env.pop("FLODL_RANK", None)  # never an inherited one: unpinned, the coordinator numbers it
    if rank is not None:
        env["FLODL_RANK"] = str(rank)
    env.update(
        FLODL_LOCAL_RANK=str(local),
        FLODL_LOCAL_WORLD_SIZE=str(cfg.ranks),
        FLODL_WORLD_SIZE=str(cfg.world),
        FLODL_CONNECT=connect,
        FLODL_SESSION=cfg.session,
        FLODL_HOST=cfg.host_name,
        FLODL_COORDINATOR=cfg.coordinator,  # what the user typed: errors name it, not the relay's ipc path
        PYTHONUNBUFFERED="1",
    )
    env[ENV_MAX_MESSAGE_BYTES] = str(cfg.max_message_bytes)
    env.pop("FLODL_AGENT_TOKEN", None)  # never an inherited one: only ours
    if token:
        env["FLODL_AGENT_TOKEN"] = token.hex()
    factor = slowdown_for(cfg.slowdown, local, rank, cfg.ranks, cfg.world)
    if factor is not None:
        env["FLODL_SLOWDOWN"] = repr(factor)
    if cfg.base_ms is not None:
        env["FLODL_BASE_MS"] = repr(cfg.base_ms)
    if cfg.trace_dir:
        env["FLODL_TRACE_DIR"] = cfg.trace_dir
    # CURVE keys only for ranks that dial the coordinator itself; behind the relay (ipc /
    # loopback, a plaintext frontend) inherited ones would make every handshake fail.
    for var in (ENV_SERVER_KEY, ENV_SECRET_KEY):
        env.pop(var, None)
    if cfg.no_relay and cfg.curve_server_key and cfg.curve_secret_key:
        env[ENV_SERVER_KEY] = os.path.abspath(cfg.curve_server_key)
        env[ENV_SECRET_KEY] = os.path.abspath(cfg.curve_secret_key)
    # Like torchrun: N ranks each using every core would thrash. Respect an explicit value.
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // cfg.ranks)))
    return env


def ranks_prefork(cfg: AgentConfig):
    """The prefork server for ``cfg``'s ranks (``flodl_worker.forked.Prefork``), started
    with their environment; None under ``--no-prefork``, for a command that cannot be
    forked, or a server that cannot start (logged)."""
    if not cfg.prefork:
        return None
    from .forked import start_prefork

    return start_prefork(list(cfg.command), rank_env(cfg, 0, "", dict(os.environ)))
