"""Cadence feedback at the end of a round: calibrate ElChe, ask the guard, explain.

Theory of operation
-------------------
``finish_window`` runs once per finished round, inside ``_averaging._finish`` (through
the Cadence dispatcher's ``on_round_finished``), after ``version`` and ``global_step``
moved and before the next windows are folded into the ``Update``s -- the head of spec
§5.5, in this order:

1. The window's timing (the ``WindowLedger``, fed by every ``BatchDone``: ``batch_ms``,
   ``data_ms``, loss) becomes a ``WindowReport``. Its ``sync_ms`` is what the *previous*
   round cost the ranks (so the first window reports 0, as upstream). Rounds overlap
   the next window (``cadence._dispatcher``: each rank's next chunk goes out with its
   ``RequestParams``), so a round's duration is not paid by anyone; what is paid is the
   *exposed* part: from the moment every rank had run its window while the round was
   still open (``CadenceState.barrier_at``: the next round would have fired then) to
   the finish -- 0 whenever the round is shorter than a window. That is the fixed
   cost the anchor's growth rule should amortise; the round's duration is reported
   next to it as ``round_ms``. ElChe picks
   the scale (delivered when coherent: §5.1's mixed-scale guard) and recalibrates:
   smoothed speeds, the anchor rank, the counts, and possibly a staged growth.
2. The guard reads the acks' divergences (``DivergenceReport``; a rank without one
   counts 0.0) with ``k_used`` = the steps this round folded and ``k_max`` = the most
   one rank folded.
3. The meta-controller (when on, and once some rank reported a learning rate in
   ``BatchDone.lr``; the lowest such rank's) may nudge the anchor down first (through
   ``apply_verdict``, discarding the staged growth). Then the guard's verdict lands on
   ElChe: Stable commits a staged growth, SuppressGrowth vetoes it and latches growth
   off, NudgeDown discards it and shrinks the anchor. The overshoot budget follows (it
   only moves under Async; kept so that engine can share this head).
4. The ledger is reset (timing and steps); this round's exposed cost is kept for the
   next report (and summed in ``exposed_s``).
5. One ``Notice("window", ...)``: the new counts, anchor before/after, phase, the
   window's overhead estimate ``(sync + fill) / (anchor x slow ms + sync + fill)``, the
   verdict and its reason, the meta nudge if any. O(world size), nothing more.

``summary`` is the ``elche`` block of the run summary.
"""

from __future__ import annotations

from typing import Any, Optional

from .._commands import Command, Notice
from ._guards import DivergenceReport, NudgeDown, Verdict
from .._state import CadenceState, CoordinatorState
from ._window import WindowReport, delivered_capable

__all__ = ["finish_window", "calibrated", "overhead_estimate", "summarise", "summary"]

POLICY = "cadence"


def overhead_estimate(anchor: int, slow_ms: float, anchor_rank: Optional[int], report: WindowReport) -> Optional[float]:
    """Fixed per-window cost as a fraction of the anchor rank's window (None: unknown)."""
    if anchor_rank is None or slow_ms <= 0.0:
        return None
    fixed = max(0.0, report.sync_ms) + max(0.0, report.fill_ms[anchor_rank])
    denom = anchor * slow_ms + fixed
    return fixed / denom if denom > 0.0 else None


def _observe_meta(cad: CadenceState, verdict: Verdict) -> Optional[NudgeDown]:
    """Consult the meta-controller (spec §7.4); apply and return its nudge, if any."""
    if cad.meta is None or not cad.last_lr:
        return None
    lr = cad.last_lr[min(cad.last_lr)]
    action = cad.meta.observe(lr, cad.elche.anchor, verdict, cad.elche.phase)
    if isinstance(action, NudgeDown):
        cad.elche.apply_verdict(action)
        return action
    return None


def finish_window(st: CoordinatorState, epoch: Optional[int], out: list[Command]) -> None:
    """The feedback half of a finished round (see the module doc)."""
    cad, rs = st.cadence, st.rounds
    el = cad.elche
    before = el.anchor
    el.live = alive = st.alive_mask()  # (the window cap counts these)
    report = cad.ledger.window_report(
        alive=alive,
        delivered_capable=delivered_capable(POLICY, st.config.plane),
        sync_ms=cad.last_sync_ms,
    )
    calibration = el.report_window(report)  # once calibrated, the step elects the Fastest roles
    overhead = overhead_estimate(before, el.slow_ms(), el.anchor_rank, report)
    # The acked ranks' values only: a rank without an ack counts 0 in both, and every
    # window is >= 0 (``_averaging.on_ack``), as is the divergence's floor -- no N-long
    # list per round.
    k_used, k_max = sum(rs.window.values()), max(rs.window.values(), default=0)
    evidence = DivergenceReport(deltas=tuple(rs.divergence.values()))
    verdict = cad.guard.report(evidence, k_used, k_max)
    nudge = _observe_meta(cad, verdict)
    el.apply_verdict(verdict)
    cad.overshoot.fold(verdict, overshoot=cad.overshoot_on)  # moves only under Async
    cad.ledger.reset_timing()
    cad.ledger.reset_steps()
    round_ms = max(0.0, st.now - rs.opened_at) * 1000.0
    exposed_ms = 0.0 if cad.barrier_at is None else max(0.0, st.now - cad.barrier_at) * 1000.0
    cad.barrier_at = None
    cad.last_sync_ms = exposed_ms
    cad.exposed_s += exposed_ms / 1000.0
    cad.last_verdict = type(verdict).__name__
    out.append(
        Notice(
            "window",
            {
                "cycle": rs.cycle,
                "version": rs.version,
                "epoch": epoch,
                "counts": list(el.batch_counts),
                "anchor": el.anchor,
                "anchor_before": before,
                "anchor_rank": el.anchor_rank,
                "phase": str(el.phase),
                "calibration": calibration.reason,
                "sync_ms": report.sync_ms,
                "round_ms": round_ms,
                "overhead": overhead,
                "k_used": k_used,
                "k_max": k_max,
                "divergence": evidence.max_relative_delta(),
                "verdict": cad.last_verdict,
                "reason": verdict.reason,
                "meta": None if nudge is None else {"factor": nudge.factor, "reason": nudge.reason},
            },
        )
    )


def calibrated(st: CoordinatorState) -> bool:
    """ElChe has calibrated (Cadence/Async): the Fastest roles may be elected (the step's
    ``finish_round``, after the round's ``Update``)."""
    return st.cadence is not None and st.cadence.elche.calibrated


def summarise(st: CoordinatorState, out: dict[str, Any]) -> None:
    """The run summary's Cadence part (``_summary``): the ``elche`` block, and on each
    ``epochs`` row its ``averages`` (the rounds finished while it was trained)."""
    cad = st.cadence
    out["elche"] = summary(cad)
    for row in out["epochs"]:
        row["averages"] = cad.averages.get(row["epoch"], 0)


def summary(cad: CadenceState) -> dict[str, Any]:
    """``{anchor, anchor_rank, counts, phase, calibration_count, guard, last_verdict,
    exposed_sync_s, max_overshoot}`` (exposed: total time open rounds delayed the next
    window; max_overshoot: the Async look-ahead in batches, fixed at its initial value
    otherwise)."""
    el = cad.elche
    return {
        "anchor": el.anchor,
        "anchor_rank": el.anchor_rank,
        "counts": list(el.batch_counts),
        "phase": str(el.phase),
        "calibration_count": el.calibration_count,
        "guard": getattr(cad.guard, "name", type(cad.guard).__name__),
        "last_verdict": cad.last_verdict,
        "exposed_sync_s": cad.exposed_s,
        "max_overshoot": cad.overshoot.max_overshoot,
    }
