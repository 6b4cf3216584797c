"""The run's timeline for the dashboard: per-rank spans and marks, curves, epochs, events.

Theory of operation
-------------------
The service hands every stepped event with the commands it produced to ``observe``;
the timeline reads them and never decides anything (it may be dropped without changing
the run). What it keeps, on one time axis (seconds since the first event, the core's
clock: it continues across a coordinator restart):

- per rank, **spans** ``[kind, start, end, info]`` -- ``train`` (from the first step
  after a consensus to the round that collects it), ``round`` (from ``OpenRound`` to the
  rank's ``SyncAcked``), ``throttle`` (from ``Throttle`` to the ``Update`` that releases
  it) -- and **marks** (``join``, ``rejoin``, ``death``, ``left``);
- run-wide marks (the world formed, a coordinator or relay resync);
- a throughput and loss **curve**: one point per averaging round (at most one per
  ``CURVE_MIN_DT_S``), committed to nothing, read from the ranks' step reports;
- one row per aggregated **epoch** (loss, throughput, coverage) and the **event** list
  (every core notice but the per-window ones, with a level).

Bounded memory: spans (a budget shared by the ranks), marks, events and epochs are
capped -- the oldest go, counted under ``truncated``, so the page can say what it does
not show; the curve keeps its whole run by merging neighbouring points in pairs when
full (counted too).

The loop thread writes, the HTTP thread reads ``snapshot``: one lock, held for an
append or a copy, never across I/O. A closed span is a tuple, never changed again, so a
snapshot copies the lists that hold them (C speed) rather than the spans: a poll does
not stall the loop however long the run.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Any, Iterable, Optional

from flodl.core import (
    CHECKPOINT_META,
    BatchDone,
    BatchesDone,
    CoordinatorRestarted,
    Notice,
    OpenRound,
    RankHello,
    Reply,
    Send,
    SyncAcked,
)

__all__ = ["Timeline", "WARNING_NOTICES", "POLL_SPANS", "FINAL_PAGE_SPANS", "spans_per_rank"]

# Enough spans for hours of rounds per rank at the page's resolution; a longer run
# shows its latest part (and says from when). A big world shares a total budget
# (~150 bytes a span): each rank keeps at least MIN_SPANS_PER_RANK.
MAX_SPANS_PER_RANK = 2_000
MAX_SPANS_TOTAL = 200_000
MIN_SPANS_PER_RANK = 100
MAX_MARKS_PER_RANK = 200
MAX_EVENTS = 500
MAX_EPOCHS = 5_000
# The curve keeps the whole run: full, it merges neighbours (half the resolution).
MAX_CURVE_POINTS = 1_024
# A point per averaging round, but not closer than this: a 20 ms round's throughput
# is noise, and the page polls in seconds.
CURVE_MIN_DT_S = 0.2
# Spans one /timeline poll carries by default, and the page written at the end (each
# rank's latest; ?max_spans=N asks for another bound, 0 for all).
POLL_SPANS = 20_000
FINAL_PAGE_SPANS = 50_000
# Notices an operator should look at (the page colours them; the rest are news -- a
# deferred hello too: a rank waits its turn).
WARNING_NOTICES = frozenset({
    "rank_lost", "window_discarded", "reduce_stall", "checkpoint_abandoned", "checkpoint_retry",
    "cohort_evicted", "formation_failed", "collective_exhausted", "eval_failed", "intent_dropped",
    "coordinator_restarted", "journal_behind", "final_eval_retry", "shutdown_with_save",
})  # fmt: skip
# Per-window decisions are one per round per rank: the curve and the lanes show them.
_QUIET_NOTICES = frozenset({"window", "epoch_opened"})
_RELEASES_THROTTLE = frozenset({"update", "shutdown", "shutdown_with_save"})
_DRAWN_SENDS = _RELEASES_THROTTLE | {"throttle"}  # the sends the timeline draws from
_TEXT_MAX = 240


def spans_per_rank(world_size: int) -> int:
    """Each rank's share of the span budget."""
    return min(MAX_SPANS_PER_RANK, max(MIN_SPANS_PER_RANK, MAX_SPANS_TOTAL // max(world_size, 1)))


# What the timeline reads of the commands (the rest is skipped without a look: the hot
# path); the events it reads are the keys of ``_ON_EVENT`` (after the class).
_COMMANDS_READ = frozenset({OpenRound, Reply})  # (and Send: ``observe`` reads it by its kind)


class _Lane:
    __slots__ = ("rank", "host", "spans", "marks", "open", "dropped_spans", "dropped_marks", "steps")

    def __init__(self, rank: int, max_spans: int) -> None:
        self.rank = rank
        self.host = ""
        self.spans: deque[tuple] = deque(maxlen=max_spans)
        self.marks: deque[dict] = deque(maxlen=MAX_MARKS_PER_RANK)
        self.open: dict[str, list] = {}  # kind -> its span, still running (end None)
        self.dropped_spans = 0
        self.dropped_marks = 0
        self.steps = 0  # of the open train span

    def begin(self, kind: str, t: float, info: Any = None) -> None:
        if kind not in self.open:
            self.open[kind] = [kind, t, None, info]

    def end(self, kind: str, t: float, info: Any = None) -> None:
        span = self.open.pop(kind, None)
        if span is None:
            return
        closed = (span[0], span[1], max(t, span[1]), span[3] if info is None else info)
        if len(self.spans) == self.spans.maxlen:
            self.dropped_spans += 1
        self.spans.append(closed)

    def end_all(self, t: float) -> None:
        for kind in list(self.open):
            self.end(kind, t)

    def mark(self, t: float, kind: str, detail: str = "") -> None:
        if len(self.marks) == self.marks.maxlen:
            self.dropped_marks += 1
        self.marks.append({"t": t, "kind": kind, "detail": detail[:_TEXT_MAX]})


class Timeline:
    def __init__(self, world_size: int, num_epochs: int = 0) -> None:
        self._lock = threading.Lock()
        self.world_size = world_size
        self.num_epochs = num_epochs
        self._t0: Optional[float] = None
        self._now = 0.0
        self._lanes = [_Lane(r, spans_per_rank(world_size)) for r in range(world_size)]
        self._marks: deque[dict] = deque(maxlen=MAX_MARKS_PER_RANK)
        self._events: deque[dict] = deque(maxlen=MAX_EVENTS)
        self._epochs: deque[dict] = deque(maxlen=MAX_EPOCHS)
        self._curve: list[dict] = []
        self._curve_merges = 0
        self._dropped_events = 0
        self._dropped_run_marks = 0
        self._dropped_epochs = 0
        # The step reports since the last curve point: samples, loss * samples.
        self._acc_samples = 0
        self._acc_loss = 0.0
        self._acc_since: Optional[float] = None

    # -- the loop thread -------------------------------------------------------------

    def observe(self, ev, commands: Iterable) -> None:
        """One stepped event and what it produced (commands in order)."""
        with self._lock:
            now = ev.now
            t0 = self._t0
            if t0 is None:
                t0 = self._t0 = now
            t = round(now - t0, 4)
            if t > self._now:
                self._now = t
            on_event = _ON_EVENT.get(type(ev))  # (by exact type: the rest is skipped without a look)
            if on_event is not None:
                on_event(self, ev, t)
            for cmd in commands:
                if type(cmd) is Send:
                    # Most of a step's commands: a round's or a dispatch's N sends. Only
                    # a throttle and what lifts one draw here; the rest cost a lookup.
                    kind = cmd.kind
                    if kind in _DRAWN_SENDS:
                        self._send(cmd, kind, t)
                elif type(cmd) in _COMMANDS_READ or isinstance(cmd, Notice):
                    self._command(cmd, ev, t)

    def _lane(self, rank: int) -> Optional[_Lane]:
        return self._lanes[rank] if 0 <= rank < len(self._lanes) else None

    def _on_batch(self, ev: BatchDone, t: float) -> None:
        rank, lanes = ev.rank, self._lanes
        if not 0 <= rank < len(lanes):
            return
        lane = lanes[rank]
        if "train" not in lane.open:
            lane.steps = 0
            lane.begin("train", max(0.0, round(t - ev.batch_ms / 1000.0, 4)))
        lane.steps += 1
        if self._acc_since is None:  # the curve starts with the first step, not the first hello
            self._acc_since = max(0.0, round(t - ev.batch_ms / 1000.0, 4))
        samples = ev.samples
        self._acc_samples += samples
        self._acc_loss += ev.loss * samples

    def _on_batches(self, ev: BatchesDone, t: float) -> None:
        for b in ev.batches:  # a frame of several batches: each as if alone
            self._on_batch(b, t)

    def _on_sync_acked(self, ev: SyncAcked, t: float) -> None:
        lane = self._lane(ev.rank)
        if lane is not None:
            lane.end("round", t, {"cycle": ev.cycle})
            lane.end("throttle", t)

    def _on_restarted(self, ev: CoordinatorRestarted, t: float) -> None:
        self._run_mark(t, f"{ev.cause}_restart", "resynchronised" if ev.cause == "relay" else "replayed its journal")

    def _on_hello(self, ev: RankHello, t: float) -> None:
        lane = self._lane(ev.rank)
        if lane is not None and ev.host:
            lane.host = ev.host[:64]

    def _send(self, cmd: Send, kind: str, t: float) -> None:
        lane = self._lane(cmd.rank)
        if lane is None:
            return
        if kind == "throttle":
            lane.begin("throttle", t)
        elif kind in _RELEASES_THROTTLE:
            lane.end("throttle", t)

    def _command(self, cmd, ev, t: float) -> None:
        if isinstance(cmd, OpenRound):
            for r in cmd.ranks:
                lane = self._lane(r)
                if lane is not None:
                    lane.end("train", t, {"steps": lane.steps})
                    lane.begin("round", t, {"cycle": cmd.cycle})
            self._curve_point(t, CURVE_MIN_DT_S)
        elif isinstance(cmd, Reply) and isinstance(ev, RankHello) and cmd.ack.accepted and not cmd.ack.deferred:
            lane = self._lane(ev.rank)
            if lane is not None:
                died = any(m["kind"] == "death" for m in lane.marks)
                lane.mark(t, "rejoin" if died else "join", ev.host[:64])
        elif isinstance(cmd, Notice):
            self._notice(cmd, t)

    def _notice(self, cmd: Notice, t: float) -> None:
        d = cmd.data
        if cmd.kind in ("rank_lost", "rank_left"):
            lane = self._lane(int(d.get("rank", -1)))
            if lane is not None:
                lane.end_all(t)
                why = str(d.get("reason", ""))
                lost = d.get("discarded_samples") or 0
                lane.mark(t, "death" if cmd.kind == "rank_lost" else "left",
                          f"{why} ({lost} samples discarded)" if lost else why)
        elif cmd.kind == "world_formed":
            self._run_mark(t, "formed", f"world of {d.get('world_size')}")
        elif cmd.kind == "epoch":
            self._epoch(d, t)
        if cmd.kind in _QUIET_NOTICES:
            return
        level = "warning" if cmd.kind in WARNING_NOTICES else "info"
        if len(self._events) == self._events.maxlen:
            self._dropped_events += 1
        self._events.append({"t": t, "kind": cmd.kind, "level": level, "text": _describe(cmd)})

    def _epoch(self, d: dict, t: float) -> None:
        self._curve_point(t, 0.0)
        rates = [float(x) for x in d.get("samples_per_s", []) or []]
        cov = d.get("coverage") or {}
        row = {
            "epoch": int(d.get("epoch", 0)),
            "t": t,
            "avg_loss": _finite(d.get("avg_loss")),
            "samples_per_s": round(sum(rates), 3),
            "per_rank": [round(x, 3) for x in rates],
            "wall_s": _finite(d.get("wall_s")),
            "coverage": {k: cov.get(k) for k in ("expected", "trained", "duplicates", "missing", "discarded") if k in cov},
        }
        if len(self._epochs) == self._epochs.maxlen:
            self._dropped_epochs += 1
        self._epochs.append(row)

    def _run_mark(self, t: float, kind: str, detail: str) -> None:
        if len(self._marks) == self._marks.maxlen:
            self._dropped_run_marks += 1
        self._marks.append({"t": t, "kind": kind, "detail": detail[:_TEXT_MAX]})

    def _curve_point(self, t: float, min_dt: float) -> None:
        if self._acc_since is None or self._acc_samples == 0:
            return
        dt = t - self._acc_since
        if dt <= 0 or dt < min_dt:
            return
        self._curve.append({
            "t": t,
            "samples_per_s": round(self._acc_samples / dt, 3),
            "loss": _finite(self._acc_loss / self._acc_samples),
            "samples": self._acc_samples,
        })  # fmt: skip
        self._acc_samples, self._acc_loss, self._acc_since = 0, 0.0, t
        if len(self._curve) > MAX_CURVE_POINTS:
            self._curve = _halve(self._curve)
            self._curve_merges += 1

    # -- the HTTP thread -------------------------------------------------------------

    def snapshot(self, max_spans: int = 0) -> dict:
        """Plain JSON data, sharing nothing mutable with the timeline (closed spans are
        tuples, and a span's ``info`` is never changed once it is closed). ``max_spans``
        (0: all): about that many spans in all, each rank's latest (a page draws a few
        thousand pixels; a poll need not carry 10^5 spans); the rest are counted under
        ``truncated.spans_not_sent``."""
        per_lane = max(1, max_spans // max(len(self._lanes), 1)) if max_spans > 0 else 0
        not_sent = 0
        with self._lock:
            now = self._now
            lanes = []
            for lane in self._lanes:
                spans = list(lane.spans)
                if per_lane and len(spans) > per_lane:
                    not_sent += len(spans) - per_lane
                    spans = spans[-per_lane:]
                spans += [(k, s[1], None, s[3]) for k, s in lane.open.items()]  # still running
                lanes.append({"rank": lane.rank, "host": lane.host, "spans": spans, "marks": [dict(m) for m in lane.marks]})
            return {
                "world_size": self.world_size,
                "num_epochs": self.num_epochs,
                "now": now,
                "lanes": lanes,
                "marks": [dict(m) for m in self._marks],
                "curve": [dict(p) for p in self._curve],
                "epochs": [dict(e, coverage=dict(e["coverage"])) for e in self._epochs],
                "events": [dict(e) for e in self._events],
                "truncated": {
                    "spans": sum(lane.dropped_spans for lane in self._lanes),
                    "marks": sum(lane.dropped_marks for lane in self._lanes) + self._dropped_run_marks,
                    "events": self._dropped_events,
                    "epochs": self._dropped_epochs,
                    "curve_merges": self._curve_merges,
                    "spans_not_sent": not_sent,
                },
            }



_ON_EVENT = {
    BatchDone: Timeline._on_batch,
    BatchesDone: Timeline._on_batches,
    SyncAcked: Timeline._on_sync_acked,
    CoordinatorRestarted: Timeline._on_restarted,
    RankHello: Timeline._on_hello,
}

def _halve(points: list[dict]) -> list[dict]:
    """Neighbours merged in pairs: throughput by their samples over the pair's span,
    loss weighted by samples (the curve's shape at half the resolution)."""
    out = []
    for i in range(0, len(points) - 1, 2):
        a, b = points[i], points[i + 1]
        n = a["samples"] + b["samples"]
        dt_a = a["samples"] / a["samples_per_s"] if a["samples_per_s"] else 0.0
        dt_b = b["samples"] / b["samples_per_s"] if b["samples_per_s"] else 0.0
        loss = None
        if a["loss"] is not None and b["loss"] is not None and n:
            loss = (a["loss"] * a["samples"] + b["loss"] * b["samples"]) / n
        out.append({"t": b["t"], "samples_per_s": round(n / (dt_a + dt_b), 3) if dt_a + dt_b > 0 else 0.0,
                    "loss": loss, "samples": n})
    if len(points) % 2:
        out.append(points[-1])
    return out


def _finite(x) -> Optional[float]:
    try:
        f = float(x)
    except (TypeError, ValueError):
        return None
    return round(f, 6) if f == f and abs(f) != float("inf") else None


def _describe(cmd: Notice) -> str:
    d = cmd.data
    if cmd.kind == "epoch":
        cov = d.get("coverage") or {}
        loss = _finite(d.get("avg_loss"))
        return (f"epoch {int(d.get('epoch', 0)) + 1} aggregated: loss {'-' if loss is None else f'{loss:.4f}'}, "
                f"{cov.get('trained')}/{cov.get('expected')} samples, {cov.get('duplicates')} duplicates, "
                f"{cov.get('missing')} missing")
    if cmd.kind == CHECKPOINT_META:  # (its meta is the whole coverage ledger: not for a list)
        return f"checkpoint {d.get('version')} staged: the saving rank was asked for it"
    fields = " ".join(f"{k}={str(v)[:_TEXT_MAX]}" for k, v in sorted(d.items()))
    return f"{cmd.kind}: {fields}"[:_TEXT_MAX]
