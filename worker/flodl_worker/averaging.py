"""flodl_worker.averaging: the rank's half of a bus averaging round.

Theory of operation
-------------------
``RequestParams{cycle}``: deep-copy the parameters and the f32 buffers (the snapshot:
one flat host array, ``flodl_worker.staging``), n = steps since the last applied
average, weight = n**gamma (0 when n <= 0: the idle guard), send ``round`` with params x
weight followed by the f32 buffers x their mover mass (1 if the rank stepped, else 0:
``flodl_worker.buffers``), tensors elided when the weight is 0, bf16 when the RunSpec
says.

Buffers are overwritten by the consensus's (its ``buffer_weight`` > 0; reference: always
overwritten, never blended nor shifted by the steps since the snapshot -- a running
variance shifted by a difference could turn negative); non-f32 buffers keep their
local value.

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

The accounting (n, the weight, the credit, the folded step, which step the ack names)
is the rank machine's (``flodl.rank``): it answers ``RequestParams`` with
``TakeSnapshot`` and a ``ConsensusReady`` with ``ApplyConsensus``. This module only
copies, packs, checks and applies tensors.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from flodl.rank import ApplyConsensus, SeedApplied, TakeSnapshot
from flodl.wire import WireError, pack_round, pb, split_buffers, unpack_round

from .buffers import mover_mass
from .params import as_tensor, f32, l2_norm
from .staging import FlatStaging

__all__ = ["BusAverager", "Snapshot"]

log = logging.getLogger("flodl.rank")


@dataclass(frozen=True, slots=True)
class Snapshot:
    n: int  # steps since the last applied average, at the snapshot
    step_count: int  # local step counter at the snapshot
    pre: list  # deep-copied f32 parameters (for the divergence triple): views of ``flat``
    weight: float
    bufs: list  # deep-copied f32 buffers: views of ``flat``
    flat: np.ndarray  # the one host copy: parameters then f32 buffers


class BusAverager:
    """Snapshots, contributions and consensus application for one rank.

    ``rank`` is the owning shell (``flodl_worker.shell.MachineShell``): it holds the
    machine ``m``, the parameters and the socket (``_send``/``_timing``/``_drop``) and
    hears of a consensus through ``consensus_ready``; this object never touches a
    socket itself.
    """

    def __init__(self, rank) -> None:
        self.rank = rank
        self.snapshots: dict[int, Snapshot] = {}
        self._staging: FlatStaging | None = None

    @property
    def staging(self) -> FlatStaging:
        """The flat layout of parameters + f32 buffers (built once the model is)."""
        if self._staging is None:
            self._staging = FlatStaging(list(self.rank.params) + list(self.rank.buffers))
        return self._staging

    @property
    def folded_step(self) -> int:
        return self.rank.m.folded_step

    def take(self, cmd: TakeSnapshot) -> None:
        """``TakeSnapshot``: deep-copy the parameters and send the weighted round."""
        r, w = self.rank, cmd.weight
        snap = self._snapshot(cmd)
        st = self.staging
        flat = snap.flat
        if w > 0:  # one flat scaled frame: params x w, then buffers x 1 (the mover mass)
            flat = np.empty_like(snap.flat)
            n = st.offsets[len(snap.pre)]
            np.multiply(snap.flat[:n], np.float32(w), out=flat[:n])
            flat[n:] = snap.flat[n:]
        header, blobs = pack_round(
            st.views(flat), cycle=cmd.cycle, weight=w, bf16=r.spec.bf16_wire,
            buffers=len(snap.bufs), buffer_weight=mover_mass(w),
        )  # fmt: skip
        r._send("round", header, blobs)

    def _snapshot(self, cmd: TakeSnapshot) -> Snapshot:
        st = self.staging
        flat = st.gather()  # deep copy: never a torn/aliased view
        views = st.views(flat)
        n = len(self.rank.params)
        snap = Snapshot(
            n=cmd.n, step_count=cmd.step_count, pre=views[:n], weight=cmd.weight, bufs=views[n:], flat=flat
        )
        self.snapshots[cmd.cycle] = snap
        return snap

    def settle(self) -> None:
        """Before a coordinator restart is handled: finish what already completed (bus: nothing)."""

    def abandon(self, cycles) -> None:
        """The coordinator restarted: these cycles' rounds are gone (no ack, credit kept)."""
        for c in cycles:
            self.snapshots.pop(c, None)

    def on_consensus(self, header: pb.RoundHeader, blobs: list) -> None:
        """Check a consensus frame and hand it to the machine (``rank.consensus_ready``)."""
        r = self.rank
        if header.cycle not in self.snapshots:
            r._drop("unknown_cycle", f"consensus for cycle {header.cycle}, which this rank never snapshotted")
            return
        if header.phase != pb.ROUND_PHASE_PARAMS or header.kind != pb.ROUND_KIND_MODEL:
            r._drop("unsupported_round", f"round phase {header.phase} kind {header.kind}")
            return
        arrays = self._unpacked(header, blobs)
        if arrays is None:
            return
        if header.weight == 0 and not header.tensors:
            # Nothing was accepted and the reducer never saw the schema (every frame of the
            # round refused undecoded): the same answer as a weight-0 consensus.
            header = pb.RoundHeader(cycle=header.cycle, buffer_tensors=len(r.buffers))
            arrays = [np.zeros(s, dtype=np.float32) for s in self.staging.shapes]
        split = self._fitting(header, arrays, "consensus")
        if split is None:
            return
        params, bufs = split
        included = header.weight > 0 and (
            not header.contributing_ranks or r.cfg.rank in header.contributing_ranks
        )
        if not included and header.weight > 0:
            log.info("cycle %d: this rank's contribution is not in the consensus; keeping local parameters", header.cycle)
        # The buffers ride along only when realized (some rank moved): else kept local.
        consensus = (params + bufs if header.buffer_weight > 0 else params) if included else None
        r.consensus_ready(header.cycle, consensus)

    def on_seed(self, header: pb.RoundHeader, blobs: list) -> None:
        """Joining a running world: overwrite the parameters (and the f32 buffers, when the
        consensus carries them) with the seed consensus and tell the machine (``SeedApplied``). The optimizer's state stays the fresh one the
        rank just built (momentum starts from zero): copying a peer's would cost another
        transfer as large as the model, from a peer the bus plane does not reach, and
        measured it does not pay (``bench/joiner_optimizer_state.py``, docs/accuracy.md:
        with SGD momentum fresh ends best; with Adam copied moments end 0.004 nats better,
        within the seeds' spread)."""
        r = self.rank
        if not r.m.accepts_seed():
            r._drop("unexpected_seed", f"seed of cycle {header.cycle} for a rank that is not joining (or trained)")
            return
        arrays = self._unpacked(header, blobs)
        if arrays is None:
            return
        split = self._fitting(header, arrays, "seed")
        if split is None:
            return
        params, bufs = split
        # The consensus's f32 buffers, as a round overwrites them (when it carries them).
        self.load_seed(params, bufs if header.buffer_weight > 0 else [])
        log.info("joined the running world: parameters set from the consensus of cycle %d", header.cycle)
        r.feed(SeedApplied(cycle=int(header.cycle)))

    def load_seed(self, params: list, bufs: list) -> None:
        """Overwrite the parameters (and the f32 buffers given) with a seed's arrays."""
        r = self.rank
        with torch.no_grad():
            for p, a in zip(r.params, params):
                p.copy_(as_tensor(a).to(device=p.device, dtype=p.dtype))
            for b, a in zip(r.buffers, bufs):
                b.copy_(as_tensor(a).to(device=b.device, dtype=b.dtype))

    def _unpacked(self, header: pb.RoundHeader, blobs: list) -> list | None:
        """The frame's arrays, or None after dropping a malformed frame by its reason."""
        try:
            return unpack_round(header, blobs)
        except WireError as e:
            self.rank._drop(e.reason, e.detail)
            return None

    def _fitting(self, header: pb.RoundHeader, arrays: list, what: str) -> tuple[list, list] | None:
        """(parameters, f32 buffers) of a frame, or None after dropping one that does not fit the model."""
        r = self.rank
        params, bufs = split_buffers(header, arrays)
        if not (_fits(params, r.params) and _fits(bufs, r.buffers)):
            r._drop("bad_tensor", f"{what} of cycle {header.cycle} does not match the model's schema")
            return None
        return params, bufs

    def apply(self, cmd: ApplyConsensus) -> None:
        """``ApplyConsensus``: apply ``cmd.arrays`` against the snapshot and ack the cycle.

        ``arrays`` None: this rank's work is not in a consensus (weight 0, its fold was
        dropped, or -- collective plane -- the all-reduce failed): keep the local
        parameters; the ack names the step the machine says (the last folded one).
        Shared by both data planes (``flodl_worker.collective``)."""
        snap = self.snapshots.pop(cmd.cycle)
        post = snap.pre  # not included: the consensus is our own snapshot (keep local)
        if cmd.arrays is not None:
            post = self._apply(cmd.arrays, snap, cmd.moved)
        post_norm = l2_norm(post)
        diff = l2_norm([b - a for a, b in zip(snap.pre, post)])
        self.rank._timing(
            sync_ack=pb.Timing.SyncAck(
                cycle=cmd.cycle,
                step_count=cmd.ack_step,
                divergence=diff / post_norm if post_norm > 1e-10 else 0.0,
                pre_norm=l2_norm(snap.pre),
                post_norm=post_norm,
            )
        )

    def _apply(self, arrays: list, snap: Snapshot, moved: bool) -> list:
        """theta <- consensus (+ steps since the snapshot), or the EASGD blend; returns post."""
        r = self.rank
        alpha = r.spec.easgd_alpha
        blend = r.spec.policy == pb.POLICY_ASYNC and 0.0 < alpha < 1.0
        consensus = []
        n = len(r.params)
        arrays, bufs = arrays[:n], arrays[n:]
        with torch.no_grad():
            for b, a in zip(r.buffers, bufs):  # always overwritten (module doc)
                b.copy_(as_tensor(a).to(device=b.device, dtype=b.dtype))
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


def _fits(arrays: list, tensors: list) -> bool:
    return len(arrays) == len(tensors) and all(tuple(a.shape) == tuple(t.shape) for a, t in zip(arrays, tensors))
