"""The coordinator's ``/status`` document (docs/status.md) as a table for a terminal.

Pure formatting, no I/O: ``render(doc)`` for ``flodl status``, ``progress_line(doc)``
for the launcher's live view. Unknown values print as ``-``; a document of another
``schema_version`` is refused by name rather than misread.
"""

from __future__ import annotations

import statistics
from typing import Any, Optional, Sequence

__all__ = ["render", "progress_line", "epoch_line", "rates_text", "bar", "fmt_duration", "SCHEMA_VERSION",
           "StatusSchemaError", "FULL_RATES"]  # fmt: skip

SCHEMA_VERSION = 1
BAR_WIDTH = 24
FULL_RATES = 16  # a line names each rank's rate up to this many ranks


class StatusSchemaError(ValueError):
    pass


def check_version(doc: Any) -> dict:
    if not isinstance(doc, dict) or doc.get("schema_version") != SCHEMA_VERSION:
        got = doc.get("schema_version") if isinstance(doc, dict) else type(doc).__name__
        raise StatusSchemaError(
            f"/status has schema_version {got!r}; this flodl reads version {SCHEMA_VERSION} "
            "(use a flodl of the coordinator's version, or --json for the raw document)"
        )
    return doc


def fmt_duration(s: Optional[float]) -> str:
    if s is None:
        return "-"
    s = max(0.0, float(s))
    if s < 60:
        return f"{s:.1f}s" if s < 10 else f"{s:.0f}s"
    m, sec = divmod(int(round(s)), 60)
    if m < 60:
        return f"{m}m{sec:02d}s"
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m"


def bar(fraction: Optional[float], width: int = BAR_WIDTH) -> str:
    f = min(max(fraction or 0.0, 0.0), 1.0)
    full = int(round(f * width))
    return "[" + "#" * full + "-" * (width - full) + "]"


def _num(x: Optional[float], spec: str = ",.0f") -> str:
    return "-" if x is None else format(x, spec)


def _pct(x: Optional[float]) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def rates_text(rates: Sequence[tuple[int, Optional[float]]]) -> str:
    """``(rank, samples/s)`` pairs as ``r0 1,200/s r1 600/s``; beyond ``FULL_RATES`` ranks
    as min / median / max naming the ranks, so that a line stays a line at any world size."""
    if len(rates) <= FULL_RATES:
        return " ".join(f"r{r} {_num(x)}/s" for r, x in rates)
    known = [(x, r) for r, x in rates if x is not None]
    if not known:
        return f"{len(rates)} ranks"
    (lo, lo_r), (hi, hi_r) = min(known), max(known)
    return (f"{len(rates)} ranks: min r{lo_r} {_num(lo)}/s median {_num(statistics.median(x for x, _r in known))}/s "
            f"max r{hi_r} {_num(hi)}/s")  # fmt: skip


def progress_line(doc: dict) -> str:
    """One line: phase, bar, percent, epoch, commit rate, ETA, and each rank's rate."""
    p, run = doc["progress"], doc["run"]
    epoch = "-" if p["epoch"] is None else f"{p['epoch'] + 1}/{p['num_epochs']}"
    rates = rates_text([(m["rank"], m["rate"]) for m in doc["membership"] if m["phase"] == "ACTIVE"])
    return (
        f"{run['phase']:<9} {bar(p['fraction'])} {_pct(p['fraction']):>6}  epoch {epoch}  "
        f"{_num(p['samples_per_s'])} samples/s  eta {fmt_duration(p['eta_s'])}  {rates}"
    ).rstrip()


def epoch_line(e: dict, num_epochs: int, doc: Optional[dict] = None) -> str:
    """One line for an aggregated epoch (a ``recent_epochs`` row, or a summary ``epochs`` row),
    with the run's progress and ETA when ``doc`` (the /status it came with) is given."""
    loss = e.get("avg_loss")
    wall = e.get("wall_s")
    if wall is None and e.get("epoch_ms") is not None:
        wall = e["epoch_ms"] / 1e3
    rates = e.get("samples_per_s") or e.get("per_rank_throughput") or []
    cov = e.get("coverage") or {}
    parts = [f"epoch {e['epoch'] + 1}/{num_epochs}", f"loss {'-' if loss is None else format(loss, '.4f')}",
             f"wall {fmt_duration(wall)}"]  # fmt: skip
    if doc is not None:
        p = doc["progress"]
        parts.append(f"{bar(p['fraction'])} {_pct(p['fraction'])} eta {fmt_duration(p['eta_s'])}")
    if rates:
        parts.append(rates_text(list(enumerate(rates))))
    if cov:
        parts.append(f"coverage {cov.get('trained')}/{cov.get('expected')} dup {cov.get('duplicates')} "
                     f"missing {cov.get('missing')}")  # fmt: skip
    return "  ".join(parts)


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    fmt = lambda cells: "  ".join(c.rjust(w) if i != 1 and i != 2 else c.ljust(w)  # noqa: E731
                                  for i, (c, w) in enumerate(zip(cells, widths))).rstrip()  # fmt: skip
    return [fmt(header), *(fmt(r) for r in rows)]


def render(doc: dict) -> str:
    """The whole document as a few lines and one row per rank."""
    check_version(doc)
    run, p = doc["run"], doc["progress"]
    lines = [
        f"run {run['session']}  {run['phase']}"
        + ("" if run["ok"] is None else f"  ok={run['ok']} ({run['reason']})")
        + f"  {run['policy']}/{run['plane']}  world {run['world_size']}"
        + (f"  coordinator restarts {run['coordinator_restarts']}" if run["coordinator_restarts"] else ""),
        f"progress  {bar(p['fraction'])} {_pct(p['fraction'])}  "
        f"epoch {'-' if p['epoch'] is None else p['epoch'] + 1}/{p['num_epochs']} ({p['epochs_completed']} done)  "
        f"{p['samples_committed']:,}/{p['samples_total']:,} samples committed  "
        f"{_num(p['samples_per_s'])}/s  eta {fmt_duration(p['eta_s'])}"
        + (f"  discarded {p['samples_discarded']:,}" if p["samples_discarded"] else ""),
    ]
    le = doc.get("last_epoch")
    if le:
        loss = "-" if le["avg_loss"] is None else f"{le['avg_loss']:.4f}"
        lines.append(f"last epoch {le['epoch'] + 1}: loss {loss}  wall {fmt_duration(le['wall_s'])}")
    rnd = doc["round"]
    if rnd["open"]:
        lines.append(f"round {rnd['cycle']} open {fmt_duration(rnd['open_s'])}, waiting for ranks {rnd['waiting_for']}")
    # The two an operator asks about (--json has every rule's why-not).
    waits = [f"{k}: {doc['waiting'][k]}" for k in ("round", "epoch") if doc["waiting"].get(k)]
    if waits:
        lines.append("waiting   " + "; ".join(waits))
    header = ["rank", "phase", "host", "epoch", "samples", "rate/s", "share", "window", "seen", "goodput", "badput"]
    rows = [
        [str(m["rank"]), m["phase"], m["host"] or "-", "-" if m["epoch"] is None else str(m["epoch"] + 1),
         f"{m['samples']:,}", _num(m["rate"]), _pct(m["share"]), "-" if m["window"] is None else str(m["window"]),
         fmt_duration(m["last_seen_s"]), fmt_duration(m["goodput_s"]), fmt_duration(m["badput_s"])]
        for m in doc["membership"]
    ]  # fmt: skip
    lines += _table(header, rows)
    alerts = doc["alerts"]
    lines.append("alerts: none" if not alerts else "alerts:")
    lines += [f"  {a['level'].upper()} {a['kind']}: {a['message']}" for a in alerts]
    return "\n".join(lines)
