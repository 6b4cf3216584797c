"""``status_view(state)``: what an operator reads at ``/status``, as plain JSON data.

A read-only query over ``CoordinatorState``: it never writes the state, and what it
returns shares nothing mutable with it (fresh dicts, lists, str, int, float, bool, None;
string keys only), so the service's HTTP thread can serve the latest view while the loop
steps the state on. Phases are written by name (``"TRAINING"``, ``"ACTIVE"``, ...).

``reasons`` says why the next round or epoch has not happened yet: the averaging gate's
last answer (``rounds.gate_reason``) under ``"round"``, then whatever the core records
in a ``reasons`` mapping on the state (read if present), each as ``name -> sentence``.
"""

from __future__ import annotations

import math
from typing import Any, Optional

from ._averaging import waiting_for
from ._state import PENDING, CoordinatorState

__all__ = ["status_view"]


def _name(phase: Any) -> str:
    """A phase sentinel's name (any other value: its ``str``)."""
    return str(getattr(phase, "__name__", phase))


def _num(x: Optional[float]) -> Optional[float]:
    """A float JSON can hold: non-finite becomes None."""
    if x is None:
        return None
    x = float(x)
    return x if math.isfinite(x) else None


def _reasons(st: CoordinatorState) -> dict[str, str]:
    out: dict[str, str] = {}
    gate = st.rounds.gate_reason
    if gate:
        out["round"] = str(gate)
    extra = getattr(st, "reasons", None)
    if isinstance(extra, dict):
        for k, v in extra.items():
            if v:
                out[str(k)] = str(v)
    return out


def status_view(st: CoordinatorState) -> dict[str, Any]:
    """The run at a glance: run phase, epochs, ranks, the open round, reasons, progress."""
    cfg = st.config
    rs = st.rounds
    run = st.run
    open_round = rs.phase is PENDING
    per_epoch = st.total_samples
    total = per_epoch * cfg.num_epochs
    committed = sum(ec.unique for ec in st.coverage.epochs.values())
    windows = list(st.cadence.elche.batch_counts) if st.cadence is not None else []
    return {
        "now": _num(st.now),
        "world_size": cfg.world_size,
        # How often each rank reports its batches: batch_report_ms, stretched for many ranks.
        "report_interval_ms": cfg.report_interval_ms,
        "policy": cfg.policy,
        "plane": cfg.plane,
        "run": {
            "phase": _name(run.phase),
            "formed_at": _num(run.formed_at),
            "ok": run.ok,
            "reason": run.reason,
            "stop_reason": run.stop_reason,
            "not_admitted": {str(r): str(why) for r, why in sorted(run.not_admitted.items())},
        },
        "epoch": {
            "num_epochs": cfg.num_epochs,
            "dispatched": st.dispatch.last_dispatched,
            "aggregated": st.metrics.last_aggregated,
        },
        "ranks": [
            {
                "rank": rec.rank,
                "phase": _name(rec.phase),
                "host": rec.host,
                "pid": rec.pid,
                "incarnation": rec.incarnation,
                "epoch": st.dispatch.rank_epoch.get(rec.rank),
                "samples": rec.samples,
                "batches": rec.batches,
                "last_step": rec.last_step,
                "folded_step": rec.folded_step,
                "window": windows[rec.rank] if rec.rank < len(windows) else None,  # cadence: batches planned
                "last_seen": _num(rec.last_seen),
                "reason": rec.reason,
            }
            for rec in st.ranks
        ],
        "round": {
            "phase": _name(rs.phase),
            "open": open_round,
            "cycle": rs.cycle,
            "version": rs.version,
            "global_step": rs.global_step,
            "ranks": list(rs.ranks) if open_round else [],
            "waiting_for": waiting_for(st) if open_round else [],
            "opened_at": _num(rs.opened_at) if open_round else None,
            "refused": {str(r): str(why) for r, why in sorted(rs.refused.items())},
        },
        "reasons": _reasons(st),
        "ignored": {str(k): int(n) for k, n in sorted(st.ignored.items())},
        "progress": {
            "samples_committed": committed,
            "samples_total": total,
            "fraction": (committed / total) if total else None,
            "samples_discarded": sum(ec.discarded for ec in st.coverage.epochs.values()),
        },
    }
