"""The operator log's line for each core decision (``Notice``), and its JSON record.

One readable line per decision goes to ``flodl.coordinator`` (a round's ``window`` at
DEBUG: there is one per round); the whole record, as JSON, to ``flodl.decisions`` at
DEBUG. Neither is built unless its logger would write it: at thousands of ranks a
round's record holds N-long lists, and building both for every round cost the loop
about a millisecond whether anyone read them or not.

A line stays a line at any world size: an N-long value is cut to its first few entries
and its length, and an epoch's per-rank rates become min / median / max (naming the
slowest and fastest rank) beyond ``FULL_RATES`` ranks. The JSON record keeps everything.
"""

from __future__ import annotations

import json
import logging
import statistics
from typing import Any

from flodl.core import Notice

__all__ = ["log_notice", "human_line", "FULL_RATES"]

FULL_RATES = 16  # an epoch line lists every rank's rate up to this many ranks
_SHOWN = 8  # entries of a longer list a line shows


def log_notice(cmd: Notice, epochs: int, log: logging.Logger, decisions: logging.Logger) -> None:
    """Write the notice's line and JSON record, each only if its logger would."""
    if decisions.isEnabledFor(logging.DEBUG):
        decisions.debug(json.dumps({"kind": cmd.kind, **cmd.data}, sort_keys=True, default=str))
    level = logging.DEBUG if cmd.kind == "window" else logging.INFO
    if log.isEnabledFor(level):
        log.log(level, "%s", human_line(cmd, epochs))


def human_line(cmd: Notice, epochs: int) -> str:
    """One readable progress line per decision."""
    d = cmd.data
    if cmd.kind == "epoch":
        cov = d.get("coverage", {})
        return (
            f"epoch {d.get('epoch', 0) + 1}/{epochs}  loss {d.get('avg_loss', float('nan')):.4f}  "
            f"wall {d.get('wall_s', 0):.2f}s  rate {_rates(d.get('samples_per_s', []))}  "
            f"coverage {cov.get('trained')}/{cov.get('expected')} dup {cov.get('duplicates')} "
            f"missing {cov.get('missing')}"
        )
    fields = " ".join(f"{k}={_short(v)}" for k, v in sorted(d.items()))
    return f"{cmd.kind}: {fields}"


def _rates(rates: list[float]) -> str:
    if len(rates) <= FULL_RATES:
        return "  ".join(f"r{i} {x:,.0f}/s" for i, x in enumerate(rates))
    lo = min(range(len(rates)), key=rates.__getitem__)
    hi = max(range(len(rates)), key=rates.__getitem__)
    return (f"{len(rates)} ranks: min r{lo} {rates[lo]:,.0f}/s  median {statistics.median(rates):,.0f}/s  "
            f"max r{hi} {rates[hi]:,.0f}/s")  # fmt: skip


def _short(v: Any) -> Any:
    """``v``, or a long list's first entries and its length."""
    if isinstance(v, (list, tuple)) and len(v) > 2 * _SHOWN:
        return "[" + ", ".join(str(x) for x in v[:_SHOWN]) + f", ... ({len(v)} values)]"
    return v
