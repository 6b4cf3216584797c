"""The operator log's line for each core decision (``Notice``), and its JSON record.

One readable line per decision goes to ``flodl.coordinator`` (a round's ``window`` at
DEBUG: there is one per round); the whole record, as JSON, to ``flodl.decisions`` at
DEBUG. Neither is built unless its logger would write it: at thousands of ranks a
round's record holds N-long lists, and building both for every round cost the loop
about a millisecond whether anyone read them or not.

A line stays a line at any world size: an epoch reads as the launcher shows it
(``statustable.epoch_line``: beyond a few ranks their rates as min / median / max), and
any other N-long value is cut to its first entries and its length. The JSON record keeps
everything.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from flodl import statustable
from flodl.core import Notice

__all__ = ["log_notice", "human_line"]

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
    if cmd.kind == "epoch":
        return statustable.epoch_line(cmd.data, epochs)
    fields = " ".join(f"{k}={_short(v)}" for k, v in sorted(cmd.data.items()))
    return f"{cmd.kind}: {fields}"


def _short(v: Any) -> Any:
    """``v``, or a long list's first entries and its length."""
    if isinstance(v, (list, tuple)) and len(v) > 2 * _SHOWN:
        return "[" + ", ".join(str(x) for x in v[:_SHOWN]) + f", ... ({len(v)} values)]"
    return v
