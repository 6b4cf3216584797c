"""The ``FLODL_*`` environment variables of the worker side (agent, relay, rank runtime).

The coordinator reads ``FLODL_<KEY>`` for each of its settings and refuses any other
``FLODL_*`` variable as a typo (a misspelt ``FLODL_EPOCHS`` must not be silently ignored), except
these: they belong to the agent, the relay or a rank and may legitimately share an
environment with the coordinator (``flodl run --local``, one shell for every process).
Where they are read: ``flodl_worker._env`` (the rank) and ``flodl_worker.cli`` (agent,
relay). A test keeps this list equal to the names the source uses.
"""

from __future__ import annotations

__all__ = ["WORKER_ENV"]

WORKER_ENV = frozenset({
    "FLODL_RANK",
    "FLODL_LOCAL_RANK",
    "FLODL_LOCAL_WORLD_SIZE",
    "FLODL_CONNECT",
    "FLODL_HOST",
    "FLODL_COORDINATOR",
    "FLODL_SLOWDOWN",
    "FLODL_BASE_MS",
    "FLODL_TRACE_DIR",
    "FLODL_HELLO_TIMEOUT_S",
    "FLODL_STORE_HOST",
    "FLODL_CURVE_SERVER_KEY",
    "FLODL_FAULT",
    "FLODL_AGENT_TOKEN",
    "FLODL_RESTART_COUNT",
    # Blanks in the prefork server's environment, never read: the room its forked ranks
    # show their own environment in (flodl_worker.prefork).
    "FLODL_PREFORK_ROOM",
    # Also coordinator keys (world_size, session, curve_secret_key): read by both sides.
    "FLODL_WORLD_SIZE",
    "FLODL_SESSION",
    "FLODL_CURVE_SECRET_KEY",
})
