"""Reduce step budget and the Async overshoot budget.

Theory of operation
-------------------
The coordinator is the single scheduler of "one logical GPU split into heterogeneous
per-rank step counts": it never hands a rank a step that crosses a reduce barrier. The
per-rank budget between two reduces is :func:`reduce_step_budget`:

* Sync / Cadence (barrier-paced): exactly ``counts[r]`` -- the schedule is the barrier.
* Async: ``counts[r] + max_overshoot`` -- the one mode allowed to run past its planned
  point, by a bounded look-ahead.
* A rank whose count is 0 has budget 0, which means "no software barrier" (a 0-share edge
  rank is sized and dispatched normally).

The budget applies to both backends: the reduce is coordinator-triggered, so a collective
does not pace the fast rank by itself.

``max_overshoot`` itself follows the **older rule** (the newest upstream derivation from
the measured reduce was not available; see the spec §5.6/§13), kept behind
:class:`OvershootBudget` so a derived rule can replace it without touching callers:
on each Async reduce with ``auto`` on, a Stable verdict widens the look-ahead by one (up to
the ceiling), a NudgeDown resets it to the initial value, SuppressGrowth holds it; the
result is always clamped to the ceiling.
"""

from __future__ import annotations

from dataclasses import dataclass

from ._guards import NudgeDown, Stable, Verdict

__all__ = [
    "reduce_step_budget",
    "barrier_paced",
    "OvershootBudget",
    "BudgetChange",
    "OVERSHOOT_INITIAL",
    "OVERSHOOT_CEILING",
]

# Three batches of look-ahead to start: enough to hide one control round trip at the
# window edge without letting a fast rank run a whole window ahead.
OVERSHOOT_INITIAL = 3
# Fifteen at most: beyond this the fast rank's un-averaged steps dominate staleness.
OVERSHOOT_CEILING = 15

_POLICIES = ("sync", "cadence", "async")


def barrier_paced(policy: str) -> bool:
    """Sync and Cadence hold ranks at the reduce (and epoch) barrier; Async may cross."""
    if policy not in _POLICIES:
        raise ValueError(f"unknown policy {policy!r}")
    return policy != "async"


def reduce_step_budget(count: int, policy: str, max_overshoot: int = 0) -> int:
    """Steps rank r may take before the next reduce (0 = no barrier for a 0-share rank)."""
    if count <= 0:
        return 0
    if not barrier_paced(policy):
        return count + max(0, max_overshoot)
    return count


@dataclass(frozen=True, slots=True)
class BudgetChange:
    """One verdict's effect on the look-ahead, with the reason for the log."""

    before: int
    after: int
    reason: str


class OvershootBudget:
    """The Async look-ahead ``max_overshoot`` (older upstream rule, see module doc)."""

    def __init__(
        self,
        initial: int = OVERSHOOT_INITIAL,
        ceiling: int = OVERSHOOT_CEILING,
        auto: bool = True,
    ) -> None:
        if initial < 0 or ceiling < 0:
            raise ValueError("overshoot initial and ceiling must be >= 0")
        self.initial = initial
        self.ceiling = ceiling
        self.auto = auto
        self.max_overshoot = min(initial, ceiling)

    def on_verdict(self, verdict: Verdict, policy: str) -> BudgetChange:
        """Fold one guard verdict in (after it was applied to ElChe)."""
        return self.fold(verdict, overshoot=not barrier_paced(policy))

    def fold(self, verdict: Verdict, *, overshoot: bool) -> BudgetChange:
        """``on_verdict`` with the policy's ``overshoot`` switch (``_policy``)."""
        before = self.max_overshoot
        reason = "held"
        if overshoot and self.auto:
            if isinstance(verdict, Stable):
                self.max_overshoot = min(self.max_overshoot + 1, self.ceiling)
                reason = "Stable: widen look-ahead"
            elif isinstance(verdict, NudgeDown):
                self.max_overshoot = self.initial
                reason = "NudgeDown: reset look-ahead"
            else:
                reason = "SuppressGrowth: hold look-ahead"
        elif not overshoot:
            reason = "not Async: no look-ahead"
        else:
            reason = "auto off: fixed look-ahead"
        self.max_overshoot = min(self.max_overshoot, self.ceiling)
        return BudgetChange(before, self.max_overshoot, reason)

    def budget(self, count: int, policy: str) -> int:
        """:func:`reduce_step_budget` with this look-ahead."""
        return reduce_step_budget(count, policy, self.max_overshoot)

    def budget_for(self, count: int, *, overshoot: bool) -> int:
        """``budget`` with the policy's ``overshoot`` switch (``_policy``)."""
        if count <= 0:
            return 0
        return count + self.look_ahead(overshoot)

    def look_ahead(self, overshoot: bool) -> int:
        """What ``budget_for`` adds to a positive count (sizing a whole window reads it once)."""
        return max(0, self.max_overshoot) if overshoot else 0
