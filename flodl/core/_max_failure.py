"""max_failure: how many dead ranks end the run (reference §9.4, scenario 68).

``max_failure`` is a string: ``""`` (off), ``"N"`` (absolute: N dead ranks) or ``"P%"``
(a share of the world: ``ceil(clamp(P/100, 0, 1) * world_size)``). Only ranks DEAD now count (a slot a restarted rank took again counts no more);
a rank that LEFT cleanly is not a failure. Percentages are computed exactly (decimal
fractions, no float rounding), so ``"20%"`` of 10 is 2 and of 11 is 3.

``max_failure_limit(spec, world_size)`` returns the limit (None when off) and raises
``ValueError`` naming the accepted forms for anything else; ``CoreConfig`` calls it to
validate, ``_run.check_lost`` to decide.
"""

from __future__ import annotations

from fractions import Fraction
from math import ceil
from typing import Optional

__all__ = ["max_failure_limit", "percent_limit"]


def percent_limit(p: Fraction | float, world_size: int) -> int:
    """``ceil(clamp(p, 0, 1) * world_size)`` (``p`` a fraction: 0.2 = 20 %)."""
    q = min(max(Fraction(p), Fraction(0)), Fraction(1))
    return ceil(q * max(world_size, 0))


def max_failure_limit(spec: str, world_size: int) -> Optional[int]:
    """Dead ranks that end the run for ``spec`` ("" -> None, "N", "P%")."""
    s = (spec or "").strip()
    if not s:
        return None
    try:
        if s.endswith("%"):
            return percent_limit(Fraction(s[:-1].strip()) / 100, world_size)
        n = int(s)
    except (ValueError, ZeroDivisionError):
        raise ValueError(f"max_failure must be 'N' or 'P%' (e.g. '2' or '25%'), got {spec!r}") from None
    if n < 0:
        raise ValueError(f"max_failure must be >= 0, got {spec!r}")
    return n
