"""The dashboard page: served live at ``/``, written at the end of a run with its data.

One HTML file (``dashboard.html`` beside this module) with inline CSS and JS and no
external resource. Served live it polls ``/status`` and ``/timeline``; written by
``page(data)`` the same file carries ``{"status": ..., "timeline": ...}`` inside it and
fetches nothing, so a finished run opens from disk, offline, as it looked at its end.
"""

from __future__ import annotations

import json
import os
from functools import lru_cache
from importlib import resources

from flodl import strictjson

__all__ = ["final_paths", "page", "to_json", "write_final"]

_PLACEHOLDER = "/*flodl-data*/null"


@lru_cache(maxsize=1)
def _template() -> str:
    html = resources.files(__package__).joinpath("dashboard.html").read_text(encoding="utf-8")
    if html.count(_PLACEHOLDER) != 1:  # a broken template must fail loudly, not serve a blank page
        raise RuntimeError(f"dashboard.html must hold {_PLACEHOLDER!r} exactly once")
    return html


def to_json(data) -> str:
    """JSON of the timeline (or a page's data): C-speed ``json`` when every number is
    finite -- a long run's timeline is 10^5 spans, polled every second -- else the strict
    walk that writes each non-finite value as null and lists it (``flodl.strictjson``)."""
    try:
        return json.dumps(data, allow_nan=False, default=str)
    except ValueError:
        return strictjson.dumps(data, default=str)


def page(data: dict | None = None) -> str:
    """The page; with ``data`` (``{"status", "timeline"}``) embedded, without it live."""
    if data is None:
        return _template().replace(_PLACEHOLDER, "null")  # live: the page polls
    # JSON inside <script>: escape what could close the element or open a comment.
    blob = to_json(data).replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
    return _template().replace(_PLACEHOLDER, blob)


def write_final(path: str, text: str) -> None:
    """Write ``text`` to ``path`` atomically (a reader never sees half a file); OSError
    goes to the caller, which names the file and goes on (the run's outcome stands)."""
    directory = os.path.dirname(path)
    if directory:
        os.makedirs(directory, exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(text)
    os.replace(tmp, path)


def final_paths(settings) -> tuple[str, str]:
    """(status JSON, dashboard HTML) written at the end: as set, else beside the summary
    (``NAME.json`` -> ``NAME.status.json``, ``NAME.dashboard.html``), else none ('')."""
    stem = settings.summary[: -len(".json")] if settings.summary.endswith(".json") else settings.summary
    status = settings.status_out or (f"{stem}.status.json" if stem else "")
    html = settings.dashboard_out or (f"{stem}.dashboard.html" if stem else "")
    return status, html
