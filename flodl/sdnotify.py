"""systemd readiness notification (``sd_notify(3)``) without libsystemd.

Under a ``Type=notify`` unit systemd sets ``NOTIFY_SOCKET``; a service says ``READY=1``
once it can do its job (the coordinator: bound; the agent: its coordinator answered), and
may add a ``STATUS=`` line that ``systemctl status`` shows. The protocol is one datagram
on that AF_UNIX socket (a leading ``@`` names an abstract socket). Without the variable
-- not under systemd -- every call is a no-op. A failed send is never fatal: systemd
then times the unit out (``TimeoutStartSec``), which says more than a crash would.
"""

from __future__ import annotations

import os
import socket

__all__ = ["notify"]


def notify(*lines: str, env: dict | None = None) -> bool:
    """Send ``KEY=value`` lines in one datagram; True if systemd was told."""
    addr = (os.environ if env is None else env).get("NOTIFY_SOCKET", "")
    if not addr or not lines:
        return False
    if addr.startswith("@"):
        addr = "\0" + addr[1:]
    elif not addr.startswith("/"):
        return False  # (vsock and other forms: not used by a service unit's main process)
    payload = "\n".join(line.replace("\n", " ") for line in lines).encode()
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
            s.connect(addr)
            s.sendall(payload)
        return True
    except OSError:
        return False
