"""Three "hosts" on one machine: network namespaces joined by a bridge (root only).

    head (10.77.x.1, bridge)  <-veth->  hostA (10.77.x.2)
                              <-veth->  hostB (10.77.x.3)

Each namespace has its own loopback and its own TCP stack, so a coordinator bound in
``head`` is reachable from the others only over the veth links, as across machines.
"""

from __future__ import annotations

import os
import subprocess
from contextlib import contextmanager


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def available() -> bool:
    if os.geteuid() != 0:
        return False
    name = f"flodlprobe{os.getpid()}"
    try:
        _ip("netns", "add", name)
    except (OSError, subprocess.CalledProcessError):
        return False
    _ip("netns", "del", name)
    return True


@contextmanager
def three_hosts(tag: int):
    """Yield ({"head": ns, "a": ns, "b": ns}, head_ip). ``tag`` picks the 10.77.<tag>.0/24 net."""
    sfx = f"{os.getpid() % 10000}"
    ns = {"head": f"fh{sfx}", "a": f"fa{sfx}", "b": f"fb{sfx}"}
    net = f"10.77.{tag}"
    try:
        for n in ns.values():
            _ip("netns", "add", n)
            _ip("-n", n, "link", "set", "lo", "up")
        _ip("-n", ns["head"], "link", "add", "br0", "type", "bridge")
        _ip("-n", ns["head"], "addr", "add", f"{net}.1/24", "dev", "br0")
        _ip("-n", ns["head"], "link", "set", "br0", "up")
        for i, key in enumerate(("a", "b"), start=2):
            outer, inner = f"v{key}{sfx}h", f"v{key}{sfx}x"
            _ip("link", "add", outer, "type", "veth", "peer", "name", inner)
            _ip("link", "set", outer, "netns", ns["head"])
            _ip("link", "set", inner, "netns", ns[key])
            _ip("-n", ns["head"], "link", "set", outer, "master", "br0")
            _ip("-n", ns["head"], "link", "set", outer, "up")
            _ip("-n", ns[key], "addr", "add", f"{net}.{i}/24", "dev", inner)
            _ip("-n", ns[key], "link", "set", inner, "up")
        yield ns, f"{net}.1"
    finally:
        for n in ns.values():
            subprocess.run(["ip", "netns", "del", n], capture_output=True)
