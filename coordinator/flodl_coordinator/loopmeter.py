"""How long the coordinator takes per frame, and how busy its loop is.

The ranks see the coordinator's decisions late when its loop is the bottleneck; the
operator should see that without a profiler. ``LoopMeter`` counts, per frame, the time
from the frame being read off the socket to the core having stepped what it carried and
the shell having queued its commands (a pass's commands then leave together, after its
journal fsync), the same for the frames that opened an averaging round (a round's
trigger: such a frame sends what its pass decided so far at once, so its time is the
decision, the journal's fsync if there is one, and its N ``RequestParams`` handed to the
socket), and the loop's busy time (the drains with their sends, ticks, status
publishes) against its wall time. Fixed buckets: a frame costs one ``bisect`` and a few
additions, at tens of thousands of frames a second.

Read by ``/metrics`` (``flodl_coordinator_frame_seconds``,
``flodl_coordinator_round_trigger_seconds``, ``flodl_coordinator_busy_ratio``)
and by the run summary (``coordinator_loop``).
"""

from __future__ import annotations

import time
from bisect import bisect_left
from typing import Callable

__all__ = ["FRAME_BUCKETS_S", "LoopMeter"]

# Upper bounds (seconds) of a frame's handling time; a last, open bucket holds the rest.
FRAME_BUCKETS_S = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


class _Histogram:
    """Handling times in the fixed ``FRAME_BUCKETS_S``: counts, sum, largest."""

    def __init__(self) -> None:
        self.counts = [0] * (len(FRAME_BUCKETS_S) + 1)
        self.n = 0
        self.sum_s = 0.0
        self.max_s = 0.0

    def add(self, seconds: float) -> None:
        self.counts[bisect_left(FRAME_BUCKETS_S, seconds)] += 1
        self.n += 1
        self.sum_s += seconds
        if seconds > self.max_s:
            self.max_s = seconds

    def quantile_le_s(self, q: float) -> float:
        """An upper bound of the ``q`` quantile: the bound of the bucket it falls in (the
        largest time for the open bucket); 0 when empty. A bound, not an estimate: what
        an operator can rely on."""
        if not self.n:
            return 0.0
        need, acc = q * self.n, 0
        for i, n in enumerate(self.counts):
            acc += n
            if acc >= need and n:
                return min(FRAME_BUCKETS_S[i], self.max_s) if i < len(FRAME_BUCKETS_S) else self.max_s
        return self.max_s

    def cumulative(self) -> tuple:
        """Cumulative counts per bound (the open bucket is ``n``)."""
        cum, acc = [], 0
        for n in self.counts[:-1]:
            acc += n
            cum.append(acc)
        return tuple(cum)


class LoopMeter:
    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self._frames = _Histogram()
        # The frames that opened an averaging round (a round's trigger): from the frame
        # read off the socket to every rank's RequestParams handed to the socket -- the
        # coordinator's own share of the ranks' decision latency, its fan-out included.
        self._rounds = _Histogram()
        self.busy_s = 0.0
        self.slowest = ""  # what the slowest frame carried (the last event it stepped), set by its owner
        self.started = clock()
        self._last = (self.started, 0.0)  # (clock, busy_s) at the last ``recent_busy_ratio``

    @property
    def frames(self) -> int:
        return self._frames.n

    @property
    def frame_max_s(self) -> float:
        return self._frames.max_s

    def frame(self, seconds: float, *, opened_round: bool = False) -> None:
        """One frame handled in ``seconds`` (inside a drain, which is timed as busy);
        ``opened_round``: its step opened an averaging round."""
        self._frames.add(seconds)
        if opened_round:
            self._rounds.add(seconds)

    def busy(self, seconds: float) -> None:
        """Loop time spent working: a drain (its frames and sends), a tick, a publish."""
        self.busy_s += seconds

    def quantile_le_s(self, q: float) -> float:
        """An upper bound of the ``q`` quantile of the frames' handling time (``_Histogram``)."""
        return self._frames.quantile_le_s(q)

    def recent_busy_ratio(self) -> float:
        """Busy time over wall time since the previous call (the first: since the start)."""
        now = self.clock()
        t0, b0 = self._last
        self._last = (now, self.busy_s)
        return min(1.0, (self.busy_s - b0) / (now - t0)) if now > t0 else 0.0

    def stats(self) -> dict:
        """For ``/metrics``: cumulative bucket counts, sum, count (of every frame, and of
        the round triggers: ``round_*``); and the recent busy ratio."""
        f, r = self._frames, self._rounds
        return {"buckets": f.cumulative(), "count": f.n, "sum_s": f.sum_s,
                "round_buckets": r.cumulative(), "round_count": r.n, "round_sum_s": r.sum_s,
                "busy_ratio": self.recent_busy_ratio()}  # fmt: skip

    def summary(self) -> dict:
        """For the run summary: the whole run's figures, in milliseconds."""
        wall = self.clock() - self.started
        f, r = self._frames, self._rounds
        return {
            "frames": f.n,
            "busy_share": round(self.busy_s / wall, 4) if wall > 0 else 0.0,
            "frame_mean_ms": round(1e3 * f.sum_s / f.n, 4) if f.n else 0.0,
            "frame_p50_le_ms": round(1e3 * f.quantile_le_s(0.50), 3),
            "frame_p99_le_ms": round(1e3 * f.quantile_le_s(0.99), 3),
            "frame_max_ms": round(1e3 * f.max_s, 3),
            "frame_max_event": self.slowest,
            "round_triggers": r.n,
            "round_trigger_p50_le_ms": round(1e3 * r.quantile_le_s(0.50), 3),
            "round_trigger_p99_le_ms": round(1e3 * r.quantile_le_s(0.99), 3),
            "round_trigger_max_ms": round(1e3 * r.max_s, 3),
        }
