"""Convergence guards: read the replicas' divergence after each reduce, return a verdict.

Theory of operation
-------------------
After every averaging cycle the coordinator builds a :class:`DivergenceReport` (each rank's
relative drift ``||pre - post|| / ||post||`` from the consensus) and asks its guard for a
verdict on the cadence. The verdict is one of three small immutable values:

* :class:`Stable` -- no concern; ElChe may commit the growth it staged this window
  (``relax_up`` is set by the *coordinator*, never by a guard: it is the Async opt-in to
  drift the anchor up by one).
* :class:`SuppressGrowth` -- divergence is trending up; hold the anchor, veto growth and latch
  growth off until five consecutive Stables.
* :class:`NudgeDown` -- divergence compounds; shrink the anchor by ``factor``.

Every verdict carries a ``reason`` (excluded from equality) so the shell can log *why*
without a second channel: ``guard.report(...) == SuppressGrowth()`` still holds.

Three guards ship, picked by :func:`make_guard`:

* :class:`NoGuard` -- always Stable; the control experiment.
* :class:`LevelGuard` (old name ``TrendGuard``, the production default) -- watches the
  divergence *level*: three strict rises in a row ending above ``threshold`` suppress growth.
  It never nudges: a level that is high but flat wants holding, not cutting.
* :class:`GrowthGuard` (old name ``MsfGuard``) -- watches the divergence *growth rate*
  ``lambda = ln(D_t / D_{t-1}) / k_max`` through a bias-corrected EMA
  (:class:`LambdaEstimator`); a sustained positive rate suppresses, a steeper one nudges.

Guards are deterministic: same reports in, same verdicts out. Nothing here reads a clock.
"""

from __future__ import annotations

import math
from collections import deque
from itertools import filterfalse
from dataclasses import dataclass, field
from typing import Iterable, Optional, Protocol, Sequence, Union

__all__ = [
    "Stable",
    "SuppressGrowth",
    "NudgeDown",
    "Verdict",
    "DivergenceReport",
    "LambdaSample",
    "LambdaEstimator",
    "Guard",
    "NoGuard",
    "LevelGuard",
    "TrendGuard",
    "GrowthGuard",
    "MsfGuard",
    "make_guard",
    "LEVEL_THRESHOLD",
    "LEVEL_RING",
]

# LevelGuard: drift above 1 % of the parameter norm is where replicas stop agreeing in
# practice (~2x the steady-state divergence of the rigs this was tuned on).
LEVEL_THRESHOLD = 0.01
# Five reduces of history: enough for the three-rise rule plus two of context, small enough
# that an old spike falls out within a handful of windows. Also what is persisted on save.
LEVEL_RING = 5
# Three strict rises in a row: one rise is noise, two can be a wobble.
LEVEL_RISES = 3

# LambdaEstimator: alpha 0.9 averages roughly the last ten reduces; the noise floor keeps
# ln(d/prev) from exploding on drift values that are numerically zero.
LAMBDA_ALPHA = 0.9
LAMBDA_NOISE_FLOOR = 1e-8
# GrowthGuard: a per-step growth rate of 1e-3 doubles divergence in ~700 steps (hold
# growth); 1e-2 doubles it in ~70 steps (cut the anchor). Three events of sustain each.
GROWTH_SUPPRESS_THRESHOLD = 1e-3
GROWTH_NUDGE_THRESHOLD = 1e-2
GROWTH_SUSTAIN = 3
GROWTH_NUDGE_FACTOR = 0.5


# --------------------------------------------------------------------------------------
# Verdicts
# --------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Stable:
    """Convergence is clean: commit staged growth; ``relax_up`` also drifts anchor +1."""

    relax_up: bool = False
    reason: str = field(default="", compare=False)


@dataclass(frozen=True, slots=True)
class SuppressGrowth:
    """Divergence trending up: veto staged growth and latch growth off."""

    reason: str = field(default="", compare=False)


@dataclass(frozen=True, slots=True)
class NudgeDown:
    """Shrink the anchor multiplicatively by ``factor`` (0.5 halves it)."""

    factor: float
    reason: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.factor, (int, float)) or isinstance(self.factor, bool):
            raise TypeError(f"NudgeDown.factor must be a number, got {self.factor!r}")


Verdict = Union[Stable, SuppressGrowth, NudgeDown]


# --------------------------------------------------------------------------------------
# Evidence
# --------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class DivergenceReport:
    """One reduce's divergence evidence: ``deltas``, those of the ranks that reported (a
    rank without a report counts 0.0, which ``max_relative_delta``'s floor gives)."""

    deltas: tuple[float, ...]
    pre_norms: Optional[tuple[float, ...]] = None
    post_norm: Optional[float] = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "deltas", tuple(map(float, self.deltas)))
        if self.pre_norms is not None:
            object.__setattr__(self, "pre_norms", tuple(float(p) for p in self.pre_norms))

    def max_relative_delta(self) -> float:
        """``d_raw``: worst-case replica drift, ``max(0, max deltas)``; NaN ignored."""
        return max(0.0, max(filterfalse(math.isnan, self.deltas), default=0.0))  # (C-level: N deltas)


class Guard(Protocol):
    """What the coordinator needs from a guard."""

    def report(self, report: DivergenceReport, k_used: int, k_max: int) -> Verdict: ...

    def telemetry(self) -> dict[str, float]: ...

    def trend_history(self) -> Optional[list[float]]: ...

    def reset(self) -> None: ...


# --------------------------------------------------------------------------------------
# NoGuard
# --------------------------------------------------------------------------------------


class NoGuard:
    """Always Stable, no telemetry, no history: the unconditioned baseline."""

    name = "none"

    def report(self, report: DivergenceReport, k_used: int, k_max: int) -> Verdict:
        return Stable(reason="no guard")

    def telemetry(self) -> dict[str, float]:
        return {}

    def trend_history(self) -> Optional[list[float]]:
        return None

    def reset(self) -> None:
        pass


# --------------------------------------------------------------------------------------
# LevelGuard
# --------------------------------------------------------------------------------------


class LevelGuard:
    """Three strict rises of ``d_raw`` ending above ``threshold`` -> SuppressGrowth."""

    name = "level"

    def __init__(self, threshold: float = LEVEL_THRESHOLD) -> None:
        self.threshold = float(threshold)
        self._history: deque[float] = deque(maxlen=LEVEL_RING)

    def with_history(self, history: Iterable[float]) -> "LevelGuard":
        """Restore a saved ring (the last ``LEVEL_RING`` values win). Returns self."""
        self._history = deque((float(x) for x in history), maxlen=LEVEL_RING)
        return self

    @property
    def history(self) -> tuple[float, ...]:
        return tuple(self._history)

    def report(self, report: DivergenceReport, k_used: int, k_max: int) -> Verdict:
        self._history.append(report.max_relative_delta())
        h = self._history
        if len(h) < LEVEL_RISES:
            return Stable(reason=f"warming up ({len(h)}/{LEVEL_RISES} reports)")
        rising = h[-1] > h[-2] > h[-3]
        if rising and h[-1] > self.threshold:
            return SuppressGrowth(
                reason=f"divergence rose 3x to {h[-1]:.4g} > threshold {self.threshold:.4g}"
            )
        return Stable(reason="no sustained rise above threshold")

    def telemetry(self) -> dict[str, float]:
        return {"d_history_last": self._history[-1]} if self._history else {}

    def trend_history(self) -> Optional[list[float]]:
        return list(self._history) if self._history else None

    def reset(self) -> None:
        self._history.clear()


TrendGuard = LevelGuard  # the older name; same math


# --------------------------------------------------------------------------------------
# GrowthGuard
# --------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class LambdaSample:
    """One estimator step: the raw drift, its growth rate and the smoothed rate."""

    d_raw: float
    lambda_raw: Optional[float]
    lambda_ema: Optional[float]
    k_used: int
    k_max: int


class LambdaEstimator:
    """Bias-corrected EMA of ``ln(d / prev) / k_max`` (Adam-style ``ema / (1 - alpha^t)``).

    A sample at or below the noise floor breaks the chain (the next sample yields no rate)
    but does not reset the EMA: lambda continuity matters across a quiet reduce.
    """

    def __init__(self, alpha: float = LAMBDA_ALPHA, noise_floor: float = LAMBDA_NOISE_FLOOR):
        if not math.isfinite(alpha):
            alpha = LAMBDA_ALPHA
        self.alpha = min(1.0, max(2.220446049250313e-16, float(alpha)))
        self.noise_floor = float(noise_floor)
        self.reset()

    def reset(self) -> None:
        self.prev_d: Optional[float] = None
        self.ema_raw = 0.0
        self.ema_t = 0

    def observe(self, d_raw: float, k_used: int, k_max: int) -> LambdaSample:
        floor = self.noise_floor
        lam = None
        if self.prev_d is not None and self.prev_d > floor and d_raw > floor and k_max > 0:
            lam = math.log(d_raw / self.prev_d) / k_max
            self.ema_raw = self.alpha * self.ema_raw + (1.0 - self.alpha) * lam
            self.ema_t += 1
        self.prev_d = d_raw if d_raw > floor else None
        ema = None
        if self.ema_t > 0:
            denom = 1.0 - self.alpha**self.ema_t
            ema = self.ema_raw / denom if denom > 0.0 else self.ema_raw
        return LambdaSample(d_raw, lam, ema, k_used, k_max)


class GrowthGuard:
    """Sustained ``lambda_ema`` above a soft bar suppresses; above a hard bar it nudges.

    The two streaks are independent; the hard (nudge) trigger wins when both fire on the
    same report, and each fire resets only its own streak, so the guard de-escalates from
    nudging to suppressing as the rate decays. ``nudge_threshold = inf`` disables nudging.
    """

    name = "growth"

    def __init__(
        self,
        *,
        alpha: float = LAMBDA_ALPHA,
        suppress_threshold: float = GROWTH_SUPPRESS_THRESHOLD,
        suppress_sustain: int = GROWTH_SUSTAIN,
        nudge_threshold: float = GROWTH_NUDGE_THRESHOLD,
        nudge_sustain: int = GROWTH_SUSTAIN,
        nudge_factor: float = GROWTH_NUDGE_FACTOR,
    ) -> None:
        self.estimator = LambdaEstimator(alpha)
        self.suppress_threshold = suppress_threshold
        self.suppress_sustain = suppress_sustain
        self.nudge_threshold = nudge_threshold
        self.nudge_sustain = nudge_sustain
        self.nudge_factor = nudge_factor
        self.suppress_streak = 0
        self.nudge_streak = 0
        self.last_sample: Optional[LambdaSample] = None

    def report(self, report: DivergenceReport, k_used: int, k_max: int) -> Verdict:
        sample = self.estimator.observe(report.max_relative_delta(), k_used, k_max)
        self.last_sample = sample
        lema = sample.lambda_ema if sample.lambda_ema is not None else -math.inf
        self.suppress_streak = self.suppress_streak + 1 if lema > self.suppress_threshold else 0
        self.nudge_streak = self.nudge_streak + 1 if lema > self.nudge_threshold else 0
        if self.nudge_streak >= self.nudge_sustain and math.isfinite(self.nudge_threshold):
            self.nudge_streak = 0
            return NudgeDown(
                self.nudge_factor,
                reason=f"lambda_ema {lema:.3g} > {self.nudge_threshold:.3g} sustained",
            )
        if self.suppress_streak >= self.suppress_sustain:
            self.suppress_streak = 0
            return SuppressGrowth(
                reason=f"lambda_ema {lema:.3g} > {self.suppress_threshold:.3g} sustained"
            )
        return Stable(reason="divergence growth rate below thresholds")

    def telemetry(self) -> dict[str, float]:
        s = self.last_sample
        out: dict[str, float] = {}
        if s is not None and s.lambda_raw is not None:
            out["lambda_raw"] = s.lambda_raw
        if s is not None and s.lambda_ema is not None:
            out["lambda_ema"] = s.lambda_ema
        return out

    def trend_history(self) -> Optional[list[float]]:
        return None  # the EMA and streaks re-warm from scratch on resume

    def reset(self) -> None:
        self.estimator.reset()
        self.suppress_streak = 0
        self.nudge_streak = 0
        self.last_sample = None


MsfGuard = GrowthGuard  # the older name; same math

_GUARD_NAMES = {
    "none": NoGuard,
    "no": NoGuard,
    "level": LevelGuard,
    "trend": LevelGuard,
    "growth": GrowthGuard,
    "msf": GrowthGuard,
}


def make_guard(name: str, *, history: Sequence[float] = ()) -> Guard:
    """Build a guard by name: none/level/growth (old names trend/msf; a "Guard" suffix
    and case are ignored). ``history`` restores a LevelGuard ring; others ignore it."""
    key = name.strip().lower()
    if key.endswith("guard") and key != "guard":
        key = key[: -len("guard")]
    cls = _GUARD_NAMES.get(key)
    if cls is None:
        raise ValueError(f"unknown guard {name!r}; expected one of {sorted(_GUARD_NAMES)}")
    guard = cls()
    if isinstance(guard, LevelGuard) and history:
        guard.with_history(history)
    return guard
