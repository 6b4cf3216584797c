"""CURVE keys: ZeroMQ's standard certificate files, loaded and checked in one place.

A certificate pair is what ``zmq.auth.create_certificates(DIR, NAME)`` writes (and
``flodl-coordinator keygen DIR NAME`` / ``flodl-worker keygen DIR NAME`` call it):

- ``NAME.key``        the public certificate: hand it out (to the coordinator's
                      allowlist directory, or to clients as the server key);
- ``NAME.key_secret`` the secret certificate (public + secret key): keep it on the
                      host that owns it, readable only by the service's user.

Who holds what:

- coordinator: its own secret cert (``curve_secret_key``) and a directory of the
  allowed clients' public certs (``curve_allowed_keys``, every ``*.key`` in it);
- every client that dials the coordinator over the network (a relay's backend, an
  agent, a rank that dials the coordinator directly): the coordinator's public cert
  (``--curve-server-key`` / ``FLODL_CURVE_SERVER_KEY``) and its own secret cert
  (``--curve-secret-key`` / ``FLODL_CURVE_SECRET_KEY``).

Every defect (a missing file, a public cert where a secret one is needed, an empty
allowlist) is a ``CurveError`` whose message is one line naming the path.

pyzmq is imported lazily: the ``flodl`` distribution itself does not depend on it
(``flodl-coordinator`` and ``flodl-worker`` do, and they are what use this module).
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass, field

__all__ = [
    "CurveError",
    "ClientKeys",
    "ServerKeys",
    "keygen",
    "load_public",
    "load_secret",
    "load_allowed",
    "client_keys",
    "ENV_SERVER_KEY",
    "ENV_SECRET_KEY",
]

ENV_SERVER_KEY = "FLODL_CURVE_SERVER_KEY"
ENV_SECRET_KEY = "FLODL_CURVE_SECRET_KEY"


class CurveError(Exception):
    """A CURVE key file or directory is unusable. The message is one printable line."""


@dataclass(frozen=True, slots=True)
class ClientKeys:
    """What a client socket needs: the server's public key and its own key pair (z85)."""

    server_public: bytes
    public: bytes
    secret: bytes = field(repr=False)

    def apply(self, sock) -> None:
        """Make ``sock`` a CURVE client. Call before ``connect``."""
        import zmq

        sock.setsockopt(zmq.CURVE_SERVERKEY, self.server_public)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self.public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.secret)


@dataclass(frozen=True, slots=True)
class ServerKeys:
    """The coordinator's key pair and the allowlisted client public keys (z85)."""

    public: bytes
    secret: bytes = field(repr=False)
    allowed: frozenset[bytes] = frozenset()


def _cert(path: str, what: str) -> tuple[bytes, bytes | None]:
    from zmq.auth.certs import load_certificate

    if not path:
        raise CurveError(f"{what}: no path given")
    if not os.path.isfile(path):
        raise CurveError(f"{what} {path} does not exist (make one with: flodl-coordinator keygen DIR NAME)")
    try:
        public, secret = load_certificate(path)
    except (OSError, ValueError, IndexError) as e:
        raise CurveError(f"{what} {path} is not a ZeroMQ certificate: {e}") from None
    _check_key(path, what, public)
    if secret is not None:
        _check_key(path, what, secret)
    return public, secret


def _check_key(path: str, what: str, key: bytes) -> None:
    if len(key) != 40:  # a 32-byte key, z85-encoded
        raise CurveError(f"{what} {path} holds a malformed key (want 40 z85 characters, got {len(key)})")
    try:
        from zmq.utils import z85

        z85.decode(key)
    except Exception:  # noqa: BLE001 - any decoding failure is the same defect
        raise CurveError(f"{what} {path} holds a key that is not z85") from None


def load_public(path: str, what: str = "CURVE public certificate") -> bytes:
    """The public key of a certificate file (a secret cert holds it too)."""
    return _cert(path, what)[0]


def load_secret(path: str, what: str = "CURVE secret certificate") -> tuple[bytes, bytes]:
    """(public, secret) of a secret certificate file (``NAME.key_secret``)."""
    public, secret = _cert(path, what)
    if secret is None:
        raise CurveError(f"{what} {path} holds no secret key (give NAME.key_secret, not NAME.key)")
    return public, secret


def load_allowed(directory: str, what: str = "curve_allowed_keys") -> frozenset[bytes]:
    """The public keys of every ``*.key`` certificate in ``directory`` (at least one)."""
    if not os.path.isdir(directory):
        raise CurveError(f"{what} {directory} is not a directory")
    files = sorted(glob.glob(os.path.join(directory, "*.key")))
    if not files:
        raise CurveError(f"{what} {directory} holds no public certificate (*.key): no client could join")
    return frozenset(load_public(f, f"{what}: certificate") for f in files)


def server_keys(secret_path: str, allowed_dir: str) -> ServerKeys:
    public, secret = load_secret(secret_path, "curve_secret_key")
    return ServerKeys(public=public, secret=secret, allowed=load_allowed(allowed_dir))


def client_keys(server_key: str | None, secret_key: str | None, *, names=("--curve-server-key", "--curve-secret-key")):
    """ClientKeys from two paths, or None when neither is given; one without the other is an error."""
    if not server_key and not secret_key:
        return None
    if not server_key or not secret_key:
        missing = names[0] if not server_key else names[1]
        raise CurveError(f"CURVE needs both {names[0]} and {names[1]}; {missing} is missing")
    server_public = load_public(server_key, f"{names[0]}")
    public, secret = load_secret(secret_key, f"{names[1]}")
    return ClientKeys(server_public=server_public, public=public, secret=secret)


def keygen(directory: str, name: str, *, overwrite: bool = False) -> tuple[str, str]:
    """Write ``DIR/NAME.key`` and ``DIR/NAME.key_secret`` (0600); return their paths."""
    from zmq.auth.certs import create_certificates

    if not name or os.sep in name or name.startswith("."):
        raise CurveError(f"certificate name {name!r} must be a plain file name")
    os.makedirs(directory, exist_ok=True)
    public, secret = (os.path.join(directory, name + ext) for ext in (".key", ".key_secret"))
    if not overwrite:
        for p in (public, secret):
            if os.path.exists(p):
                raise CurveError(f"{p} already exists (refusing to overwrite a key)")
    # Create the secret file 0600 before pyzmq writes into it (open(..., "w") keeps the mode).
    fd = os.open(secret, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.close(fd)
    os.chmod(secret, 0o600)
    return create_certificates(directory, name)
