"""Window ledger: what each rank did since the last reduce, and the timing feed for ElChe.

Theory of operation
-------------------
Between two reduces every ``Batch`` frame is folded into one :class:`WindowLedger`
(``record_batch``). Two timing scales are kept side by side:

* **compute** ``(wall_ms, steps)`` -- the sum of ``batch_ms`` over every batch of the window.
  Always coherent across ranks (the same thing measured the same way everywhere).
* **delivered** ``(delivered_ms, delivered_batches)`` -- ``batch_ms + data_ms`` over batches
  ``2..n`` only (the *marginal* rate). The window's first batch carries a fixed per-window
  cost -- control transit, plan pickup, prefetch spin-up -- so it goes to ``first_batch_ms``
  instead, and its excess over the marginal rate is the window's *fill*
  (:meth:`WindowLedger.fill_excess_ms`): the amortisable cost ElChe's growth rule reads.
* **plan wait** ``wait_ms`` -- the time the rank sat idle with no plan (``BatchDone.wait_ms``,
  measured by the rank: its chunk ran out, it waited at the reduce barrier for the trigger
  and for its next window to arrive). Under overlapped rounds that turnaround is the
  window's real fixed cost -- the coordinator's latency, the transport's, the slower
  ranks' -- and nothing else sees it: the round's *exposed* part is measured by the
  coordinator after the fact, and a window's first batch, once the round overlaps it, is
  not where the ledger's window starts. So the fill ElChe reads is the first-batch excess
  *plus* the plan wait (:meth:`WindowLedger.fixed_ms`): a coordinator slow to turn a
  round around grows the windows until its turnaround costs ``overhead_target``. The
  wait is summed between two resets: each round is charged the wait that ended since
  the last one (the trigger's turnaround, one round late in steady state).

At the reduce the coordinator turns the ledger into a :class:`WindowReport`
(:meth:`WindowLedger.window_report`), and ElChe picks the scale with :func:`select_feed`:
the delivered scale only when it is *coherent* -- the mode supports it
(:func:`delivered_capable`) **and** every alive rank that moved has a delivered sample
(:meth:`WindowLedger.movers_delivered_complete`). A partial delivered set would compare a
data-inclusive cost against a compute-only one and invert the allocation (the "mixed-scale
inversion"), so an incoherent window feeds *every* rank on the compute scale. Sync is never
delivered-capable: it reduces every step, so every window is a one-batch window whose only
batch is the fill.

Resets are split on purpose: ``reset_timing`` (timing and loss accumulators) runs in the
shared finish tail; ``reset_steps`` placement is backend-specific (NCCL after
the ``Update``, CPU before the next chunk is folded, because chunk sizing reads steps).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import repeat
from typing import Iterable, Optional, Sequence

_INF = float("inf")

__all__ = [
    "WindowLedger",
    "WindowReport",
    "select_feed",
    "delivered_capable",
    "CPU_BACKENDS",
    "COLLECTIVE_BACKENDS",
]

# The bus (ZeroMQ reduce through the coordinator) is the spec's "CPU" backend; the
# collective plane (torch.distributed, NCCL/gloo) is its "NCCL" backend.
CPU_BACKENDS = frozenset({"cpu", "bus"})
COLLECTIVE_BACKENDS = frozenset({"nccl", "collective"})


def delivered_capable(policy: str, backend: str) -> bool:
    """Whether this (policy, backend) may feed ElChe the delivered scale at all.

    CPU/bus: Cadence and Async (progressive chunks, multi-batch windows). Collective: only
    Cadence (Async windows there are not paced by the coordinator). Sync: never.
    """
    b = backend.lower()
    if b in CPU_BACKENDS:
        return policy in ("cadence", "async")
    if b in COLLECTIVE_BACKENDS:
        return policy == "cadence"
    raise ValueError(f"unknown backend {backend!r}")


@dataclass(frozen=True, slots=True)
class WindowReport:
    """One reduce window's observations on both timing scales (a message, not a view)."""

    wall_ms: tuple[float, ...]
    steps: tuple[int, ...]
    delivered_ms: tuple[float, ...]
    delivered_batches: tuple[int, ...]
    fill_ms: tuple[float, ...]
    delivered_coherent: bool
    sync_ms: float = 0.0

    def __post_init__(self) -> None:
        n = len(self.wall_ms)
        for name in ("steps", "delivered_ms", "delivered_batches", "fill_ms"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"WindowReport.{name} has {len(getattr(self, name))} != {n}")
        for name in ("wall_ms", "steps", "delivered_ms", "delivered_batches", "fill_ms"):
            object.__setattr__(self, name, tuple(getattr(self, name)))

    def select_feed(self) -> tuple[list[float], list[int]]:
        return select_feed(self)


def select_feed(report: WindowReport) -> tuple[list[float], list[int]]:
    """The ``(ms, batches)`` pair ElChe schedules on (the mixed-scale inversion guard).

    Incoherent -> compute scale for every rank. Coherent -> each rank with a delivered sample
    feeds its marginal delivered pair; a rank without one (a non-mover, by the caller's
    attestation) falls back to its compute pair, which is ``(0, 0)`` or near it.
    """
    if not report.delivered_coherent:
        return list(report.wall_ms), list(report.steps)
    # (Two comprehensions over zips, not an indexed loop: a world of thousands, each rank
    # a handful of tuple lookups.)
    delivered = [db > 0 and dm > 0.0 for db, dm in zip(report.delivered_batches, report.delivered_ms)]
    ms = [dm if d else w for d, dm, w in zip(delivered, report.delivered_ms, report.wall_ms)]
    batches = [db if d else n for d, db, n in zip(delivered, report.delivered_batches, report.steps)]
    return ms, batches


class WindowLedger:
    """Per-rank accumulators for the current reduce window. Out-of-range ranks are ignored
    by the write path (a malformed frame must not crash the core)."""

    def __init__(self, world_size: int) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self.steps = [0] * world_size
        self.wall_ms = [0.0] * world_size
        self.delivered_ms = [0.0] * world_size
        self.delivered_batches = [0] * world_size
        self.first_batch_ms = [0.0] * world_size
        self.wait_ms = [0.0] * world_size
        self.loss_sum = [0.0] * world_size
        self.loss_count = [0] * world_size

    @classmethod
    def from_values(
        cls,
        *,
        steps: Sequence[int],
        wall_ms: Sequence[float],
        delivered_ms: Optional[Sequence[float]] = None,
        delivered_batches: Optional[Sequence[int]] = None,
        first_batch_ms: Optional[Sequence[float]] = None,
    ) -> "WindowLedger":
        """A ledger seeded with raw accumulator values (tests, journal restore). Lets a
        caller build step/delivered combinations that ``record_batch`` (which couples
        them) cannot produce."""
        n = len(steps)
        ledger = cls(n)
        ledger.steps = [int(s) for s in steps]
        ledger.wall_ms = [float(w) for w in wall_ms]
        if delivered_ms is not None:
            ledger.delivered_ms = [float(d) for d in delivered_ms]
        if delivered_batches is not None:
            ledger.delivered_batches = [int(b) for b in delivered_batches]
        if first_batch_ms is not None:
            ledger.first_batch_ms = [float(f) for f in first_batch_ms]
        for name in ("wall_ms", "delivered_ms", "delivered_batches", "first_batch_ms"):
            if len(getattr(ledger, name)) != n:
                raise ValueError(f"{name} must have {n} entries")
        return ledger

    # --- write path ---------------------------------------------------------------

    def record_batch(self, rank: int, batch_ms: float, data_ms: float, wait_ms: float = 0.0,
                     loss: Optional[float] = None) -> None:
        """One batch done: bump steps and compute wall; route ``batch_ms + data_ms`` to the
        fill slot (first batch of the window) or the marginal accumulators (2..n); add the
        plan wait before it (a non-finite or negative one, from a hostile frame, counts 0);
        ``loss`` into the monitoring feed unless non-finite (a diverged batch). One call
        a batch, not two: this is the hot path (every batch a rank trains)."""
        if not 0 <= rank < self.world_size:
            return
        if wait_ms > 0.0 and wait_ms < _INF:  # (a NaN compares false)
            self.wait_ms[rank] += wait_ms
        steps = self.steps[rank] = self.steps[rank] + 1
        self.wall_ms[rank] += batch_ms
        if steps > 1:
            self.delivered_ms[rank] += batch_ms + data_ms
            self.delivered_batches[rank] += 1
        else:
            self.first_batch_ms[rank] = batch_ms + data_ms
        if loss is not None and -_INF < loss < _INF:
            self.loss_sum[rank] += loss
            self.loss_count[rank] += 1

    def reset_timing(self) -> None:
        """Zero wall, delivered, first-batch and loss accumulators. Steps are kept."""
        n = self.world_size
        self.wall_ms = [0.0] * n
        self.delivered_ms = [0.0] * n
        self.delivered_batches = [0] * n
        self.first_batch_ms = [0.0] * n
        self.wait_ms = [0.0] * n
        self.loss_sum = [0.0] * n
        self.loss_count = [0] * n

    def reset_steps(self) -> None:
        self.steps = [0] * self.world_size

    # --- derivations --------------------------------------------------------------

    def has_delivered_sample(self, rank: int) -> bool:
        """False for a one-batch window: its only batch went to the fill slot."""
        return self.delivered_batches[rank] > 0 and self.delivered_ms[rank] > 0.0

    def fill_excess_ms(self, rank: int) -> float:
        """First-batch cost above the marginal rate (0 without a marginal sample)."""
        if not self.has_delivered_sample(rank):
            return 0.0
        marginal = self.delivered_ms[rank] / self.delivered_batches[rank]
        return max(0.0, self.first_batch_ms[rank] - marginal)

    def fixed_ms(self, rank: int) -> float:
        """The window's fixed cost on this rank: the first-batch excess plus the plan wait."""
        return self.fill_excess_ms(rank) + self.wait_ms[rank]

    def movers_delivered_complete(self, alive: Optional[Sequence[bool]] = None) -> bool:
        """Every alive rank that moved this window has a delivered sample."""
        flags: Iterable[bool] = repeat(True) if alive is None else alive
        for a, steps, db, dm in zip(flags, self.steps, self.delivered_batches, self.delivered_ms):
            if a and steps > 0 and not (db > 0 and dm > 0.0):  # has_delivered_sample, inline
                return False
        return True

    def fixed_ms_each(self) -> list[float]:
        """``fixed_ms`` of every rank, in one pass (``fill_excess_ms`` + the wait, inline)."""
        out = []
        for first, dm, db, wait in zip(self.first_batch_ms, self.delivered_ms, self.delivered_batches, self.wait_ms):
            excess = first - dm / db if db > 0 and dm > 0.0 else 0.0
            out.append((excess if excess > 0.0 else 0.0) + wait)
        return out

    def window_report(
        self,
        *,
        alive: Optional[Sequence[bool]] = None,
        delivered_capable: bool,
        sync_ms: float = 0.0,
    ) -> WindowReport:
        """Freeze this window for ElChe. Pass ``delivered_capable(policy, backend)``."""
        coherent = bool(delivered_capable) and self.movers_delivered_complete(alive)
        return WindowReport(
            wall_ms=tuple(self.wall_ms),
            steps=tuple(self.steps),
            delivered_ms=tuple(self.delivered_ms),
            delivered_batches=tuple(self.delivered_batches),
            fill_ms=tuple(self.fixed_ms_each()),
            delivered_coherent=coherent,
            sync_ms=sync_ms,
        )
