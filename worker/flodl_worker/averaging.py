"""flodl_worker.averaging: the rank's half of a bus averaging round.

Theory of operation
-------------------
``RequestParams{cycle}``: deep-copy the parameters (the snapshot), n = steps since the
last applied average, weight = n**gamma (0 when n <= 0: the idle guard), send ``round``
with params x weight (tensors elided when the weight is 0; bf16 when the RunSpec says).

The consensus ``round{cycle}`` comes back with the total weight and the ranks whose
contributions it holds (``contributing_ranks``):

- weight > 0 and this rank included: theta <- consensus + (theta - snapshot). The round
  overlaps training (Cadence hands out the next window with the ``RequestParams``), so
  the k steps taken since the snapshot are kept on top of the consensus; k = 0 is the
  plain overwrite, bit for bit. Under the Async policy with 0 < easgd_alpha < 1 the
  blend is elastic instead: theta <- theta + alpha * (consensus - theta). The snapshot's n
  is subtracted from the steps since average (steps taken during the round keep their
  credit, reference hazard 13), and the snapshot's step count becomes the folded step.
- weight 0, or this rank *not* among a non-empty ``contributing_ranks`` (its relay's fold
  was dropped because a host-mate died after the fold left): keep the local parameters
  and the credit; nothing of this rank's work is in the consensus, so the ack names the
  last folded step and commits nothing new.

Either way the rank answers ``timing.sync_ack{cycle, step_count, divergence (snapshot vs
consensus), pre_norm, post_norm}``; ``step_count`` commits the rank's batches up to it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from flodl.wire import WireError, pack_round, pb, unpack_round

from .params import as_tensor, f32, gamma_mass, l2_norm

__all__ = ["BusAverager", "Snapshot"]

log = logging.getLogger("flodl.rank")


@dataclass(frozen=True, slots=True)
class Snapshot:
    n: int  # steps since the last applied average, at the snapshot
    step_count: int  # local step counter at the snapshot
    pre: list  # deep-copied f32 parameters (for the divergence triple)
    weight: float


class BusAverager:
    """Snapshots, contributions and consensus application for one rank.

    ``rank`` is the owning runtime: it holds the parameters, the step counters and the
    socket (``_send``/``_timing``/``_drop``); this object never touches a socket itself.
    """

    def __init__(self, rank) -> None:
        self.rank = rank
        self.snapshots: dict[int, Snapshot] = {}
        self.folded_step = 0  # local step count of the last snapshot folded into a consensus

    def on_request(self, cycle: int) -> None:
        r = self.rank
        n = r.steps_since_avg
        w = gamma_mass(n, r.spec.gamma)
        pre = [f32(p).copy() for p in r.params]  # deep copy: never a torn/aliased view
        scaled = [a * np.float32(w) for a in pre] if w > 0 else pre
        header, blobs = pack_round(scaled, cycle=cycle, weight=w, bf16=r.spec.bf16_wire)
        self.snapshots[cycle] = Snapshot(n=n, step_count=r.local_step, pre=pre, weight=w)
        r._send("round", header, blobs)

    def on_consensus(self, header: pb.RoundHeader, blobs: list) -> int | None:
        """Apply a consensus and ack it; return its cycle, or None when it was dropped."""
        r = self.rank
        snap = self.snapshots.get(header.cycle)
        if snap is None:
            r._drop("unknown_cycle", f"consensus for cycle {header.cycle}, which this rank never snapshotted")
            return None
        if header.phase != pb.ROUND_PHASE_PARAMS or header.kind != pb.ROUND_KIND_MODEL:
            r._drop("unsupported_round", f"round phase {header.phase} kind {header.kind}")
            return None
        try:
            arrays = unpack_round(header, blobs)
        except WireError as e:
            r._drop(e.reason, e.detail)
            return None
        if header.weight == 0 and not header.tensors:
            # Nothing was accepted and the reducer never saw the schema (every frame of the
            # round refused undecoded): the same answer as a weight-0 consensus.
            arrays = [np.zeros(tuple(p.shape), dtype=np.float32) for p in r.params]
        if len(arrays) != len(r.params) or any(tuple(a.shape) != tuple(p.shape) for a, p in zip(arrays, r.params)):
            r._drop("bad_tensor", f"consensus for cycle {header.cycle} does not match the model's schema")
            return None
        del self.snapshots[header.cycle]
        included = header.weight > 0 and (
            not header.contributing_ranks or r.cfg.rank in header.contributing_ranks
        )
        if not included and header.weight > 0:
            log.info("cycle %d: this rank's contribution is not in the consensus; keeping local parameters", header.cycle)
        return self.conclude(header.cycle, snap, arrays if included else None)

    def conclude(self, cycle: int, snap: Snapshot, arrays: list | None) -> int:
        """Apply the consensus ``arrays`` of ``cycle`` and ack it; return the cycle.

        ``arrays`` None: this rank's work is not in a consensus (weight 0, its fold was
        dropped, or -- collective plane -- the all-reduce failed): keep the local
        parameters and the credit, and ack the last folded step (commits nothing new).
        Shared by both data planes (``flodl_worker.collective``)."""
        r = self.rank
        post = snap.pre  # not included: the consensus is our own snapshot (keep local)
        acked_step = self.folded_step
        if arrays is not None:
            post = self._apply(arrays, snap)
            r.steps_since_avg = max(0, r.steps_since_avg - snap.n)
            self.folded_step = acked_step = snap.step_count
        hold = getattr(getattr(r, "checkpoints", None), "hold", None)
        if hold is not None:  # held until the next consensus: a later Checkpoint{cycle} saves it
            hold(cycle, arrays)
        post_norm = l2_norm(post)
        diff = l2_norm([b - a for a, b in zip(snap.pre, post)])
        r._timing(
            sync_ack=pb.Timing.SyncAck(
                cycle=cycle,
                step_count=acked_step,
                divergence=diff / post_norm if post_norm > 1e-10 else 0.0,
                pre_norm=l2_norm(snap.pre),
                post_norm=post_norm,
            )
        )
        return cycle

    def _apply(self, arrays: list, snap: Snapshot) -> list:
        """theta <- consensus (+ steps since the snapshot), or the EASGD blend; returns post."""
        r = self.rank
        alpha = r.spec.easgd_alpha
        blend = r.spec.policy == pb.POLICY_ASYNC and 0.0 < alpha < 1.0
        moved = r.local_step != snap.step_count
        consensus = []
        with torch.no_grad():
            for p, a, pre in zip(r.params, arrays, snap.pre):
                t = as_tensor(a).to(device=p.device, dtype=p.dtype)
                if blend:
                    p.lerp_(t, alpha)  # EASGD: p + alpha * (avg - p)
                    continue
                delta = f32(p) - pre if moved else None
                p.copy_(t)
                if delta is not None:
                    p.add_(as_tensor(delta).to(device=p.device, dtype=p.dtype))
                consensus.append(f32(t))
        # Divergence is snapshot vs consensus, as without overlap (not vs theta now).
        return [f32(p) for p in r.params] if blend else consensus
