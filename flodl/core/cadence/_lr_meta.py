"""LrEventMeta: the LR-aware meta-controller that sits above ElChe.

Theory of operation
-------------------
ElChe's own feedback (window pressure up, guard verdicts down) reacts to what it has
already seen. Two events need a faster hand, and this controller watches for them once per
reduce, right after the guard and *before* the guard's verdict is applied:

* **LR cliff** (precautionary): the learning rate dropped by more than 30 % since the
  previous reduce (a MultiStepLR step). A sharp drop is followed by a divergence spike, so
  shrink the anchor before it shows. Base factor 0.5.
* **Convergence pattern** (corrective): the last ``K`` guard verdicts were all NudgeDown or
  SuppressGrowth. ``K`` and the base factor depend on ElChe's phase -- cautious early
  (K 5, cut to 0.3), gentler once trusted (Stable K 3 / 0.5, Mature K 2 / 0.7).

Both feed one actuator, ``NudgeDown(factor)``, with the factor bent by the *anchor trend*
``(current - mean) / mean`` over the recent anchors: ``eff(b, t) = clamp(b - (1-b)*t, 0.1,
0.95)``. A falling anchor (already being corrected) dampens the cut; a climbing one
(overhead tune pushing up) sharpens it. When both watchers fire, the factors multiply
(clamped again). Phase Probe never acts: nothing is calibrated, every signal is noise.

The coordinator applies a returned NudgeDown through ``ElChe.apply_verdict`` (which also
discards any growth staged this window), then applies the guard's own verdict on top.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Union

from ._elche import Phase
from ._guards import NudgeDown, SuppressGrowth, Verdict

__all__ = [
    "LrEventMeta",
    "LrEventMetaConfig",
    "Noop",
    "MetaAction",
    "effective_factor",
    "anchor_trend",
    "base_factor_for",
    "sustain_k_for",
    "LR_CLIFF_BASE_FACTOR",
]

# Halve on an LR cliff: the long-standing "hard signal" nudge of the divergence path.
LR_CLIFF_BASE_FACTOR = 0.5
# |anchor_trend| under 10 % counts as settled (diagnostic only; ignores dead-zone chatter).
SETTLED_EPSILON = 0.10

# Per-phase convergence watcher: (sustain K, base factor). More evidence and a harder cut
# while trust is low; quicker but gentler once the balancer has matured.
_PHASE_RULES = {
    Phase.PROBE: (5, 0.3),
    Phase.WARMUP: (5, 0.3),
    Phase.STABLE: (3, 0.5),
    Phase.MATURE: (2, 0.7),
}


@dataclass(frozen=True, slots=True)
class LrEventMetaConfig:
    """Defaults: LR window 3, anchor window 5, verdict window 5 (raised to the longest
    sustain K, else that phase's watcher could never fire), cliff at a 30 % drop (catches
    MultiStepLR's 5x/10x steps; cosine annealing's per-reduce delta stays far below),
    effective factor clamped to [0.1, 0.95]."""

    lr_window_cap: int = 3
    anchor_window_cap: int = 5
    guard_window_cap: int = 5
    sharp_drop_threshold: float = 0.3
    effective_factor_min: float = 0.1
    effective_factor_max: float = 0.95


@dataclass(frozen=True, slots=True)
class Noop:
    """The meta-controller saw nothing to act on."""

    reason: str = field(default="", compare=False)


MetaAction = Union[Noop, NudgeDown]


def base_factor_for(phase: Phase) -> float:
    return _PHASE_RULES[Phase(phase)][1]


def sustain_k_for(phase: Phase) -> int:
    return _PHASE_RULES[Phase(phase)][0]


def effective_factor(base: float, trend: float, lo: float = 0.1, hi: float = 0.95) -> float:
    """``clamp(base - (1 - base) * trend, lo, hi)``: falling trend dampens, rising sharpens."""
    return min(max(base - (1.0 - base) * trend, lo), hi)


def anchor_trend(anchors: "deque[int] | list[int] | tuple[int, ...]") -> float:
    """``(current - mean) / mean``; 0 with fewer than two samples or a non-positive mean."""
    if len(anchors) < 2:
        return 0.0
    mean = sum(float(a) for a in anchors) / len(anchors)
    if mean <= 0.0:
        return 0.0
    return (float(anchors[-1]) - mean) / mean


class LrEventMeta:
    """Two watchers, one actuator. Call :meth:`observe` once per reduce."""

    def __init__(self, config: LrEventMetaConfig = LrEventMetaConfig()) -> None:
        min_cap = max(k for k, _ in _PHASE_RULES.values())
        if config.guard_window_cap < min_cap:
            config = LrEventMetaConfig(**{**_asdict(config), "guard_window_cap": min_cap})
        self.config = config
        self.lr_window: deque[float] = deque(maxlen=max(config.lr_window_cap, 1))
        self.anchor_window: deque[int] = deque(maxlen=max(config.anchor_window_cap, 1))
        self.guard_window: deque[Verdict] = deque(maxlen=config.guard_window_cap)

    def anchor_trend(self) -> float:
        return anchor_trend(self.anchor_window)

    def is_settled(self) -> bool:
        return abs(self.anchor_trend()) < SETTLED_EPSILON

    def _eff(self, base: float, trend: float) -> float:
        c = self.config
        return effective_factor(base, trend, c.effective_factor_min, c.effective_factor_max)

    def _push(self, lr: float, anchor: int, verdict: Verdict) -> None:
        # A zero-capacity window records nothing (Rust push_capped with cap 0).
        if self.config.lr_window_cap > 0:
            self.lr_window.append(float(lr))
        if self.config.anchor_window_cap > 0:
            self.anchor_window.append(int(anchor))
        self.guard_window.append(verdict)

    def sharp_drop_detected(self) -> bool:
        if len(self.lr_window) < 2:
            return False
        prev, now = self.lr_window[-2], self.lr_window[-1]
        if prev <= 0.0 or now >= prev:
            return False
        return (prev - now) / prev > self.config.sharp_drop_threshold

    def convergence_pattern_fires(self, phase: Phase) -> bool:
        k = sustain_k_for(phase)
        if k == 0 or len(self.guard_window) < k:
            return False
        recent = list(self.guard_window)[-k:]
        return all(isinstance(v, (NudgeDown, SuppressGrowth)) for v in recent)

    def observe(self, lr: float, anchor: int, verdict: Verdict, phase: Phase) -> MetaAction:
        """Record one reduce (LR in use, ElChe's anchor after calibration, the guard's
        verdict, ElChe's phase) and return Noop or NudgeDown(factor)."""
        self._push(lr, anchor, verdict)
        if phase < Phase.WARMUP:
            return Noop(reason="phase Probe: nothing calibrated yet")
        trend = self.anchor_trend()
        cliff = self._eff(LR_CLIFF_BASE_FACTOR, trend) if self.sharp_drop_detected() else None
        pattern = None
        if self.convergence_pattern_fires(phase):
            pattern = self._eff(base_factor_for(phase), trend)
        if cliff is None and pattern is None:
            return Noop(reason="no LR cliff, no sustained divergence")
        if cliff is not None and pattern is not None:
            c = self.config
            combined = min(max(cliff * pattern, c.effective_factor_min), c.effective_factor_max)
            why = f"LR cliff and divergence pattern (trend {trend:+.3f})"
            return NudgeDown(combined, reason=why)
        if cliff is not None:
            return NudgeDown(cliff, reason=f"LR cliff (trend {trend:+.3f})")
        k = sustain_k_for(phase)
        return NudgeDown(pattern, reason=f"{k} sustained non-Stable verdicts (trend {trend:+.3f})")


def _asdict(config: LrEventMetaConfig) -> dict:
    return {f: getattr(config, f) for f in LrEventMetaConfig.__dataclass_fields__}
