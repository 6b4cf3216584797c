"""ElChe: the cadence engine -- how many batches each rank runs between two reduces.

Theory of operation
-------------------
The column marches at the slowest one's pace. One rank is the *anchor rank* (the slow
one); it runs ``anchor`` batches per window, and every other rank runs proportionally more,
``round(anchor * slow_ms / ms_r)``, so all ranks reach the reduce at about the same time.
Nobody waits, nobody idles.

Each reduce the coordinator hands ElChe the window's timing (:meth:`ElChe.report_window`,
which picks the timing scale, then :meth:`ElChe.report_timing`). Per rank, the window's
``ms / batches`` goes into a trust ring of the last five readings; the ring mean is the
*smoothed* ms per batch that drives everything else:

1. **Election** (:meth:`ElChe._elect`). The *slow cohort* is every rank within 15 % of the
   slowest smoothed reading. The first election picks the cohort's **lowest index**; later
   re-elections happen only from phase Stable on, and only swap to a challenger more than
   10 % slower than the incumbent (no churn between two near-identical GPUs).
2. **Allocation** (:meth:`ElChe.recompute_batch_counts`). Speed ratio capped at 64 (a
   sub-ms sample must not turn into a 1e4x schedule); pending callback slack subtracted
   (and consumed once); a 5 % dead zone against 1-batch chatter; an optional
   ``max_batch_diff`` throttle on how far one update may move; and the *window cap*
   (a window never spans more than an epoch), which scales counts down, the rounding
   remainder going one batch each to the counts the floor cut most (largest remainder).
3. **Growth** (:meth:`ElChe.propose_anchor`). The anchor rank's per-window *fixed* cost
   (reduce + first-batch fill) as a fraction of its window wall is the pressure. Above
   ``overhead_target`` (x2 during Warmup) ElChe *stages* a ``Grow`` -- at most x2 per step,
   clamped to ``[min_anchor, max_anchor]`` -- but does not apply it: the convergence guard's
   verdict, applied through :meth:`ElChe.apply_verdict` in the same reduce, commits
   (Stable), vetoes (SuppressGrowth) or discards it and shrinks the anchor (NudgeDown). Any
   non-Stable verdict latches growth off until five consecutive Stables. Proposals never
   shrink; the only shrink is the nudge, which may go below ``min_anchor``.

Phases advance with the number of calibrations: Probe (none) -> Warmup (first) -> Stable
(5) -> Mature (20). They gate election and the growth bar here, and the meta-controller's
factors above.

ElChe is deterministic and pure: no clock, no I/O; the world size may be 1 (that rank is
its own anchor and always runs ``anchor`` batches).
"""

from __future__ import annotations

import math
from collections import deque
from itertools import compress
from dataclasses import dataclass
from enum import IntEnum
from typing import Any, Optional, Sequence

import numpy as np

from ._guards import NudgeDown, Stable, SuppressGrowth, Verdict
from ._window import WindowReport, select_feed

__all__ = [
    "ElChe",
    "Phase",
    "Grow",
    "Calibration",
    "round_half_away",
    "COHORT_BAND",
    "DOMINANCE_MARGIN",
    "TRUST_WINDOW_CAP",
    "MAX_SPEED_RATIO",
    "BATCH_COUNTS_WINDOW_CAP",
    "GROWTH_REARM_STABLE",
    "GROWTH_STEP_CAP",
    "WARMUP_GROWTH_MARGIN",
    "DEAD_ZONE",
    "DEFAULT_OVERHEAD_TARGET",
    "DEFAULT_MAX_ANCHOR",
]

# A rank within 15 % of the slowest is "slow" and may anchor; clearly faster ranks are
# excluded by evidence, not by a hardware oracle.
COHORT_BAND = 0.15
# Swap anchors only to a challenger > 10 % slower: two same-model GPUs must not churn.
DOMINANCE_MARGIN = 0.10
# Trust ring: the last five ms/batch readings; their mean is the smoothed signal. It also
# bounds the death exception: five missed reports in a row clear the ring.
TRUST_WINDOW_CAP = 5
# No real rig exceeds ~10x; a degenerate sub-ms sample must not become a 1e4x schedule.
MAX_SPEED_RATIO = 64.0
# ~10 reduces of batch_counts history for the per-epoch batch-share metric.
BATCH_COUNTS_WINDOW_CAP = 10
# Growth re-arms only after five clean verdicts: settle below the cliff, don't limit-cycle.
GROWTH_REARM_STABLE = 5
# At most x2 per growth step: ride the steep part of the amortisation curve in a few
# windows without overshooting the knee on one noisy reading.
GROWTH_STEP_CAP = 2.0
# During Warmup growth must clear 2x the target, so an early proposal is cap-clamped by
# construction: acting before the trust ring fills only where noise can't flip the sign.
WARMUP_GROWTH_MARGIN = GROWTH_STEP_CAP
# A count only moves when the target differs by more than 5 % (1-batch chatter filter,
# small enough to see the ~7 % spread between two nominally identical cards).
DEAD_ZONE = 0.05
# Fixed per-window overhead target (5 %), clamped to a sane [1 %, 50 %].
DEFAULT_OVERHEAD_TARGET = 0.05
OVERHEAD_TARGET_RANGE = (0.01, 0.50)
# Staleness safety net; the overhead tune normally settles far below it.
DEFAULT_MAX_ANCHOR = 1000
# Phase thresholds (calibration counts).
STABLE_AT = 5
MATURE_AT = 20
# Two smoothed readings closer than this are "the same rank speed" (anchor gets anchor).
_SAME_MS = 1e-6


class Phase(IntEnum):
    """Lifecycle of the balancer; ordered, so ``phase >= Phase.STABLE`` reads naturally."""

    PROBE = 0
    WARMUP = 1
    STABLE = 2
    MATURE = 3

    def __repr__(self) -> str:
        return f"Phase.{self.name}"

    def __str__(self) -> str:
        return self.name.lower()


@dataclass(frozen=True, slots=True)
class Grow:
    """A staged window-pressure proposal: set the anchor to ``anchor`` if the guard agrees."""

    anchor: int


@dataclass(frozen=True, slots=True)
class Calibration:
    """What one ``report_timing`` did: whether it counted as a calibration, and why."""

    calibrated: bool
    reason: str


class TrustRings:
    """Every rank's last ``TRUST_WINDOW_CAP`` ms-per-batch readings, as one array.

    Row ``r`` holds rank ``r``'s readings oldest first, right-aligned behind zeros; its
    mean is the left-to-right sum over the row divided by the count, as upstream
    computes it (Python >= 3.12's ``sum`` compensates float rounding, which could move a
    reading by an ulp across interpreter versions). The leading zeros add nothing
    (0.0 + x is x), so a column-by-column sum gives every rank's mean with the same
    additions a loop over its readings would make -- one pass in C over a contiguous
    array, where a world of 4,096 rings as deques cost 4-6 ms a window in cache misses.
    ``missed[r]``: windows in a row without a usable reading (a full ring of them clears
    the rank's readings)."""

    __slots__ = ("readings", "count", "missed", "_means")  # (no __dict__: the state's ``_plain`` compares it by ``==``)
    _STATE = ("readings", "count", "missed")

    def __init__(self, world_size: int) -> None:
        self.readings = np.zeros((world_size, TRUST_WINDOW_CAP), dtype=np.float64)
        self.count = np.zeros(world_size, dtype=np.int64)
        self.missed = np.zeros(world_size, dtype=np.int64)
        # Every rank's mean as Python floats (None: no reading), kept until the rings
        # change (once a window): a chunk asks for one rank's pace, on the batch path.
        self._means: Optional[list[Optional[float]]] = None

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TrustRings):
            return NotImplemented
        return all(np.array_equal(getattr(self, k), getattr(other, k)) for k in self._STATE)

    __hash__ = None  # type: ignore[assignment]

    def push(self, wall_ms: np.ndarray, batches: np.ndarray) -> None:
        """One window: ``wall_ms / batches`` for each rank with a positive, finite reading."""
        with np.errstate(invalid="ignore"):
            ok = (batches > 0) & (wall_ms > 0.0) & np.isfinite(wall_ms)
        rows = np.flatnonzero(ok)
        if rows.size:
            ring = self.readings
            ring[rows, :-1] = ring[rows, 1:]
            ring[rows, -1] = wall_ms[rows] / batches[rows]
            self.count[rows] = np.minimum(self.count[rows] + 1, TRUST_WINDOW_CAP)
            self.missed[rows] = 0
        self.missed[~ok] += 1
        self.clear(np.flatnonzero(~ok & (self.missed >= TRUST_WINDOW_CAP)))
        self._means = None

    def clear(self, rows: np.ndarray) -> None:
        self.readings[rows] = 0.0
        self.count[rows] = 0
        self._means = None

    def seed(self, means: Sequence[float]) -> None:
        """Each ring holds one reading, its saved mean (none where that is not positive)."""
        values = np.array(means, dtype=np.float64)
        self.clear(np.arange(len(values)))
        rows = np.flatnonzero(values > 0.0)
        self.readings[rows, -1] = values[rows]
        self.count[rows] = 1
        self._means = None

    def means(self) -> np.ndarray:
        """Every rank's mean (0.0 without readings)."""
        ring = self.readings
        total = ring[:, 0].copy()
        for k in range(1, ring.shape[1]):
            total += ring[:, k]
        return np.where(self.count > 0, total / np.maximum(self.count, 1), 0.0)

    def mean(self, rank: int) -> Optional[float]:
        """One rank's mean, None without readings (``means``' value)."""
        cached = self._means
        if cached is None:
            cached = self._means = [m if n else None for m, n in zip(self.means().tolist(), self.count.tolist())]
        return cached[rank]


def round_half_away(x: float) -> int:
    """Rust's ``f64::round`` for x >= 0 (half away from zero), not Python's banker's."""
    fl = math.floor(x)
    return int(fl + 1) if x - fl >= 0.5 else int(fl)


def _round_half_away(x: np.ndarray) -> np.ndarray:
    """``round_half_away`` of every element (as floats)."""
    fl = np.floor(x)
    return np.where(x - fl >= 0.5, fl + 1.0, fl)


class ElChe:
    """Heterogeneity-aware cadence: per-rank batch counts, the anchor, and its growth."""

    def __init__(
        self,
        world_size: int,
        anchor: int,
        *,
        overhead_target: float = DEFAULT_OVERHEAD_TARGET,
        max_anchor: int = DEFAULT_MAX_ANCHOR,
        min_anchor: Optional[int] = None,
        max_batch_diff: Optional[int] = None,
        max_total_batches: int = 0,
        window_growth_applicable: bool = True,
    ) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if anchor < 1:
            raise ValueError(f"anchor must be >= 1, got {anchor}")
        self.world_size = world_size
        self.anchor = anchor
        self.batch_counts = [anchor] * world_size
        self._rings = TrustRings(world_size)
        self._counts_window: deque[tuple[int, ...]] = deque(maxlen=BATCH_COUNTS_WINDOW_CAP)
        self.calibrated = False
        lo, hi = OVERHEAD_TARGET_RANGE
        self.overhead_target = min(max(overhead_target, lo), hi)
        self.min_anchor = anchor
        self.max_anchor = DEFAULT_MAX_ANCHOR
        self.max_total_batches: Optional[int] = None
        self.window_cap_binding = False
        # The ranks that train (the dispatcher's, set with each window); None: all of them.
        # Only theirs count against the window cap: an elastic world's empty slots and the
        # dead keep a count, but take nothing from an epoch.
        self.live: Optional[list[bool]] = None
        self.max_batch_diff = max_batch_diff
        self.phase = Phase.PROBE
        self.anchor_rank: Optional[int] = None
        self.calibration_count = 0
        self.pending_callback_slack_ms = [0.0] * world_size
        self.pending_window_fill_ms = [0.0] * world_size
        self.proposed_anchor: Optional[Grow] = None
        self.growth_enabled = True
        self.consecutive_stable = 0
        # Config, not trajectory: the coordinator sets False for Sync (no window to grow).
        self.window_growth_applicable = window_growth_applicable
        self._set_max_anchor(max_anchor)
        if min_anchor is not None:
            self._set_min_anchor(min_anchor)
        self.set_max_total_batches(max_total_batches)

    # --- configuration ------------------------------------------------------------

    def _set_max_anchor(self, m: int) -> None:
        self.max_anchor = max(1, m)
        if self.min_anchor > self.max_anchor:
            self.min_anchor = self.max_anchor
            self.anchor = min(max(self.anchor, self.min_anchor), self.max_anchor)

    def _set_min_anchor(self, m: int) -> None:
        self.min_anchor = min(max(1, m), self.max_anchor)
        if self.anchor < self.min_anchor:
            self.anchor = self.min_anchor

    def set_max_total_batches(self, max_total: int) -> None:
        """Window cap (the epoch's batch count); 0 removes it."""
        self.max_total_batches = max_total if max_total > 0 else None

    def set_initial_anchor(self, slow_rank: int) -> "ElChe":
        """Soft pin of the cold-start anchor rank (re-election may move it from Stable on)."""
        self._check_rank(slow_rank)
        self.anchor_rank = slow_rank
        return self

    def apply_callback_slack(self, slack_ms: Sequence[float]) -> None:
        """Stage per-rank callback ms for the next recompute (consumed once); a length
        mismatch is ignored (recomputing without slack is the safe fallback)."""
        if len(slack_ms) == self.world_size:
            self.pending_callback_slack_ms = [float(s) for s in slack_ms]

    def set_window_fill_ms(self, fill_ms: Sequence[float]) -> None:
        """Stage the per-rank window fill for the next proposal (consumed once)."""
        if len(fill_ms) == self.world_size:
            self.pending_window_fill_ms = [float(f) for f in fill_ms]

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} out of range for world_size {self.world_size}")

    # --- read side ----------------------------------------------------------------

    def smoothed_ms_per_batch(self, rank: int) -> Optional[float]:
        """Trust-ring mean, or None when the rank has no reading yet."""
        return self._rings.mean(rank)

    def _smoothed(self, rank: int) -> float:
        m = self._rings.mean(rank)
        return 0.0 if m is None else m

    def ms_per_batch(self) -> list[float]:
        """Smoothed ms per rank, 0.0 for a rank without readings."""
        return self._rings.means().tolist()

    def slow_ms(self) -> float:
        return self._smoothed(self.anchor_rank) if self.anchor_rank is not None else 0.0

    def anchor_wall_ms(self) -> float:
        """Intended window wall: ``anchor x slow ms`` once calibrated, else 0."""
        return self.anchor * self.slow_ms() if self.calibrated else 0.0

    def has_speed_hint(self) -> bool:
        counts = self.batch_counts  # (not all equal: counted in C, asked per dispatch)
        return bool(counts) and counts.count(counts[0]) != len(counts)

    def total_batches(self) -> int:
        return sum(self.batch_counts)

    # --- calibration --------------------------------------------------------------

    def report_window(self, report: WindowReport) -> Calibration:
        """The coordinator's one timing entry point: stage the fill, pick the scale
        (:func:`select_feed`), and calibrate unless the whole window was idle."""
        self.set_window_fill_ms(report.fill_ms)
        ms, batches = select_feed(report)
        if not any(m > 0.0 for m in ms):
            return Calibration(False, "idle window: nothing to calibrate on")
        return self.report_timing(ms, batches, report.sync_ms)

    def report_timing(
        self, wall_ms: Sequence[float], batches: Sequence[int], sync_ms: float
    ) -> Calibration:
        """Fold one window's per-rank (ms, batches) in; elect, stage growth, reallocate."""
        if len(wall_ms) != self.world_size or len(batches) != self.world_size:
            raise ValueError("wall_ms and batches must have world_size entries")
        self._push_readings(wall_ms, batches)
        if self.anchor_rank is None or self.phase >= Phase.STABLE:
            elected = self._elect()
            if elected is not None:
                self.anchor_rank = elected
        if self.anchor_rank is None:
            return Calibration(False, "no rank has a positive reading yet")
        slow_ms = self._smoothed(self.anchor_rank)
        if slow_ms <= 0.0:
            # Dead-window escape: a pinned anchor that never reports would freeze the
            # controller in Warmup forever; after a full ring of misses, re-elect.
            missed = self._rings.missed[self.anchor_rank] >= TRUST_WINDOW_CAP
            elected = self._elect() if missed else None
            if elected is not None:
                self.anchor_rank = elected
                slow_ms = self._smoothed(elected)
            if slow_ms <= 0.0:
                return Calibration(False, f"anchor rank {self.anchor_rank} has no reading")
        self.proposed_anchor = None
        # The first report never proposes: one sample is a reading, not a trend.
        if self.phase >= Phase.STABLE or (
            self.phase == Phase.WARMUP and self.calibration_count >= 1
        ):
            self.proposed_anchor = self.propose_anchor(sync_ms)
        self.pending_window_fill_ms = [0.0] * self.world_size
        self.recompute_batch_counts(slow_ms)
        self._counts_window.append(tuple(self.batch_counts))
        self.calibrated = True
        self.calibration_count += 1
        self._advance_phase()
        return Calibration(
            True, f"calibration #{self.calibration_count}, anchor rank {self.anchor_rank}"
        )

    def _push_readings(self, wall_ms: Sequence[float], batches: Sequence[int]) -> None:
        self._rings.push(np.array(wall_ms, dtype=np.float64), np.array(batches, dtype=np.int64))

    def _slow_cohort(self, smoothed: Optional[list[float]] = None) -> list[int]:
        smoothed = self.ms_per_batch() if smoothed is None else smoothed
        max_ms = max([0.0, *smoothed])
        if max_ms <= 0.0:
            return []
        threshold = max_ms * (1.0 - COHORT_BAND)
        return [r for r in range(self.world_size) if smoothed[r] >= threshold]

    def _elect(self) -> Optional[int]:
        """Cohort filter, then sticky-with-margin; lowest index when the incumbent is out."""
        smoothed = self.ms_per_batch()  # read once: every rank's ring is walked per election
        cohort = self._slow_cohort(smoothed)
        if not cohort:
            return None
        if len(cohort) == 1:
            return cohort[0]
        cur = self.anchor_rank
        if cur is not None and cur in cohort:
            cur_ms = smoothed[cur]
            challenger, ch_ms = None, -math.inf
            for r in cohort:  # Rust max_by: the LAST maximal element wins ties
                if r != cur and smoothed[r] >= ch_ms:
                    challenger, ch_ms = r, smoothed[r]
            if challenger is not None and ch_ms > cur_ms * (1.0 + DOMINANCE_MARGIN):
                return challenger
            return cur
        return min(cohort)

    def _advance_phase(self) -> None:
        if self.phase == Phase.PROBE:
            self.phase = Phase.WARMUP
        elif self.phase == Phase.WARMUP and self.calibration_count >= STABLE_AT:
            self.phase = Phase.STABLE
        elif self.phase == Phase.STABLE and self.calibration_count >= MATURE_AT:
            self.phase = Phase.MATURE

    # --- allocation ---------------------------------------------------------------

    def recompute_batch_counts(self, slow_ms: float) -> None:
        """Re-derive every count from the current anchor, then apply the window cap.

        Per rank: the target before slack (the anchor at the slow rank's speed, scaled by
        ``slow_ms / ms`` otherwise), less its callback slack in batches; a move inside the
        dead zone is skipped once calibrated, a calibrated move capped to ``max_batch_diff``.
        Column-wise over the world (numpy): the same IEEE operations per rank as a loop
        would do, so the same counts, at 0.3 ms instead of 4-5 ms for 4,096 ranks."""
        ms = self._rings.means()
        counts = np.array(self.batch_counts, dtype=np.int64)
        slack_ms = np.array(self.pending_callback_slack_ms, dtype=np.float64)
        anchor, m = self.anchor, self.max_batch_diff
        paced = ms > 0.0
        pace = np.where(paced, ms, 1.0)  # (a rank without readings: its ratio is not used)
        ratio = anchor * np.minimum(slow_ms / pace, MAX_SPEED_RATIO)
        base = np.where(paced & ~(np.abs(ms - slow_ms) < _SAME_MS), np.maximum(1.0, _round_half_away(ratio)), anchor)
        slack = np.where((slack_ms > 0.0) & paced, np.ceil(slack_ms / pace), 0.0)
        target = np.maximum(1.0, base - slack)
        move = np.abs(target - counts) > counts * DEAD_ZONE
        if not self.calibrated:
            move[:] = True
        move |= slack > 0.0
        if m is not None and self.calibrated:
            target = np.where(target > counts, np.minimum(counts + m, target),
                              np.maximum(np.maximum(counts - m, target), 1.0))  # fmt: skip
        self.batch_counts = np.where(move, target, counts).astype(np.int64).tolist()
        self._apply_window_cap()
        self.pending_callback_slack_ms = [0.0] * self.world_size

    def _apply_window_cap(self) -> None:
        """Scale the live ranks' counts to fit ``max_total_batches``; the floor of 1 beats
        the cap. (3 ranks in an elastic world of 256 slots: the 253 empty ones' counts made
        the cap bind and cut the windows to [6, 3, 1] from [16, 8, 4], 2.6x the rounds.)"""
        self.window_cap_binding = False
        cap = self.max_total_batches
        live = self.live if self.live is not None and not all(self.live) else None
        counts_of = self.batch_counts if live is None else list(compress(self.batch_counts, live))
        total = sum(counts_of)
        if cap is None or not total > cap > 0:
            return
        self.window_cap_binding = True
        exact = np.array(counts_of, dtype=np.float64) * (cap / total)
        floor = np.floor(exact)
        counts = np.maximum(1.0, floor).astype(np.int64)
        left = cap - int(counts.sum())
        if left > 0:
            # Largest remainder: one batch each to the ranks the floor cut most (ties: the
            # larger count, then the higher rank). Every rank loses under one batch to the
            # floor, so ``left`` < ws; all of it on one rank made that rank's window up to
            # ws batches longer than its pace: 358 instead of 29 at 1,024 ranks, and every
            # round then waited ~33 s for it. (lexsort: ascending by the last key first.)
            order = np.lexsort((np.arange(len(counts)), counts, exact - floor))[::-1]
            counts[order[:left]] += 1
        if live is None:
            self.batch_counts = counts.tolist()
            return
        scaled = iter(counts.tolist())
        self.batch_counts = [next(scaled) if on else c for c, on in zip(self.batch_counts, live)]

    # --- growth, shrink and verdicts ----------------------------------------------

    def explain_proposal(self, sync_ms: float) -> tuple[Optional[Grow], str]:
        """Window-pressure proposal plus the reason; pure (stages nothing)."""
        if not self.window_growth_applicable:
            return None, "growth not applicable (Sync reduces every step)"
        if not self.growth_enabled:
            return None, "growth latched off by the guard"
        if self.window_cap_binding:
            return None, "window cap binding: the epoch is the ceiling"
        if self.anchor_rank is None:
            return None, "no anchor rank"
        marginal = self._smoothed(self.anchor_rank)
        if marginal <= 0.0:
            return None, "anchor rank has no reading"
        fill = max(0.0, self.pending_window_fill_ms[self.anchor_rank])
        fixed = max(0.0, sync_ms) + fill
        denom = self.anchor * marginal + fixed
        if denom <= 0.0 or fixed <= 0.0:
            return None, "no fixed per-window cost"
        overhead = fixed / denom
        margin = 1.0 if self.phase >= Phase.STABLE else WARMUP_GROWTH_MARGIN
        fire_at = self.overhead_target * margin
        if overhead <= fire_at:
            return None, f"overhead {overhead:.3f} <= bar {fire_at:.3f}"
        scale = min(overhead / self.overhead_target, GROWTH_STEP_CAP)
        new = min(max(math.ceil(self.anchor * scale), self.min_anchor), self.max_anchor)
        if new > self.anchor:
            return Grow(new), f"overhead {overhead:.3f} > bar {fire_at:.3f}: grow x{scale:.2f}"
        return None, "already at max_anchor"

    def propose_anchor(self, sync_ms: float) -> Optional[Grow]:
        return self.explain_proposal(sync_ms)[0]

    def _recompute_if_calibrated(self) -> None:
        slow = self.slow_ms()
        if slow > 0.0:
            self.recompute_batch_counts(slow)

    def nudge_anchor_down(self, factor: float) -> None:
        """``anchor = min(anchor, max(1, ceil(anchor * clamp(f, 0.1, 1))))``; bypasses
        ``min_anchor`` (divergence outranks the overhead floor). Non-finite f: ignored."""
        if not math.isfinite(factor):
            return
        new = math.ceil(self.anchor * min(max(factor, 0.1), 1.0))
        self.anchor = min(max(new, 1), self.anchor)
        self._recompute_if_calibrated()

    def relax_anchor_up(self) -> bool:
        """Async opt-in drift +1, refused at ``max_anchor`` or when the projected spread
        would exceed ``max_batch_diff``. Returns whether the anchor moved."""
        if self.anchor >= self.max_anchor:
            return False
        if self.max_batch_diff is not None:
            positive = [m for m in self.ms_per_batch() if m > 0.0]
            if positive:
                new = self.anchor + 1
                projected_fast = max(1, round_half_away(new * max(positive) / min(positive)))
                if projected_fast - new > self.max_batch_diff:
                    return False
        self.anchor += 1
        self._recompute_if_calibrated()
        return True

    def apply_verdict(self, verdict: Verdict) -> None:
        """The one verdict seam: Stable commits (and maybe relaxes up), SuppressGrowth
        vetoes, NudgeDown discards the staged grow *then* shrinks (a grow computed from the
        pre-nudge anchor must not be committed later over the nudge)."""
        if isinstance(verdict, Stable):
            self.consecutive_stable += 1
            if self.consecutive_stable >= GROWTH_REARM_STABLE:
                self.growth_enabled = True
            grow, self.proposed_anchor = self.proposed_anchor, None
            if grow is not None:
                self.anchor = grow.anchor
                self._recompute_if_calibrated()
            if verdict.relax_up:
                self.relax_anchor_up()
        elif isinstance(verdict, (SuppressGrowth, NudgeDown)):
            self.proposed_anchor = None
            self.consecutive_stable = 0
            self.growth_enabled = False
            if isinstance(verdict, NudgeDown):
                self.nudge_anchor_down(verdict.factor)
        else:
            raise TypeError(f"not a verdict: {verdict!r}")

    # --- persistence --------------------------------------------------------------

    def to_state(self, trend_history: Optional[Sequence[float]] = None) -> dict[str, Any]:
        """JSON-safe trajectory snapshot; knobs (targets, caps) are config, not state."""
        return {
            "anchor": self.anchor,
            "anchor_rank": self.anchor_rank,
            "smoothed_ms_per_batch": self.ms_per_batch(),
            "phase": self.phase.name.lower(),
            "calibration_count": self.calibration_count,
            "trend_history": list(trend_history) if trend_history is not None else None,
        }

    def restore_from_state(self, state: dict[str, Any]) -> None:
        """Inverse of :meth:`to_state`: each ring is seeded with the saved mean (lossy by
        design); a world-size mismatch raises instead of silently mis-resuming."""
        smoothed = [float(x) for x in state["smoothed_ms_per_batch"]]
        if len(smoothed) != self.world_size:
            raise ValueError(
                f"ElChe state has world_size {len(smoothed)} != current {self.world_size}"
            )
        self.anchor = int(state["anchor"])
        rank = state.get("anchor_rank")
        self.anchor_rank = None if rank is None else int(rank)
        self.phase = Phase[str(state["phase"]).upper()]
        self.calibration_count = int(state["calibration_count"])
        self._rings.seed(smoothed)
        self.calibrated = any(ms > 0.0 for ms in smoothed)
