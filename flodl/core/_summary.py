"""The run summary: composed from every record's own summary (JSON-safe).

``summary(st, summarise)`` is what ``RunFinished`` carries (the step emits it when the
run becomes FINISHED): the run's counters and rows, each rank, the coverage ledger's rows
(``_coverage.summary``), the epochs and the answered evals; a coordinator restart's rows
(``_resync.summary``); the policy's part (``summarise`` = ``Policy.summarise``: under
Cadence/Async the ``elche`` block, ``cadence._feedback``) and the collective plane's
generations (``_collective.summary``) when the run has them.
"""

from __future__ import annotations

from typing import Any, Callable

from . import _collective, _coverage, _membership, _repartition, _resync
from ._state import CoordinatorState

__all__ = ["summary"]


def summary(st: CoordinatorState, summarise: Callable[[CoordinatorState, dict[str, Any]], None]) -> dict[str, Any]:
    """The run summary (JSON-safe)::

    {world_size, policy, total_samples, epochs_completed, averages, averaging_s, global_step,
     accuracy: float|None, wall_s, discarded_samples,
     ranks: [{rank, host, phase, reason, samples, batches, batch_frames, train_s, wait_s,
              steps, param_digest}],
     plan_wait_share,
     coverage: [{epoch, expected, trained, duplicates, missing, discarded}],
     epochs: [{epoch, avg_loss, epoch_ms, per_rank_throughput}],
     evals: [{epoch, metric}]}   (non-final evals asked by an eval intent)

    Cadence adds ``elche: {anchor, anchor_rank, counts, phase, calibration_count, guard,
    last_verdict, exposed_sync_s}`` and, on each ``epochs`` row, ``averages``: the rounds finished while
    that epoch was being trained. The Sync shape is exactly the one above.
    A run that survived a coordinator restart adds ``coordinator_restarts: [{restart, at,
    abandoned_cycle, awaiting, resynced, recovered_batches, recovered_chunks,
    resent_samples, released}]`` (``_resync``).
    """
    fe = st.run.final_eval
    cov = _coverage.summary(st.coverage)
    ranks = [
        {
            "rank": rec.rank,
            "host": rec.host,
            "phase": repr(rec.phase),
            "reason": rec.reason,
            "samples": rec.samples,
            "batches": rec.batches,
            "batch_frames": rec.batch_frames,
            # The time it trained (batch + data) and sat idle waiting for a plan (its
            # batches' wait_ms): where its possible training time went.
            "train_s": round(rec.train_ms / 1e3, 3),
            "wait_s": round(rec.wait_ms / 1e3, 3),
            "steps": rec.last_step,
            "param_digest": rec.param_digest,
        }
        for rec in st.ranks
    ]
    out = {
        "world_size": st.config.world_size,
        "policy": st.config.policy,
        "total_samples": st.total_samples,
        "epochs_completed": len(st.metrics.history),
        "averages": st.rounds.version,
        "averaging_s": st.rounds.open_s,
        "global_step": st.rounds.global_step,
        "accuracy": fe.accuracy if fe is not None else None,
        "wall_s": (st.now - st.run.formed_at) if st.run.formed_at is not None else 0.0,
        "discarded_samples": sum(c["discarded"] for c in cov),
        "plan_wait_share": _plan_wait_share(st),
        "ranks": ranks,
        "coverage": cov,
        "epochs": [dict(row) for row in st.metrics.history],
        "evals": [dict(row) for row in st.roles.evals],
    }
    if st.config.elastic or st.run.joins:  # the quorum it formed from, who joined, the slots nobody took
        out["elastic"] = _membership.elastic_summary(st)
        if st.dispatch.trim_counts:  # Sync re-partitioned an epoch for a joiner
            out["elastic"]["repartition"] = _repartition.summary(st)
    if st.resync.restarts:  # coordinator restarts survived
        out["coordinator_restarts"] = _resync.summary(st)
    summarise(st, out)  # the policy's part (Cadence: ``elche``, each epoch's ``averages``)
    if st.collective is not None:  # collective plane: its process-group generations
        out["collective"] = _collective.summary(st.collective, st.config)
    return out


def _plan_wait_share(st: CoordinatorState) -> float:
    """The part of the ranks' time (training plus waiting for a plan, between their first
    and last batch) they spent waiting: what the coordinator and the policy cost them."""
    train = sum(rec.train_ms for rec in st.ranks)
    wait = sum(rec.wait_ms for rec in st.ranks)
    return round(wait / (train + wait), 4) if train + wait > 0.0 else 0.0
