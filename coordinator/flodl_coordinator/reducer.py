"""The bus reducer: weighted parameter averaging for one open round at a time.

Theory of operation
-------------------
The core decides *when* a round opens and *who* must contribute (``OpenRound``); this
object only does the arithmetic and says when it is done. Each contribution arrives
already multiplied by its mass ``w_r`` (the rank's realized work, ``n**gamma``) with
``w_r`` in the header. We sum tensors in f32 and masses in f64, and divide exactly
once, by the mass of exactly the frames we accepted: work that never arrived is in
neither the sum nor the divisor. A rank that dies mid-round is dropped from the
expected set, so the round completes with the survivors' contributions — and a
contribution it had already sent is dropped too: it will never acknowledge the
consensus, so its samples are not committed and go back to the pool; keeping its
tensors in the sum would train those samples twice.

Folded contributions. A relay may fold its host's ranks (``flodl_worker.fold``): one
frame whose tensors are the sum of theirs, whose weight is the sum of their weights and
whose ``contributing_ranks`` names them. Which relay folds whom in the open round is the
``FoldPlan`` (``folding``); a folded frame is accepted when its relay folds every rank
it names, each of them is expected, and none is counted yet — it then credits every one
of them. The sum cannot be un-mixed, so when one of its ranks dies before the round is
done (or had died before the frame arrived: the race a ``FoldDrop`` could not win) the
whole frame leaves the round, mass and tensors, and its other ranks are *excluded*:
no longer waited for, not in the consensus's ``contributing_ranks``, but still sent the
consensus, so that they acknowledge the round and keep their local weights and credit.

Fan-out (the downstream twin of folding). The consensus is the same header and blobs
for every receiver, so a relay that folded >= ``MIN_FAN_OUT`` of the ranks in ``to``
this round gets it ONCE, on its own route, with ``deliver_to`` naming those ranks; it
forwards the very same frames to each (``flodl_worker.fold``). Only ranks whose work
reached the round through that relay's folded frame (accepted, or the frame excluded)
qualify: that proves the relay folds (not ``--no-fold``) and knows their frontend ids
from the cycle's ``FoldOpen``. Everyone else gets a copy on its own route, as before.
``bytes_out`` counts the copies actually sent: one per fan-out, one per direct rank.

After the division the outer optimizer (``outer``: SlowMo / Nesterov, identity by
default) turns the consensus into the global the ranks receive.

A round whose accepted mass is 0 answers ``weight = 0`` with elided tensors: every
receiver keeps its local parameters (nothing was realized).

Buffers (reference feature 23). The last ``RoundHeader.buffer_tensors`` tensors of a
frame are the model's f32 buffers (BatchNorm running stats), pre-scaled by their own
*mover* mass (1 per rank that stepped, 0 for an idle one; a folded frame: the sum) in
``buffer_weight``. They are summed with the parameters and divided once by the summed
mover mass of the accepted frames: an equal-weight mean over the ranks that moved,
never gamma-weighted. The outer optimizer and the ``too_far`` check see the parameters
only; a frame whose mover mass is not 0 or 1 per rank (0 exactly when its weight is 0)
is refused as ``weight``.

Refused contributions (issue 9). A frame that belongs to the open round (its cycle, an
expected rank not counted yet) but that the reducer will not sum -- tensors that fail to
decode or are not finite (``bad_tensor`` / ``non_finite``), shapes unlike the cohort's
(``shape``), a claimed weight its steps do not explain (``weight``), a point too far
from the last consensus (``too_far``) -- *leaves the round at once*: its ranks are no
longer waited for, so the round completes with the others instead of stalling for
``reduce_stall_s``. They are *refused*, and ``RoundResult.refused`` names them: the
service tells the core (``ContributionRefused``) before the consensus goes out. A refused
rank is still sent the consensus, on its own route, with an empty ``contributing_ranks``
(to a rank: "apply it", as before that field existed), so it resets to the consensus and
acks its snapshot step; the core discards that window (its samples are not committed and
go back to the pool) instead of committing it. A folded frame that is refused refuses
every rank it names (the sum cannot be un-mixed).

Weights are the coordinator's (``weight``): a rank's contribution mass is ``n**gamma`` for
the ``n`` steps since its last applied average at its snapshot. The core knows a bracket
for ``n``: ``OpenRound.steps`` (unfolded steps at the trigger; the snapshot comes after)
is a floor, and ``steps_seen(rank)`` (the unfolded steps the core has heard of when the
frame arrives; the rank reports every step before its round frame) a ceiling. A frame
whose claimed weight lies outside the masses of that bracket (summed over the ranks a
folded frame names; relative tolerance ``WEIGHT_RTOL`` for float rounding) is refused
rather than rescaled: every honest weight lies inside it, so one outside is a broken or
forged rank whose tensors are not to be trusted either; and since the tensors arrive
multiplied by the claimed weight, a rescale would still let it pick its own share.

Bounded contributions (``max_contribution_ratio`` = rho, 0 = off). With the
contribution's point ``x = sum / weight`` (a folded frame: its ranks' weighted mean)
and a reference ``c``, a frame is refused as ``too_far`` when
``||x - c||_2 > rho * max(||c||_2, 1)`` (L2 over all tensors; the floor of 1 keeps a
near-zero model from refusing everything). ``c`` is the last consensus this reducer
sent; before there is one (the first round, or after a restart) it is the coordinate-
wise median of the round's points when at least 3 frames carry tensors (a majority
outvotes one outlier), and the check is skipped otherwise (with two frames there is no
telling which one is wrong). The check runs when every frame is in.

Finite consensus. A consensus that is not finite (sums of finite but huge values can
overflow f32) is never sent: the round answers ``weight = 0`` (everyone keeps their local
parameters and their credit, nothing is committed) and ``nonfinite_rounds`` counts it;
an outer step that turns a finite average non-finite resets the outer optimizer and the
plain average is sent.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from flodl.wire import BadTensor, bf16_to_f32, f32_to_bf16, pack_round, pb, unpack_round

from .folding import FoldPlan
from .outer import OuterError, OuterOptimizer

__all__ = ["BusReducer", "RoundResult", "RoundRefused", "MIN_FAN_OUT"]

log = logging.getLogger("flodl.reducer")

# A relay is sent the consensus once for its ranks when it delivers to at least this many
# (for one rank, its own route costs the same and keeps the path the rank already uses).
MIN_FAN_OUT = 2
# A claimed weight may differ from the mass of its steps by this much (float rounding of
# n**gamma, sums in another order on a relay); anything more is not rounding.
WEIGHT_RTOL = 1e-6


class RoundRefused(Exception):
    """A contribution that cannot belong to the open round; ``reason`` names why.

    ``ranks`` non-empty: the frame did belong to the open round and its ranks left it
    (refused, ``code`` says why); call ``settle`` -- the round may be complete now."""

    def __init__(self, reason: str, ranks: tuple[int, ...] = (), code: str = ""):
        super().__init__(reason)
        self.reason = reason
        self.ranks = ranks
        self.code = code


def mass(n: int, gamma: float) -> float:
    """A rank's contribution mass for ``n`` steps (``flodl_worker.params.gamma_mass``)."""
    if n <= 0:
        return 0.0
    return float(n) if gamma == 1.0 else float(n) ** gamma


def mass_bracket(floor: int, ceiling: int, gamma: float) -> tuple[float, float]:
    """The least and greatest ``mass(n)`` for ``floor <= n <= ceiling`` (any gamma)."""
    ceiling = max(floor, ceiling)
    cands = [mass(floor, gamma), mass(ceiling, gamma)]
    if ceiling >= 1:
        cands.append(mass(max(1, floor), gamma))
    return min(cands), max(cands)


@dataclass
class RoundResult:
    """The consensus to send: the same header and blobs go to every rank in ``to``."""

    cycle: int
    to: tuple[int, ...]
    header: pb.RoundHeader
    blobs: list
    total_weight: float
    contributors: tuple[int, ...]
    excluded: tuple[int, ...] = ()  # sent the consensus, but their work is not in it
    # (relay route, ranks): one copy to the relay, which forwards it to those ranks.
    fanout: tuple[tuple[tuple, tuple[int, ...]], ...] = ()
    # (rank, code, reason): refused this round; sent the consensus to reset to (``header_for``).
    refused: tuple[tuple[int, str, str], ...] = ()
    nonfinite: bool = False  # the average was not finite: this is the weight-0 fallback
    _shared_wire: bytes | None = field(default=None, repr=False, compare=False)  # (``wire_for``)

    @property
    def direct(self) -> tuple[int, ...]:
        """The ranks of ``to`` that get their own copy on their own route."""
        via = {r for _, ranks in self.fanout for r in ranks}
        return tuple(r for r in self.to if r not in via)

    def header_for(self, rank: int) -> pb.RoundHeader:
        """What ``rank`` gets on its own route: a refused rank gets the consensus with an
        empty ``contributing_ranks`` ("apply it"): it resets to the consensus."""
        if not any(r == rank for r, _, _ in self.refused):
            return self.header
        h = pb.RoundHeader()
        h.CopyFrom(self.header)
        del h.contributing_ranks[:]
        return h

    def wire_for(self, rank: int) -> bytes | pb.RoundHeader:
        """``header_for(rank)`` as ``Endpoint.frames`` takes it: the header every rank but
        a refused one gets is serialised once (it names every contributor: written per
        rank, a round's fan-out was O(N^2))."""
        h = self.header_for(rank)
        if h is not self.header:
            return h
        if self._shared_wire is None:
            self._shared_wire = h.SerializeToString()
        return self._shared_wire

    def relay_header(self, ranks) -> pb.RoundHeader:
        """The consensus header for a relay's fan-out: the same, plus ``deliver_to``."""
        h = pb.RoundHeader()
        h.CopyFrom(self.header)
        h.deliver_to.extend(ranks)
        return h


@dataclass
class _Part:
    ranks: tuple[int, ...]  # one rank, or the ranks a relay folded
    weight: float
    arrays: list[np.ndarray] | None  # None when the weight is 0 (nothing to add)
    buffer_weight: float = 0.0  # the mover mass of its f32 buffers (the last tensors)


@dataclass
class _Open:
    cycle: int
    expected: set[int]
    parts: dict[tuple[int, ...], _Part] = field(default_factory=dict)
    counted: dict[int, tuple[int, ...]] = field(default_factory=dict)  # rank -> key of its part
    gone: set[int] = field(default_factory=set)  # dropped (dead) during this round
    excluded: set[int] = field(default_factory=set)  # alive, but their folded frame left
    via: dict[int, tuple] = field(default_factory=dict)  # rank -> relay whose folded frame carried it
    shapes: tuple[tuple[int, ...], ...] | None = None
    buffers: int = 0  # how many of the tensors are f32 buffers (the cohort's, like shapes)
    floor: dict[int, int] | None = None  # rank -> unfolded steps at the trigger (OpenRound.steps)
    refused: dict[int, tuple[str, str]] = field(default_factory=dict)  # rank -> (code, reason)


def _bf16_round(a: np.ndarray) -> np.ndarray:
    return bf16_to_f32(f32_to_bf16(a))


class BusReducer:
    def __init__(
        self,
        *,
        bf16_wire: bool = False,
        outer: OuterOptimizer | None = None,
        gamma: float = 1.0,
        steps_seen: Callable[[int], int] | None = None,
        max_contribution_ratio: float = 0.0,
    ) -> None:
        self.bf16_wire = bf16_wire
        self.outer = outer or OuterOptimizer()
        self.folds = FoldPlan()
        self.gamma = gamma
        # rank -> unfolded steps the core has heard of now (the weight's ceiling); None:
        # no weight check (a round opened without OpenRound.steps is not checked either).
        self.steps_seen = steps_seen
        self.max_contribution_ratio = max_contribution_ratio
        self._open: _Open | None = None
        self._last: list[np.ndarray] | None = None  # the last consensus sent (ratio check)
        self._shapes: tuple | None = None  # the cohort's tensor shapes, once a round saw them
        self._buffers = 0  # and how many of them are f32 buffers
        self.rounds_completed = 0
        self.bytes_in = 0
        self.bytes_out = 0
        self.folded_in = 0  # folded frames accepted
        self.folds_discarded = 0  # folded frames dropped because one of their ranks died
        self.refused_frames = 0  # frames that left their round refused
        self.nonfinite_rounds = 0  # rounds whose average was not finite (weight-0 fallback)
        # Elastic membership: the latest consensus sent, as the seed frame a rank admitted
        # into the running world starts from (``RoundHeader.seed``); None until a round
        # with mass finished in this process.
        self.seed: tuple[pb.RoundHeader, list] | None = None
        self.seeds_sent = 0
        self.seed_bytes = 0

    def seed_frame(self) -> tuple[pb.RoundHeader, list] | None:
        """(header, blobs) of the latest consensus as a joiner's seed, counted as sent."""
        if self.seed is None:
            return None
        self.seeds_sent += 1
        self.seed_bytes += sum(len(b) for b in self.seed[1])
        return self.seed

    def abandon(self) -> None:
        """Forget the open round and the folds in flight (a relay restarted: contributions
        and folds inside it are lost; the core abandons the round and redoes it)."""
        self._open = None
        self.folds = FoldPlan()

    @property
    def open_cycle(self) -> int | None:
        return self._open.cycle if self._open else None

    def open(self, cycle: int, ranks, steps=()) -> RoundResult | None:
        """Start expecting contributions for ``cycle``. An unfinished older round is abandoned.

        ``steps``: ``OpenRound.steps``, the floor of each rank's weight (see the module doc)."""
        ranks = tuple(ranks)
        floor = dict(zip(ranks, steps)) if len(tuple(steps)) == len(ranks) and ranks else None
        self._open = _Open(cycle=cycle, expected=set(ranks), floor=floor)
        return self._maybe_finish()

    def settle(self) -> RoundResult | None:
        """The consensus, if the open round is complete (after a refusal left it)."""
        return self._maybe_finish()

    def contribute(self, rank: int, header: pb.RoundHeader, blobs) -> RoundResult | None:
        """One rank's own (unfolded) contribution."""
        o = self._check_cycle(f"rank {rank}", header)
        self._check_rank(o, f"rank {rank}", rank)
        self._accept(o, (rank,), header, blobs, f"rank {rank}")
        return self._maybe_finish()

    @staticmethod
    def _check_rank(o: "_Open", who: str, r: int) -> None:
        """Refuse a contribution for ``r`` that cannot count in the open round."""
        if r in o.excluded:
            raise RoundRefused(f"{who}: rank {r} is excluded from cycle {o.cycle} (its relay's folded frame left the round)")
        if r in o.refused:
            raise RoundRefused(f"{who}: rank {r}'s contribution to cycle {o.cycle} was already refused")
        if r not in o.expected:
            raise RoundRefused(f"{who}: rank {r} is not expected in cycle {o.cycle}")
        if r in o.counted:
            raise RoundRefused(f"{who}: rank {r} already contributed to cycle {o.cycle}")

    def contribute_folded(self, relay: tuple, header: pb.RoundHeader, blobs) -> RoundResult | None:
        """A relay's folded frame: credits every rank in ``header.contributing_ranks``."""
        who = f"relay {relay[0][:32]!r}" if relay else "relay"
        o = self._check_cycle(who, header)
        ranks = tuple(sorted(header.contributing_ranks))
        if not ranks:
            raise RoundRefused(f"{who}: folded frame names no contributing ranks")
        if len(set(ranks)) != len(ranks):
            raise RoundRefused(f"{who}: folded frame names a rank twice")
        for r in ranks:
            if self.folds.relay_of(o.cycle, r) != relay:
                raise RoundRefused(f"{who} does not fold rank {r} in cycle {o.cycle}")
        dead = [r for r in ranks if r in o.gone]
        if dead:
            # The race: the fold left before the FoldDrop reached the relay. The dead
            # rank's work cannot be taken out of the sum: the frame leaves the round.
            self._exclude(o, ranks, f"rank {dead[0]} died after its relay's fold left")
            o.via.update((r, relay) for r in ranks)
            return self._maybe_finish()
        for r in ranks:
            self._check_rank(o, who, r)
        self._accept(o, ranks, header, blobs, who)
        o.via.update((r, relay) for r in ranks)
        self.folded_in += 1
        return self._maybe_finish()

    def drop(self, rank: int) -> RoundResult | None:
        """``rank`` is gone: stop waiting for it (and do not send it the consensus)."""
        o = self._open
        if o is None:
            return None
        o.expected.discard(rank)
        o.excluded.discard(rank)
        o.refused.pop(rank, None)
        o.gone.add(rank)
        key = o.counted.get(rank)
        if key is not None:
            if len(key) == 1:
                del o.counted[rank]
                del o.parts[key]
            else:
                self._exclude(o, key, f"rank {rank} died before the round was done")
        return self._maybe_finish()

    # -- internals ---------------------------------------------------------------------

    def _check_cycle(self, who: str, header: pb.RoundHeader) -> _Open:
        o = self._open
        if o is None or header.cycle != o.cycle:
            raise RoundRefused(f"{who} sent cycle {header.cycle}, open cycle is {self.open_cycle}")
        if header.kind != pb.ROUND_KIND_MODEL or header.phase not in (
            pb.ROUND_PHASE_PARAMS,
            pb.ROUND_PHASE_UNSPECIFIED,
        ):
            raise RoundRefused(f"{who}: round phase {header.phase} kind {header.kind} is not a params round")
        return o

    def _accept(self, o: _Open, ranks: tuple[int, ...], header: pb.RoundHeader, blobs, who: str) -> None:
        """Sum the frame into the open round, or refuse it: its ranks leave the round."""
        try:
            arrays = unpack_round(header, blobs)
        except BadTensor as e:
            code = "non_finite" if "non-finite" in str(e) else "bad_tensor"
            self._refuse(o, ranks, code, f"{who}: {e}")
        shapes = tuple(a.shape for a in arrays)
        if o.shapes is not None and (shapes != o.shapes or header.buffer_tensors != o.buffers):
            self._refuse(o, ranks, "shape", f"{who}: tensor shapes differ from the cohort's")
        if o.shapes is None:
            o.shapes, o.buffers = shapes, header.buffer_tensors
        w = float(header.weight)
        self._check_weight(o, ranks, w, who)
        bw = float(header.buffer_weight) if header.buffer_tensors else 0.0
        if header.buffer_tensors and not (bw == int(bw) and (bw == 0) == (w == 0) and bw <= len(ranks)):
            self._refuse(o, ranks, "weight", f"{who}: buffer weight {bw:g} is not 1 per rank that moved")
        o.parts[ranks] = _Part(ranks, w, arrays if w > 0 else None, bw)
        for r in ranks:
            o.counted[r] = ranks
        self.bytes_in += sum(len(b) for b in blobs)

    def _check_weight(self, o: _Open, ranks: tuple[int, ...], w: float, who: str) -> None:
        """Refuse a claimed weight outside the masses of the ranks' step brackets."""
        if o.floor is None or self.steps_seen is None:
            return
        lo = hi = 0.0
        for r in ranks:
            a, b = mass_bracket(o.floor.get(r, 0), self.steps_seen(r), self.gamma)
            lo, hi = lo + a, hi + b
        slack = WEIGHT_RTOL * max(hi, 1.0)
        if not (lo - slack <= w <= hi + slack):
            self._refuse(
                o, ranks, "weight",
                f"{who}: claimed weight {w:g} is not the mass of its steps (expected {lo:g}..{hi:g})",
            )

    def _refuse(self, o: _Open, ranks: tuple[int, ...], code: str, why: str):
        """The frame's ranks leave the open round, refused; raises ``RoundRefused``."""
        self._leave(o, ranks, code, why)
        raise RoundRefused(why, ranks=ranks, code=code)

    def _leave(self, o: _Open, ranks: tuple[int, ...], code: str, why: str) -> None:
        o.parts.pop(ranks, None)
        for r in ranks:
            o.counted.pop(r, None)
            o.expected.discard(r)
            o.via.pop(r, None)
            o.refused[r] = (code, why)
        self.refused_frames += 1

    def _too_far(self, o: _Open) -> list[tuple[tuple[int, ...], str]]:
        """The parts whose point is too far from the reference (module doc); [] when off."""
        rho = self.max_contribution_ratio
        weighted = [p for _, p in sorted(o.parts.items()) if p.arrays is not None and p.weight > 0]
        if rho <= 0 or not weighted:
            return []
        nparams = len(weighted[0].arrays) - o.buffers  # the buffers are not the model's point
        points = {
            p.ranks: [a / np.float32(p.weight) for a in p.arrays[:nparams]] for p in weighted
        }
        ref = self._last
        if ref is not None and tuple(a.shape for a in ref) != o.shapes[:nparams]:
            ref = None
        if ref is None:
            if len(points) < 3:
                return []
            with np.errstate(all="ignore"):
                ref = [np.median(np.stack(ts), axis=0).astype(np.float32) for ts in zip(*points.values())]
        bound = rho * max(_l2(ref), 1.0)
        far = []
        for ranks, x in points.items():
            with np.errstate(all="ignore"):
                d = _l2([a - c for a, c in zip(x, ref)])
            if not d <= bound:  # NaN included
                far.append((ranks, f"ranks {list(ranks)}: ||x - c|| = {d:.4g} > {rho:g} * max(||c||, 1) = {bound:.4g}"))
        return far

    def _exclude(self, o: _Open, ranks: tuple[int, ...], why: str) -> None:
        """A folded frame leaves the round; its surviving ranks are excluded."""
        o.parts.pop(ranks, None)
        for r in ranks:
            o.counted.pop(r, None)
            if r not in o.gone:
                o.expected.discard(r)
                o.excluded.add(r)
        self.folds_discarded += 1
        log.warning(
            "cycle %d: folded contribution of ranks %s discarded (%s); %s keep their local weights",
            o.cycle, list(ranks), why, sorted(set(ranks) - o.gone) or "none",
        )

    def _maybe_finish(self) -> RoundResult | None:
        o = self._open
        # Fewer counted than expected cannot cover them: a length test first, so a round of
        # N contributions is not N subset walks of N (O(N^2): 95 us a contribution at 4,096).
        if o is None or len(o.counted) < len(o.expected) or not o.expected.issubset(o.counted.keys()):
            return None
        self._open = None
        for ranks, why in self._too_far(o):
            self._leave(o, ranks, "too_far", f"cycle {o.cycle}: {why}")
            log.warning("cycle %d: contribution of ranks %s refused (too_far): %s", o.cycle, list(ranks), why)
        contributors = tuple(sorted(o.counted))
        excluded = tuple(sorted(o.excluded))
        to = tuple(sorted(set(contributors) | o.excluded | set(o.refused)))
        total = float(sum(p.weight for p in o.parts.values()))
        btotal = float(sum(p.buffer_weight for p in o.parts.values()))
        weighted = [p for _, p in sorted(o.parts.items()) if p.arrays is not None]
        nonfinite = False
        if o.shapes is None:  # every frame refused undecoded: the schema of an earlier round
            o.shapes, o.buffers = self._shapes, self._buffers
        nparams = len(o.shapes or ()) - o.buffers
        if total > 0 and weighted:
            # f32 accumulation in rank order (deterministic), one division at the end:
            # parameters by the summed mass, f32 buffers by the summed mover mass.
            consensus = [np.array(t, dtype=np.float32, copy=True) for t in weighted[0].arrays]
            with np.errstate(over="ignore", invalid="ignore"):
                for p in weighted[1:]:
                    for acc, t in zip(consensus, p.arrays):
                        acc += t
                inv, binv = np.float32(total), np.float32(btotal if btotal > 0 else 1.0)
                for i, acc in enumerate(consensus):
                    acc /= inv if i < nparams else binv
            if _finite(consensus):
                consensus = self._outer_step(o.cycle, consensus[:nparams]) + consensus[nparams:]
            else:
                nonfinite = True
                self.nonfinite_rounds += 1
                log.error(
                    "cycle %d: the average of ranks %s is not finite: not sent; every rank keeps its "
                    "local parameters (weight 0)", o.cycle, list(contributors),
                )
        self._shapes, self._buffers = o.shapes, o.buffers
        if nonfinite or not (total > 0 and weighted):
            total = btotal = 0.0
            consensus = [np.zeros(s, dtype=np.float32) for s in (o.shapes or ())]
        elif self.max_contribution_ratio > 0:
            self._last = consensus[:nparams]
        header, blobs = pack_round(
            consensus,
            cycle=o.cycle,
            weight=total,
            bf16=self.bf16_wire,
            contributing_ranks=contributors,
            buffers=o.buffers,
            buffer_weight=btotal,
        )
        if total > 0:
            seed = pb.RoundHeader()
            seed.CopyFrom(header)
            del seed.contributing_ranks[:]
            seed.seed = True
            self.seed = (seed, blobs)
        groups: dict[tuple, list[int]] = {}
        for r in to:
            relay = o.via.get(r)
            if relay is not None:
                groups.setdefault(relay, []).append(r)
        fanout = tuple((relay, tuple(rs)) for relay, rs in sorted(groups.items()) if len(rs) >= MIN_FAN_OUT)
        copies = len(to) - sum(len(rs) for _, rs in fanout) + len(fanout)
        self.rounds_completed += 1
        self.bytes_out += sum(len(b) for b in blobs) * copies
        refused = tuple((r, code, why) for r, (code, why) in sorted(o.refused.items()))
        return RoundResult(o.cycle, to, header, blobs, total, contributors, excluded, fanout, refused, nonfinite)

    def _outer_step(self, cycle: int, consensus: list[np.ndarray]) -> list[np.ndarray]:
        if not self.outer.enabled:
            return consensus
        quantize = _bf16_round if self.bf16_wire else None
        try:
            out = self.outer.step(cycle, consensus, quantize=quantize)
        except OuterError as e:
            log.error("outer optimizer state reset: %s", e)
            self.outer.reset()
            out = self.outer.step(cycle, consensus, quantize=quantize)
        if not _finite(out):
            log.error("cycle %d: the outer step is not finite: outer optimizer state reset, plain average sent", cycle)
            self.outer.reset()
            return consensus
        return out


def _finite(arrays) -> bool:
    return all(bool(np.isfinite(a).all()) for a in arrays)


def _l2(arrays) -> float:
    total = 0.0
    for a in arrays:
        v = np.asarray(a, dtype=np.float64).ravel()
        total += float(np.dot(v, v))
    return math.sqrt(total) if math.isfinite(total) else math.inf
