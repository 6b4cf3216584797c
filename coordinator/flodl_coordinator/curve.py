"""The coordinator's CURVE server side: key options on its ROUTER and a ZAP allowlist.

With ``curve_secret_key`` and ``curve_allowed_keys`` set, the ROUTER is a CURVE server
and a ZAP handler accepts a client's handshake only when its public key is in the
allowlist. A plaintext client, or one with a key not on the list, never completes its
handshake: libzmq drops the connection before any of its frames reach the ROUTER, so
the service's loop never sees them and the run goes on. Each refused key is logged
once (a refused client keeps reconnecting: libzmq retries).

Threads and sockets: the ZAP handler is pyzmq's ``ThreadAuthenticator``. It owns its
own ZAP socket (a REP bound on ``inproc://zeromq.zap.01`` of the service's context)
and serves it in its own thread; the service's thread never touches that socket, and
the authenticator thread never touches the ROUTER. It must be started *before* the
ROUTER binds (a CURVE server with no ZAP handler would accept any client key) and
stopped before the context terminates.
"""

from __future__ import annotations

import logging
import threading

import zmq

from flodl.curve import CurveError, ServerKeys, server_keys

from .settings import Settings, SettingsError

__all__ = ["load_server_keys", "CurveServer", "ZAP_DOMAIN"]

log = logging.getLogger("flodl.coordinator")

ZAP_DOMAIN = b"flodl"


def load_server_keys(settings: Settings) -> ServerKeys | None:
    """The configured keys, or None without CURVE. A defect is a one-line SettingsError."""
    if not settings.curve_secret_key and not settings.curve_allowed_keys:
        return None
    try:
        return server_keys(settings.curve_secret_key, settings.curve_allowed_keys)
    except CurveError as e:
        raise SettingsError(f"config error: {e}") from None


class _Allowlist:
    """The authenticator's credentials provider: allowlisted keys pass, others are logged once."""

    def __init__(self, allowed: frozenset[bytes]):
        self.allowed = allowed
        self.denied: dict[bytes, int] = {}  # z85 key -> handshakes refused
        self._lock = threading.Lock()  # read by the service (status), written by the ZAP thread

    def callback(self, domain: str, key: bytes) -> bool:
        if key in self.allowed:
            return True
        with self._lock:
            n = self.denied[key] = self.denied.get(key, 0) + 1
        if n == 1:
            log.warning("CURVE: refused a client whose public key %s is not in curve_allowed_keys",
                        key.decode(errors="replace"))
        return False

    def denials(self) -> int:
        with self._lock:
            return sum(self.denied.values())


class CurveServer:
    """Runs the ZAP handler thread; ``secure(sock)`` makes a ROUTER a CURVE server."""

    def __init__(self, ctx: zmq.Context, keys: ServerKeys):
        from zmq.auth.thread import ThreadAuthenticator

        self.keys = keys
        self.allowlist = _Allowlist(keys.allowed)
        # pyzmq's authenticator logs every decision at DEBUG under zmq.auth; ours is once per key.
        self.auth = ThreadAuthenticator(ctx, log=logging.getLogger("flodl.coordinator.zap"))
        # The provider answers for our ROUTER's ZAP domain (any other domain: refused).
        self.auth.configure_curve_callback(domain=ZAP_DOMAIN.decode(), credentials_provider=self.allowlist)
        self.auth.start()  # binds the ZAP socket, then hands it to the authenticator's thread

    def secure(self, sock: zmq.Socket) -> None:
        """CURVE server options on ``sock``; call before ``bind``."""
        sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN)
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self.keys.public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.keys.secret)
        log.info("CURVE on: %d allowed client key(s); plaintext and unknown keys are refused at the handshake",
                 len(self.keys.allowed))

    def stop(self) -> None:
        """Stop the ZAP thread and close its sockets (before ``ctx.term()``)."""
        self.auth.stop()
