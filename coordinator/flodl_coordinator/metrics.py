"""``/metrics``: the run as Prometheus metrics, through ``prometheus_client``.

Theory of operation
-------------------
The loop thread owns every number. ``RunBook`` (fed by the service) keeps what only the
service sees go by: how long each averaging round took, deaths / joins / restarts by
reason, the ranks' time accounts (goodput and badput by cause, ``timing.time_account``)
and the relays' fold and fan-out counters (``RoundHeader.relay_stats``). Once per tick
``publish`` turns the core state, the reducer, the journal and the book into one
immutable ``Sample`` (a reference swap); a scrape runs ``RunCollector.collect`` on the
HTTP thread, which only reads the latest sample and yields metric families. Nothing is
formatted by hand: ``prometheus_client.generate_latest`` writes the exposition.

Every family is ``flodl_``-prefixed and carries ``run`` (the session). Cardinality is
bounded: per-rank families carry ``rank`` only for ranks below ``metrics_rank_labels``
(a setting); counters and rates of the ranks beyond are summed under ``rank="other"``,
gauges that do not add up (a window length) are left out for them. Reasons are classes
from a fixed list (``death_class``), never free text.
"""

from __future__ import annotations

import math
import re
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional

from prometheus_client.core import (
    CollectorRegistry,
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
)

from .loopmeter import FRAME_BUCKETS_S

__all__ = ["RunBook", "RunCollector", "Sample", "new_registry", "death_class", "ROUND_BUCKETS_S", "CAUSES",
           "GOODPUT_CAUSES", "RUN_PHASES", "RANK_PHASES"]  # fmt: skip

# The rank's time causes (flodl.rank.TimeAccount; the coordinator may not import it):
# the first two are goodput, the rest badput. A test checks the lists agree.
CAUSES = ("training", "calibration", "barrier", "averaging", "recovery", "checkpoint", "eval", "startup")
GOODPUT_CAUSES = ("training", "calibration")
RUN_PHASES = ("starting", "FORMING", "TRAINING", "FINAL_EVAL", "SHUTTING_DOWN", "STOPPING", "FINISHED")
RANK_PHASES = ("VACANT", "JOINING", "ACTIVE", "DEAD", "LEFT")
# Averaging rounds last from a millisecond (a bus round on loopback) to the reduce
# stall timeout (minutes): log-spaced buckets over that span.
ROUND_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
# Rates are measured over the last RATE_WINDOW_S (points at least RATE_STEP_S apart):
# long enough to smooth a cadence window, short enough to follow a slowdown.
RATE_WINDOW_S = 10.0
RATE_STEP_S = 0.5

# Death reasons (free text from the core) -> a bounded class, first match wins.
_DEATH_CLASSES = (
    ("killed_by_signal", re.compile(r"killed by signal")),
    ("exited_with_error", re.compile(r"exited with code")),
    ("exited_without_shutdown", re.compile(r"without Shutdown")),
    ("heartbeat_stale", re.compile(r"heartbeat stale|silent|liveness")),
    ("unroutable", re.compile(r"unroutable|relay link")),
    ("protocol_violation", re.compile(r"violation|refused")),
)


_ZERO_TIME = dict.fromkeys((*CAUSES, "wall"), 0.0)


def death_class(reason: str) -> str:
    for name, rx in _DEATH_CLASSES:
        if rx.search(reason):
            return name
    return "other"


def new_registry(book: "RunBook") -> CollectorRegistry:
    """A registry of its own per service (never the process-global one): two services in
    one process (tests) do not collide, and nothing else leaks into ``/metrics``."""
    reg = CollectorRegistry(auto_describe=False)
    reg.register(RunCollector(book))
    return reg


class _Rate:
    """Rate of a monotone count over the last ``RATE_WINDOW_S``."""

    __slots__ = ("points",)

    def __init__(self) -> None:
        self.points: deque[tuple[float, float]] = deque()

    def add(self, now: float, value: float) -> None:
        p = self.points
        if p and now - p[-1][0] < RATE_STEP_S:
            return
        p.append((now, value))
        while len(p) > 2 and now - p[1][0] >= RATE_WINDOW_S:
            p.popleft()

    def per_s(self) -> Optional[float]:
        p = self.points
        if len(p) < 2 or p[-1][0] - p[0][0] < 1.0:
            return None
        return max(0.0, (p[-1][1] - p[0][1]) / (p[-1][0] - p[0][0]))


@dataclass(frozen=True)
class Sample:
    """What one scrape reads: plain data, built by the loop thread, never mutated."""

    run: str
    rank_labels: int
    info: dict[str, str] = field(default_factory=dict)
    phase: str = "starting"
    epoch: int = 0
    epochs_completed: int = 0
    num_epochs: int = 0
    progress: Optional[float] = None
    eta_s: Optional[float] = None
    committed: int = 0
    planned: int = 0
    discarded: int = 0
    committed_per_s: Optional[float] = None
    ranks: tuple[dict, ...] = ()  # per rank: rank, phase, samples, rate, window
    rounds: int = 0
    round_buckets: tuple[int, ...] = ()
    round_count: int = 0
    round_sum_s: float = 0.0
    bus_bytes_in: int = 0
    bus_bytes_out: int = 0
    relay: dict[str, int] = field(default_factory=dict)
    relays: int = 0
    deaths: dict[str, int] = field(default_factory=dict)
    joins: dict[str, int] = field(default_factory=dict)
    restarts: dict[str, int] = field(default_factory=dict)
    leaves: int = 0
    dropped: dict[str, int] = field(default_factory=dict)
    coordinator_restarts: int = 0
    journal: dict[str, float] = field(default_factory=dict)
    loop: dict = field(default_factory=dict)  # loopmeter.LoopMeter.stats
    time: dict[int, dict[str, float]] = field(default_factory=dict)  # rank -> cause seconds + "wall"
    events: int = 0


class RunBook:
    """The loop thread's side: fed as things happen, published once per tick."""

    def __init__(self, run: str, rank_labels: int, *, coordinator_restarts: int = 0) -> None:
        self.run = run
        self.rank_labels = rank_labels
        self.coordinator_restarts = coordinator_restarts
        self._version: Optional[int] = None
        self._buckets = [0] * len(ROUND_BUCKETS_S)
        self._round_count = 0
        self._round_sum = 0.0
        self.deaths: Counter[str] = Counter()
        self.joins: Counter[str] = Counter()
        self.restarts: Counter[str] = Counter()
        self.leaves = 0
        self._death_of: dict[int, str] = {}  # rank -> class of its last death (a restart's reason)
        self._incarnation: dict[int, int] = {}  # rank -> the incarnation last seen admitted
        self._formed_before = False  # the world had formed at the previous publish
        self._accounts: dict[tuple[int, int], dict[str, float]] = {}  # (rank, incarnation) -> latest
        self._relays: dict[tuple[str, int], dict[str, int]] = {}  # (relay, incarnation) -> latest
        self._rates: dict[int, _Rate] = {}
        self._time_by_rank: dict[int, dict[str, float]] = {}  # summed over incarnations at publish
        self._committed_rate = _Rate()
        self.sample = Sample(run=run, rank_labels=rank_labels)

    # -- fed by the service ----------------------------------------------------------

    def members_known(self, st) -> None:
        """A coordinator recovered from its journal: the ranks already admitted are not
        joins of this process (its counters start again at 0, as after any restart)."""
        for rec in st.ranks:
            if rec.incarnation:
                self._incarnation[rec.rank] = rec.incarnation
        self._formed_before = st.run.formed_at is not None

    def stepped(self, st) -> None:
        """After every core step: a round that just finished is timed (``rounds.version``)."""
        rs = st.rounds
        if self._version is None:
            self._version = rs.version
        elif rs.version != self._version:
            self._version = rs.version
            d = max(0.0, st.now - rs.opened_at)
            self._round_count += 1
            self._round_sum += d
            for i, b in enumerate(ROUND_BUCKETS_S):
                if d <= b:
                    self._buckets[i] += 1
                    break

    def noticed(self, kind: str, data: dict) -> None:
        if kind == "rank_lost":
            cls = death_class(str(data.get("reason", "")))
            self.deaths[cls] += 1
            self._death_of[int(data.get("rank", -1))] = cls
        elif kind == "rank_left":
            self.leaves += 1

    def time_account(self, rank: int, incarnation: int, acct) -> None:
        """A rank's ``TimeAccount`` (cumulative per process): the latest one per incarnation
        is kept, so a restarted rank's earlier life still counts."""
        row = {c: float(getattr(acct, f"{c}_s")) for c in CAUSES}
        row["wall"] = float(acct.wall_s)
        self._accounts[(rank, incarnation)] = row

    def relay_stats(self, relay: str, incarnation: int, stats) -> None:
        self._relays[(relay, incarnation)] = {
            k: int(getattr(stats, k))
            for k in ("folds_sent", "ranks_folded", "parts_forwarded", "folds_discarded", "fanouts", "fanout_copies")
        }

    # -- read by the status board ----------------------------------------------------

    def rate_of(self, rank: int) -> Optional[float]:
        r = self._rates.get(rank)
        return None if r is None else r.per_s()

    def committed_per_s(self) -> Optional[float]:
        return self._committed_rate.per_s()

    def time_of(self, rank: int) -> dict[str, float]:
        """Seconds by cause (and ``wall``) of every life of ``rank``, as of the last publish."""
        return dict(self._time_by_rank.get(rank) or _ZERO_TIME)

    def _sum_accounts(self) -> dict[int, dict[str, float]]:
        out: dict[int, dict[str, float]] = {}
        for (r, _inc), row in self._accounts.items():  # one pass: a world of thousands stays cheap
            acc = out.setdefault(r, dict(_ZERO_TIME))
            for k, v in row.items():
                acc[k] += v
        return out

    # -- once per tick ---------------------------------------------------------------

    def publish(self, st, view: dict, *, reducer, dropped: dict, journal: dict, events: int,
                loop: dict | None = None) -> Sample:  # fmt: skip
        """Build the sample a scrape reads from the core state and its status view."""
        now = st.now
        self._admissions(st)
        self._time_by_rank = self._sum_accounts()
        prog = view["progress"]
        if prog["samples_committed"]:  # from the first commit: the world forming is not a slow rate
            self._committed_rate.add(now, prog["samples_committed"])
        ranks = []
        for r in view["ranks"]:
            rate = self._rates.get(r["rank"])
            if rate is None:  # (not setdefault: that builds a _Rate per rank per publish)
                rate = self._rates[r["rank"]] = _Rate()
            rate.add(now, r["samples"])
            ranks.append({"rank": r["rank"], "phase": r["phase"], "samples": r["samples"],
                          "rate": rate.per_s(), "window": r["window"]})  # fmt: skip
        relay: Counter[str] = Counter()
        for row in self._relays.values():
            relay.update(row)
        ep = view["epoch"]
        self.sample = Sample(
            run=self.run,
            rank_labels=self.rank_labels,
            info={"policy": str(view["policy"]), "plane": str(view["plane"]), "world_size": str(view["world_size"])},
            phase=view["run"]["phase"],
            epoch=ep["dispatched"] if ep["dispatched"] is not None else 0,
            epochs_completed=(ep["aggregated"] + 1) if ep["aggregated"] is not None else 0,
            num_epochs=ep["num_epochs"],
            progress=prog["fraction"],
            eta_s=eta_s(prog["samples_total"] - prog["samples_committed"], self.committed_per_s())
            if prog["samples_total"] else None,  # (nothing planned yet: the world has not formed)
            committed=prog["samples_committed"],
            planned=prog["samples_total"],
            discarded=prog["samples_discarded"],
            committed_per_s=self.committed_per_s(),
            ranks=tuple(ranks),
            rounds=st.rounds.version,
            round_buckets=tuple(self._buckets),
            round_count=self._round_count,
            round_sum_s=self._round_sum,
            bus_bytes_in=reducer.bytes_in,
            bus_bytes_out=reducer.bytes_out,
            relay=dict(relay),
            relays=len({k[0] for k in self._relays}),
            deaths=dict(self.deaths),
            joins=dict(self.joins),
            restarts=dict(self.restarts),
            leaves=self.leaves,
            dropped=dict(dropped),
            coordinator_restarts=self.coordinator_restarts,
            journal=dict(journal),
            loop=dict(loop or {}),
            time={r["rank"]: self._time_by_rank.get(r["rank"]) or dict(_ZERO_TIME) for r in view["ranks"]},
            events=events,
        )
        return self.sample

    def _admissions(self, st) -> None:
        """A slot admitted with a new incarnation: a join (its first) or a restart (by
        the class of the death it replaces)."""
        # Formed *before* the previous publish: a rank admitted since then may be the very
        # one whose hello formed the world (a formation join, not a late one).
        late = self._formed_before
        self._formed_before = st.run.formed_at is not None
        for rec in st.ranks:
            inc = rec.incarnation
            if not inc or self._incarnation.get(rec.rank) == inc:
                continue
            if rec.rank in self._incarnation:
                self.restarts[self._death_of.get(rec.rank, "other")] += 1
            else:
                self.joins["late" if late else "formation"] += 1
            self._incarnation[rec.rank] = inc


def eta_s(left: float, per_s: Optional[float]) -> Optional[float]:
    """Seconds to commit ``left`` more samples at ``per_s`` (None while unknown)."""
    if left <= 0:
        return 0.0
    if not per_s or per_s <= 0 or not math.isfinite(per_s):
        return None
    return left / per_s


class RunCollector:
    """A ``prometheus_client`` collector over the book's latest sample."""

    def __init__(self, book: RunBook) -> None:
        self.book = book

    def collect(self) -> Iterable[Any]:
        s = self.book.sample
        run = s.run
        yield from _run_families(s, run)
        yield from _rank_families(s, run)
        yield from _round_families(s, run)
        yield from _fault_families(s, run)
        yield from _time_families(s, run)


def _gauge(name: str, doc: str, value: Optional[float], run: str, unit: str = "") -> Iterable[Any]:
    g = GaugeMetricFamily(name, doc, labels=["run"], unit=unit)
    if value is not None:
        g.add_metric([run], float(value))
    yield g


def _counter(name: str, doc: str, value: float, run: str) -> CounterMetricFamily:
    c = CounterMetricFamily(name, doc, labels=["run"])
    c.add_metric([run], float(value))
    return c


def _by(name: str, doc: str, label: str, values: dict, run: str, keys: Iterable[str] = ()) -> CounterMetricFamily:
    c = CounterMetricFamily(name, doc, labels=["run", label])
    for k in sorted(set(values) | set(keys)):
        c.add_metric([run, str(k)], float(values.get(k, 0)))
    return c


def _run_families(s: Sample, run: str) -> Iterable[Any]:
    info = InfoMetricFamily("flodl_run", "the run's settings", labels=["run"])
    info.add_metric([run], s.info)
    yield info
    phase = GaugeMetricFamily("flodl_run_phase", "1 for the run's current phase", labels=["run", "phase"])
    for p in RUN_PHASES:
        phase.add_metric([run, p], 1.0 if s.phase == p else 0.0)
    yield phase
    yield from _gauge("flodl_epoch", "the epoch being dispatched (0-based)", s.epoch, run)
    yield from _gauge("flodl_epochs_completed", "epochs aggregated so far", s.epochs_completed, run)
    yield from _gauge("flodl_epochs_planned", "epochs the run trains", s.num_epochs, run)
    yield from _gauge("flodl_progress_ratio", "committed samples / samples the run trains", s.progress, run)
    yield from _gauge("flodl_eta_seconds", "time left at the recent commit rate (absent while unknown)", s.eta_s, run)
    yield _counter("flodl_committed_samples_total", "samples folded into a consensus (committed)", s.committed, run)
    yield from _gauge("flodl_planned_samples", "samples the run trains (all epochs)", s.planned, run)
    yield _counter("flodl_discarded_samples_total", "samples trained and discarded (a dead rank's window)",
                   s.discarded, run)  # fmt: skip
    yield from _gauge("flodl_committed_samples_per_second", "commit rate over the last 10 s", s.committed_per_s, run)
    yield _counter("flodl_events_total", "events the core stepped", s.events, run)
    yield _counter("flodl_coordinator_restarts_total", "restarts of the coordinator from its journal in this run",
                   s.coordinator_restarts, run)  # fmt: skip
    j = s.journal
    yield from _gauge("flodl_journal_bytes", "journal size", j.get("bytes"), run)
    yield _counter("flodl_journal_records_total", "records this process appended to the journal",
                   j.get("records", 0), run)  # fmt: skip
    yield _counter("flodl_journal_fsyncs_total", "journal fsyncs", j.get("fsyncs", 0), run)
    yield from _gauge("flodl_journal_unsynced_records", "records written but not fsynced yet (lag)",
                      j.get("unsynced"), run)  # fmt: skip
    yield from _gauge("flodl_journal_lag_seconds", "age of the oldest record not fsynced yet (0 when durable)",
                      j.get("lag_s"), run)  # fmt: skip
    yield from _loop_families(s.loop, run)


def _loop_families(loop: dict, run: str) -> Iterable[Any]:
    """The coordinator's own load (``loopmeter``): absent until the service measured it."""
    if not loop:
        return
    yield _handling("flodl_coordinator_frame_seconds",
                    "a frame's handling: read off the socket to its step done and its commands queued",
                    loop["buckets"], loop["count"], loop["sum_s"], run)  # fmt: skip
    yield _handling("flodl_coordinator_round_trigger_seconds",
                    "a frame that opened an averaging round: read off the socket to every rank's RequestParams queued",
                    loop["round_buckets"], loop["round_count"], loop["round_sum_s"], run)  # fmt: skip
    yield from _gauge("flodl_coordinator_busy_ratio",
                      "the coordinator loop's busy time over wall time since the last publish (1: saturated)",
                      loop["busy_ratio"], run)  # fmt: skip


def _handling(name: str, doc: str, cumulative: tuple, count: int, sum_s: float, run: str) -> HistogramMetricFamily:
    h = HistogramMetricFamily(name, doc, labels=["run"])
    buckets = [(_le(b), float(n)) for b, n in zip(FRAME_BUCKETS_S, cumulative)]
    buckets.append(("+Inf", float(count)))
    h.add_metric([run], buckets, sum_s)
    return h


def _rank_key(s: Sample, rank: int) -> Optional[str]:
    """The ``rank`` label of ``rank``: its number below the bound, else None (summed as other)."""
    return str(rank) if rank < s.rank_labels else None


def _rank_families(s: Sample, run: str) -> Iterable[Any]:
    phases: Counter[str] = Counter(r["phase"] for r in s.ranks)
    g = GaugeMetricFamily("flodl_ranks", "ranks by membership phase", labels=["run", "phase"])
    for p in RANK_PHASES:
        g.add_metric([run, p], float(phases.get(p, 0)))
    yield g
    samples = CounterMetricFamily("flodl_rank_samples", "samples the rank reported trained", labels=["run", "rank"])
    rate = GaugeMetricFamily("flodl_rank_samples_per_second", "the rank's training rate over the last 10 s",
                             labels=["run", "rank"])  # fmt: skip
    window = GaugeMetricFamily("flodl_rank_window_batches", "cadence: batches in the rank's planned window",
                               labels=["run", "rank"])  # fmt: skip
    up = GaugeMetricFamily("flodl_rank_up", "1 while the rank is ACTIVE", labels=["run", "rank"])
    other_samples, other_rate, others = 0.0, 0.0, False
    for r in s.ranks:
        key = _rank_key(s, r["rank"])
        if key is None:
            others = True
            other_samples += r["samples"]
            other_rate += r["rate"] or 0.0
            continue
        samples.add_metric([run, key], float(r["samples"]))
        if r["rate"] is not None:
            rate.add_metric([run, key], r["rate"])
        if r["window"] is not None:
            window.add_metric([run, key], float(r["window"]))
        up.add_metric([run, key], 1.0 if r["phase"] == "ACTIVE" else 0.0)
    if others:
        samples.add_metric([run, "other"], other_samples)
        rate.add_metric([run, "other"], other_rate)
    yield from (samples, rate, window, up)


def _round_families(s: Sample, run: str) -> Iterable[Any]:
    yield _counter("flodl_averaging_rounds", "averaging rounds finished", s.rounds, run)
    h = HistogramMetricFamily("flodl_averaging_round_seconds", "averaging rounds, open to finished",
                              labels=["run"], unit="")  # fmt: skip
    acc, buckets = 0, []
    for b, n in zip(ROUND_BUCKETS_S, s.round_buckets or (0,) * len(ROUND_BUCKETS_S)):
        acc += n
        buckets.append((_le(b), float(acc)))
    buckets.append(("+Inf", float(s.round_count)))
    h.add_metric([run], buckets, s.round_sum_s)
    yield h
    b = CounterMetricFamily("flodl_bus_bytes", "bus plane tensor bytes, in (contributions) and out (consensus)",
                            labels=["run", "direction"])  # fmt: skip
    b.add_metric([run, "in"], float(s.bus_bytes_in))
    b.add_metric([run, "out"], float(s.bus_bytes_out))
    yield b
    per = GaugeMetricFamily("flodl_bus_bytes_per_round", "bus bytes per finished round, each way",
                            labels=["run", "direction"])  # fmt: skip
    if s.rounds:
        per.add_metric([run, "in"], s.bus_bytes_in / s.rounds)
        per.add_metric([run, "out"], s.bus_bytes_out / s.rounds)
    yield per
    yield from _gauge("flodl_relays_reporting", "relays whose counters reached the coordinator", s.relays, run)
    for key, doc in (
        ("folds_sent", "folded rounds the relays sent upstream"),
        ("ranks_folded", "rank contributions folded by the relays"),
        ("parts_forwarded", "contributions the relays could not fold (forwarded raw)"),
        ("folds_discarded", "folds superseded by a newer FoldOpen"),
        ("fanouts", "consensus frames the relays received once for several ranks"),
        ("fanout_copies", "consensus copies the relays delivered to ranks"),
    ):
        yield _counter(f"flodl_relay_{key}", doc + " (reported with each fold)", s.relay.get(key, 0), run)


def _le(b: float) -> str:
    return repr(float(b))


def _fault_families(s: Sample, run: str) -> Iterable[Any]:
    classes = [c for c, _ in _DEATH_CLASSES] + ["other"]
    yield _by("flodl_rank_deaths", "ranks lost, by class of reason", "reason", s.deaths, run, classes)
    yield _by("flodl_rank_joins", "ranks admitted into a slot for the first time", "reason", s.joins, run,
              ("formation", "late"))  # fmt: skip
    yield _by("flodl_rank_restarts", "ranks admitted again after a death, by the death's class", "reason",
              s.restarts, run, classes)  # fmt: skip
    yield _counter("flodl_rank_leaves", "ranks that exited cleanly", s.leaves, run)
    yield _by("flodl_dropped_frames", "frames dropped, by reason (flodl_coordinator.droplog)", "reason", s.dropped, run)


def _time_families(s: Sample, run: str) -> Iterable[Any]:
    good = CounterMetricFamily("flodl_rank_goodput_seconds", "rank wall time spent training, by cause",
                               labels=["run", "rank", "cause"])  # fmt: skip
    bad = CounterMetricFamily("flodl_rank_badput_seconds", "rank wall time not spent training, by cause",
                              labels=["run", "rank", "cause"])  # fmt: skip
    wall = CounterMetricFamily("flodl_rank_wall_seconds", "rank process wall time (the causes add up to it)",
                               labels=["run", "rank"])  # fmt: skip
    other: Counter[str] = Counter()
    for rank in sorted(s.time):
        row = s.time[rank]
        key = _rank_key(s, rank)
        if key is None:
            other.update(row)
            continue
        _time_row(good, bad, wall, run, key, row)
    if other:
        _time_row(good, bad, wall, run, "other", dict(other))
    yield from (good, bad, wall)


def _time_row(good, bad, wall, run: str, key: str, row: dict) -> None:
    for cause in CAUSES:
        (good if cause in GOODPUT_CAUSES else bad).add_metric([run, key, cause], float(row.get(cause, 0.0)))
    wall.add_metric([run, key], float(row.get("wall", 0.0)))


def journal_stats(journal, now: Callable[[], float]) -> dict:
    """The journal's size and durability lag, for ``RunBook.publish`` (empty: no journal)."""
    if journal is None:
        return {}
    first = journal.unsynced_since
    return {"bytes": journal.bytes, "records": journal.records, "fsyncs": journal.fsyncs,
            "unsynced": journal.unsynced, "lag_s": 0.0 if first is None else max(0.0, now() - first)}  # fmt: skip
