"""Strict JSON for what operators and tools read (summaries, /status, checkpoint meta).

Python's ``json`` writes a non-finite float as bare ``NaN`` / ``Infinity``, which is not
JSON: ``jq``, browsers and most parsers reject the whole document. A training run can
produce them honestly (a diverged loss), so they are not an error to hide either: each
becomes ``null`` and its path is listed under ``non_finite`` with its value, so the
document stays valid and says what was not a number.
"""

from __future__ import annotations

import json
import math
from typing import Any

__all__ = ["clean", "dumps"]


def clean(obj: Any, path: str = "$") -> tuple[Any, list[str]]:
    """(a copy of ``obj`` with every non-finite float replaced by None, the paths of those)."""
    found: list[str] = []
    return _clean(obj, path, found), found


def _clean(obj: Any, path: str, found: list[str]) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        found.append(f"{path} = {obj!r}")
        return None
    if isinstance(obj, dict):
        return {k: _clean(v, f"{path}.{k}", found) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v, f"{path}[{i}]", found) for i, v in enumerate(obj)]
    return obj


def dumps(obj: Any, *, report: bool = True, **kw: Any) -> str:
    """``json.dumps`` that never writes NaN/Infinity. With ``report`` and a dict, the
    replaced values are listed under its ``non_finite`` key."""
    data, found = clean(obj)
    if report and found and isinstance(data, dict):
        data["non_finite"] = sorted(set(data.get("non_finite") or []) | set(found))
    return json.dumps(data, allow_nan=False, **kw)
