"""The churn campaign's schedule and its measurements: pure functions, no processes.

``bench/elastic.py --churn`` (``churn_run``) strikes the faults this module draws and
hands back what the run left (the journal's records, the summary, the ranks' traces);
everything here is a function of those, so it is tested without starting anything
(``tests/unit/test_churn_bench.py``).

The schedule (``draw_schedule``) is a seeded list of faults, one every ``every_s`` ± 20 %
from the world's first batch. Kinds come from a shuffled bag of all four, so a campaign
of n faults has each kind about n / 4 times; a kind that cannot happen now (a join while
the extra host is in, a leave while it is not) gives way to the next in the bag:

* ``kill9_rank``: SIGKILL of a training rank (its agent reports the exit, restarts it,
  and it rejoins);
* ``sigstop_rank``: SIGSTOP of a training rank for longer than the liveness timeout
  (only the heartbeat can tell), then SIGCONT or SIGKILL (drawn);
* ``join``: a new agent with more ranks joins the running world;
* ``leave``: that host leaves (SIGTERM to its agent: it stops its ranks).

The victim is drawn as a number and resolved at the strike against the ranks training
then (``pick_victim``), so the same seed strikes the same ranks when the run goes alike.

Full rate and recovery (``recovery_s``). Each rank's *full rate* is its median batch
count per ``W``-second bin over the bins of the run in which it trained at all (a rank
spends most of a run away from faults, so the median is its undisturbed pace, rounds
included). The *survivors* of a fault are the ranks that trained in the ``PRE_S``
seconds before it, less the struck ones. They train at full rate again at the first
moment ``t`` after the fault from which, for ``HOLD_S`` seconds, every ``W`` window
starting in ``[t, t + HOLD_S]`` holds at least ``THETA`` x the sum of their full rates:
``recovery_s = t - t_fault`` (0: the fault never slowed them; the end of a stall reads
early by up to ``(1 - THETA) x W``, 0.2 s: a window counts once it is that full). Batches are the
coordinator's ``BatchDone`` records, stamped on receipt with its monotonic clock, the
clock the faults are stamped with here too (one host).
"""

from __future__ import annotations

import bisect
import random
import statistics
from collections import Counter
from dataclasses import dataclass
from typing import Iterable

from flodl.core import BATCH_RECORDS, batches_in

__all__ = [
    "KINDS",
    "Fault",
    "draw_schedule",
    "pick_victim",
    "batch_times",
    "count_in",
    "full_rates",
    "survivors",
    "recovery_s",
    "join_times",
    "goodput",
    "trace_audit",
]

KINDS = ("kill9_rank", "sigstop_rank", "join", "leave")
JITTER = 0.2  # each gap is every_s x U(1 - JITTER, 1 + JITTER): faults do not beat with rounds
W = 1.0  # s, the rate window: one heartbeat interval at the default
HOLD_S = 2.0  # s the survivors must keep the rate for it to count as recovered
THETA = 0.8  # share of their full rate that counts as full (the machine's load jitters)
PRE_S = 2.0  # s before a fault in which a rank must have trained to count as a survivor
GRID_S = 0.05  # s, the resolution of recovery_s


@dataclass(frozen=True)
class Fault:
    """One planned fault: when (seconds after the world's first batch), what, and the
    draws that fix its victim and (sigstop) how it ends."""

    at_s: float
    kind: str
    pick: int = 0  # resolved against the ranks training at the strike (pick_victim)
    then: str = ""  # sigstop_rank: "cont" (SIGCONT) or "kill" (SIGKILL) once declared dead


def draw_schedule(seed: int, count: int, every_s: float, kinds: Iterable[str] = KINDS) -> list[Fault]:
    """``count`` faults drawn from ``seed``; join and leave alternate (one extra host)."""
    allowed = [k for k in KINDS if k in set(kinds)]
    if not allowed:
        raise ValueError(f"no fault kinds chosen; from {KINDS}")
    rng = random.Random(seed)
    out: list[Fault] = []
    joined, bag, t = False, [], 0.0
    while len(out) < count:
        t += every_s * rng.uniform(1 - JITTER, 1 + JITTER)
        possible = [k for k in allowed if not (k == "join" and joined) and not (k == "leave" and not joined)]
        if not possible:  # only join/leave were chosen and the plan ran out of either
            break
        if not any(k in possible for k in bag):
            bag = list(allowed)
            rng.shuffle(bag)
        kind = next(k for k in bag if k in possible)
        bag.remove(kind)
        joined = {"join": True, "leave": False}.get(kind, joined)
        then = rng.choice(("cont", "kill")) if kind == "sigstop_rank" else ""
        out.append(Fault(round(t, 3), kind, rng.randrange(1 << 30), then))
    return out


def pick_victim(fault: Fault, training: Iterable[int]) -> int | None:
    ranks = sorted(set(training))
    return ranks[fault.pick % len(ranks)] if ranks else None


def batch_times(records: Iterable[dict]) -> dict[int, list[float]]:
    """rank -> the sorted receipt times of its ``BatchDone`` records."""
    out: dict[int, list[float]] = {}
    for r in records:
        if r.get("type") in BATCH_RECORDS:
            out.setdefault(r["rank"], []).extend([r["now"]] * batches_in(r))
    return {k: sorted(v) for k, v in out.items()}


def count_in(ts: list[float], a: float, b: float) -> int:
    """How many of the sorted times ``ts`` lie in [a, b)."""
    return bisect.bisect_left(ts, b) - bisect.bisect_left(ts, a)


def full_rates(batches: dict[int, list[float]], w: float = W) -> dict[int, float]:
    """rank -> batches per second: the median count of the ``w`` bins it trained in."""
    out = {}
    for rank, ts in batches.items():
        bins = Counter(int((t - ts[0]) // w) for t in ts)
        out[rank] = statistics.median(bins.values()) / w
    return out


def survivors(batches: dict[int, list[float]], t_fault: float, struck: Iterable[int],
              pre_s: float = PRE_S) -> list[int]:  # fmt: skip
    """The ranks that trained in the ``pre_s`` seconds before the fault, less the struck."""
    gone = set(struck)
    return sorted(r for r, ts in batches.items() if r not in gone and count_in(ts, t_fault - pre_s, t_fault) > 0)


def recovery_s(
    batches: dict[int, list[float]],
    ranks: list[int],
    rates: dict[int, float],
    t_fault: float,
    until: float,
    w: float = W,
    hold_s: float = HOLD_S,
    theta: float = THETA,
) -> float | None:
    """Seconds from the fault until ``ranks`` train at full rate again (see the module
    doc); None when that did not happen before ``until`` (the next fault, the run's end)."""
    if not ranks:
        return None
    need = theta * w * sum(rates[r] for r in ranks)
    streams = [batches[r] for r in ranks]
    n = int((until - t_fault - w) / GRID_S) + 1  # windows that end before ``until``
    starts = (t_fault + i * GRID_S for i in range(max(n, 0)))
    ok = [sum(count_in(ts, t0, t0 + w) for ts in streams) >= need for t0 in starts]
    span = int(round(hold_s / GRID_S))
    run = 0  # consecutive good windows ending at i
    for i, good in enumerate(ok):
        run = run + 1 if good else 0
        if run > span:
            return round((i - span) * GRID_S, 3)
    return None


def join_times(records: list[dict]) -> list[dict]:
    """Per seeded joiner: its hello -> seeded, and -> the first committed step of its own
    (a ``SyncAcked`` folding at least one step after the seed)."""
    hello: dict[int, dict] = {}
    seeded: dict[int, tuple[float, dict]] = {}
    out = []

    def row(rank: int, at: float, h: dict, commit: float | None) -> dict:
        return {"rank": rank, "restart_count": h.get("restart_count", 0), "hello_at": h["now"],
                "hello_to_seeded_s": round(at - h["now"], 3),
                "hello_to_first_commit_s": None if commit is None else round(commit - h["now"], 3)}  # fmt: skip

    for r in records:
        t, rank = r.get("type"), r.get("rank")
        if t in ("RankHello", "JoinerSeeded") and rank in seeded:  # the last one never committed (it died)
            out.append(row(rank, *seeded.pop(rank), None))
        if t == "RankHello":
            hello[rank] = r
        elif t == "JoinerSeeded" and rank in hello:
            seeded[rank] = (r["now"], hello[rank])
        elif t == "SyncAcked" and rank in seeded and r.get("step_count", 0) > 0:
            out.append(row(rank, *seeded.pop(rank), r["now"]))
    out += [row(rank, at, h, None) for rank, (at, h) in seeded.items()]  # the run ended first
    return sorted(out, key=lambda j: j["hello_at"])


def goodput(records: list[dict], summary: dict) -> dict:
    """Committed samples per second from the world's first batch to its last commit."""
    first = next((r["now"] for r in records if r.get("type") in BATCH_RECORDS), None)
    last = max((r["now"] for r in records if r.get("type") == "SyncAcked"), default=None)
    committed = sum(c["trained"] - c["duplicates"] for c in summary.get("coverage", []))
    span = (last - first) if first is not None and last is not None else 0.0
    return {"committed_samples": committed, "train_span_s": round(span, 3),
            "samples_per_s": round(committed / span, 1) if span > 0 else None}  # fmt: skip


def trace_audit(per_epoch: dict[int, Counter], expected: int, epochs: int) -> dict:
    """What the ranks wrote down themselves: samples of an epoch never trained (lost,
    goal 0) and trainings beyond the first (a dead rank's discarded window, or a double)."""
    never = sum(expected - len(per_epoch.get(e, ())) for e in range(epochs))
    extra = sum(n - 1 for counts in per_epoch.values() for n in counts.values())
    return {"never_trained": never, "trained_again": extra}
