"""Reading a coordinator's ``/status`` over HTTP, for ``flodl status`` and the launcher's
live view: the document, or ``StatusUnreachable`` saying why not -- nothing listening, a
timeout, or a reply cut off or garbled (the coordinator exiting mid-reply at a run's end)."""

from __future__ import annotations

import http.client
import json
import urllib.error
import urllib.request
from typing import Any

__all__ = ["fetch", "host_of", "StatusUnreachable"]


class StatusUnreachable(Exception):
    def __init__(self, url: str, why: object) -> None:
        super().__init__(f"cannot read {url}: {why}")
        self.url, self.why = url, why


def host_of(hostport: str) -> str:
    """``HOST:PORT`` as given to ``--http``, with or without ``http://`` and a slash."""
    return hostport.removeprefix("http://").rstrip("/")


def fetch(hostport: str, timeout: float) -> Any:
    """GET http://HOSTPORT/status as parsed JSON (any JSON: the caller checks its shape)."""
    url = f"http://{host_of(hostport)}/status"
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return json.loads(resp.read().decode())
    except http.client.HTTPException as e:
        raise StatusUnreachable(url, f"a broken reply ({type(e).__name__})") from None
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise StatusUnreachable(url, getattr(e, "reason", e)) from None
