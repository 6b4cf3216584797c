"""``bench/elastic.py --churn``: the baseline and the churn run, and their report.

``churn_run`` strikes, ``churn_plan`` measures; this module sets the run's sizes (the
full campaign or ``--quick``), runs the baseline (no faults) and then the churn run in
the same invocation, replays each journal through the core for its decisions, and
builds the JSON (see ``bench/elastic.py``'s doc for the fields).
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from collections import Counter
from pathlib import Path

from flodl.core import BATCH_RECORDS
import churn_plan as plan
from churn_run import ChurnRun

__all__ = ["churn_args", "churn"]

TASK = "flodl_worker.examples.synthetic"
# The full campaign: minutes of training on 6 ranks (+2 joining), a fault every ~10 s.
FULL = dict(ranks=6, join_ranks=2, samples=12288, epochs=50, batch_size=32, base_ms=20.0, every=10.0,
            heartbeat=1.0, liveness_timeout=4.0, join_wait=60.0, kinds=",".join(plan.KINDS))  # fmt: skip
# --quick: 4 ranks, a kill or a stop every ~2.5 s, short timeouts (a joining host would
# not have started yet); the two runs' process start-up is most of its wall time.
QUICK = dict(ranks=4, join_ranks=1, samples=2048, epochs=12, batch_size=32, base_ms=20.0, every=2.5,
             heartbeat=0.5, liveness_timeout=2.0, join_wait=5.0, kinds="kill9_rank,sigstop_rank")  # fmt: skip


def churn_args(ap) -> None:
    g = ap.add_argument_group("--churn")
    g.add_argument("--quick", action="store_true", help="--churn: a short campaign (4 ranks, a fault every ~2.5 s)")
    g.add_argument("--seed", type=int, default=1, help="--churn: the fault schedule's seed")
    g.add_argument("--kinds", default=None,
                   help=f"--churn: fault kinds, of {','.join(plan.KINDS)} (default all; quick the first two)")
    g.add_argument("--every", type=float, default=None, help="--churn: seconds between faults (10; quick 2.5)")
    g.add_argument("--join-ranks", type=int, default=None, help="--churn: ranks of the joining host (2; quick 1)")
    g.add_argument("--samples", type=int, default=None, help="--churn: synthetic samples per epoch (12288; quick 2048)")
    g.add_argument("--batch-size", type=int, default=None, help="--churn: samples per step (32)")
    g.add_argument("--heartbeat", type=float, default=None, help="--churn: heartbeat interval s (1; quick 0.5)")
    g.add_argument("--liveness-timeout", type=float, default=None, help="--churn: liveness timeout s (4; quick 2)")
    g.add_argument("--join-wait", type=float, default=None,
                   help="--churn: a leave waits this long at most for the joined host to train (60; quick 5): "
                   "starting a rank takes ~30 s on a loaded 2-core machine")
    g.add_argument("--max-restarts", type=int, default=50, help="--churn: each agent's --max-restarts")
    g.add_argument("--keep", default=None, help="--churn: copy the churn run's files (journal, summary, logs) here")


def _resolve(args) -> None:
    base = QUICK if args.quick else FULL
    for k, v in base.items():
        if getattr(args, k, None) is None:  # (--ranks, --epochs, --base-ms: elastic.py's own)
            setattr(args, k, v)
    args.task, args.task_args = TASK, ["--samples", str(args.samples)]
    args.deadline = min(args.timeout, 120.0) if args.quick else args.timeout
    args.kinds = [k for k in str(args.kinds).split(",") if k]
    bad = [k for k in args.kinds if k not in plan.KINDS]
    if bad:
        raise SystemExit(f"unknown fault kinds {bad}; choose from {plan.KINDS}")


def _records(path: Path) -> list[dict]:
    out = []
    for line in path.read_text().splitlines() if path.exists() else ():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue  # a line cut by the end of the run
    return out


def _decisions(records: list[dict]) -> list[tuple[float, int, str]]:
    """(now, rank, reason) of every ForgetRank: the journal replayed through the core."""
    from flodl.core import ForgetRank, RankViolation, from_record, initial_state, step
    from flodl_coordinator.settings import journaled_settings

    settings = journaled_settings(records[0]["settings"], "the run's journal")
    state, out = initial_state(settings.core_config()), []
    for rec in records[1:]:
        if str(rec.get("type", "")).startswith("_"):
            continue  # a service record, not an event
        ev = from_record(rec)
        try:
            state, cmds = step(state, ev)
        except RankViolation:
            continue
        out += [(ev.now, c.rank, c.reason) for c in cmds if isinstance(c, ForgetRank)]
    return out


def _traced(trace: Path) -> dict[int, Counter]:
    per_epoch: dict[int, Counter] = {}
    for f in trace.glob("rank*.trace"):
        for line in f.read_text().splitlines():
            parts = line.split()
            if len(parts) == 2:
                per_epoch.setdefault(int(parts[0]), Counter())[int(parts[1])] += 1
    return per_epoch


def _stall(batches: dict[int, list[float]], ranks: list[int], a: float, b: float) -> float | None:
    if not ranks or b <= a:
        return None
    ts = sorted(t for r in ranks for t in batches[r] if a <= t <= b)
    seq = [a, *ts]
    return round(max((y - x for x, y in zip(seq, seq[1:])), default=b - a), 3)


def _fault_rows(struck, records, batches, rates, decisions, joins, args) -> list[dict]:
    done = [s for s in struck if "t" in s]
    end = max((t for ts in batches.values() for t in ts), default=0.0)
    t_first = next(r["now"] for r in records if r.get("type") in BATCH_RECORDS)
    rows = []
    for i, s in enumerate(done):
        t = s["t"]
        until = done[i + 1]["t"] if i + 1 < len(done) else end
        row = {k: v for k, v in s.items() if k not in ("t", "pid")}
        row["at_s"] = round(t - t_first, 3)
        surv = plan.survivors(batches, t, s.get("ranks", []) if s["kind"] != "join" else [])
        row["survivors"] = surv
        rec = plan.recovery_s(batches, surv, rates, t, until)
        row["recovery_s"] = rec
        row["stall_s"] = _stall(batches, surv, t, t + (rec if rec is not None else until - t) + plan.W)
        # How fast they trained until the next fault, against their full rate: a slow
        # machine (ranks restarting beside them) reads < 1 with no stall.
        full = sum(rates[r] for r in surv) * (until - t)
        trained = sum(plan.count_in(batches[r], t, until) for r in surv)
        row["survivor_rate_after"] = round(trained / full, 2) if full else None
        if s["kind"] != "join":
            dec = [(now, rank, why) for now, rank, why in decisions if rank in s["ranks"] and now >= t]
            first = {}
            for now, rank, why in dec:
                first.setdefault(rank, (now, why))
            row["detection_s"] = round(max(now for now, _ in first.values()) - t, 3) if first else None
            row["decisions"] = sorted({why for _, why in first.values()})
        if s["kind"] in ("kill9_rank", "sigstop_rank", "join"):
            came = {}  # each struck rank's next hello after the fault (its restart, or the joiner)
            for j in joins:
                if j["rank"] in s["ranks"] and j["hello_at"] > t:
                    came.setdefault(j["rank"], j)
            row["rejoined"] = [{"rank": j["rank"], "fault_to_hello_s": round(j["hello_at"] - t, 3),
                                "hello_to_seeded_s": j["hello_to_seeded_s"],
                                "hello_to_first_commit_s": j["hello_to_first_commit_s"]}
                               for j in came.values()]  # fmt: skip
        rows.append(row)
    return rows


def _analyse(args, run_out: dict, d: Path) -> dict:
    records = _records(d / "journal.jsonl")
    summary = json.loads((d / "summary.json").read_text()) if (d / "summary.json").exists() else {}
    cov = summary.get("coverage", [])
    batches = plan.batch_times(records)
    rates = plan.full_rates(batches)
    decisions = _decisions(records) if records else []
    joins = plan.join_times(records)
    expected = cov[0]["expected"] if cov else args.samples
    audit = plan.trace_audit(_traced(d / "trace"), expected, args.epochs)
    # A stopped rank woken after it was forgotten trains on until it finds out: thrown away.
    zombie = sum(s.get("trained_after_cont", 0) for s in run_out["struck"])
    deaths = sum(1 for _, _, why in decisions if "Shutdown" not in why and "cleanly" not in why)
    out = {
        "ok": summary.get("ok"), "reason": summary.get("reason"), "coordinator_exit": run_out.get("coordinator_exit"),
        "agent_exits": run_out.get("agent_exits"), "hang": run_out["hang"],
        "loadavg_start": run_out["loadavg_start"], "loadavg_end": run_out["loadavg_end"],
        "leftover_rank_processes": run_out["leftover_rank_processes"],
        "epochs_committed": len(cov), "samples_lost": sum(c["missing"] for c in cov),
        "samples_doubled": sum(c["duplicates"] for c in cov), "discarded_samples": summary.get("discarded_samples"),
        "traces": {**audit, "explained_up_to": (summary.get("discarded_samples") or 0) + args.batch_size * deaths
                   + zombie},
        "goodput": plan.goodput(records, summary), "deaths_decided": deaths,
        "full_rate_batches_per_s": {r: round(v, 1) for r, v in sorted(rates.items())},
        "joins": len(summary.get("elastic", {}).get("joins", [])),
    }  # fmt: skip
    if run_out["struck"]:
        out["faults"] = _fault_rows(run_out["struck"], records, batches, rates, decisions, joins, args)
        out["not_struck"] = Counter(s["skipped"] for s in run_out["struck"] if "skipped" in s)
        out["join_times"] = joins
    return out


def _one(args, faults: list[plan.Fault], keep: str | None) -> dict:
    with tempfile.TemporaryDirectory(prefix="flodl-churn-") as tmp:
        d = Path(tmp)
        t0 = time.monotonic()
        try:
            run_out = ChurnRun(args, d, faults).run()
        except RuntimeError as e:  # a broken run is reported, with the log's tail
            return {"ok": False, "error": str(e), "log_tail": (d / "processes.log").read_text()[-3000:]}
        res = _analyse(args, run_out, d)
        res["bench_wall_s"] = round(time.monotonic() - t0, 1)
        if keep:  # the run's files, for a look after the fact
            import shutil

            shutil.copytree(d, Path(keep), dirs_exist_ok=True)
        return res


def _by_kind(rows: list[dict]) -> dict:
    out = {}
    for kind in plan.KINDS:
        mine = [r for r in rows if r["kind"] == kind]
        if not mine:
            continue
        rec = [r["recovery_s"] for r in mine if r["recovery_s"] is not None]
        det = [r["detection_s"] for r in mine if r.get("detection_s") is not None]
        out[kind] = {
            "n": len(mine), "recovered": len(rec),
            "recovery_s_median": round(statistics.median(rec), 3) if rec else None,
            "recovery_s_max": max(rec) if rec else None,
            "detection_s_median": round(statistics.median(det), 3) if det else None,
        }  # fmt: skip
    return out


def churn(args) -> dict:
    _resolve(args)
    t0 = time.monotonic()
    base = _one(args, [], None)
    count = int(args.deadline / args.every) + 1  # more than the run lasts: the rest are not struck
    faults = plan.draw_schedule(args.seed, count, args.every, args.kinds)
    run = _one(args, faults, args.keep)
    if "error" in base or "error" in run:
        return {"bench": "elastic", "mode": "churn", "ok": False, "baseline": base, "churn": run}
    rows = run.get("faults", [])
    kills = [r["recovery_s"] for r in rows if r["kind"] == "kill9_rank"]
    goal = 2 * args.heartbeat
    g_b, g_c = base["goodput"]["samples_per_s"], run["goodput"]["samples_per_s"]
    clean = lambda r: (r["ok"] is True and r["coordinator_exit"] == 0 and not r["hang"] and r["samples_lost"] == 0
                       and r["samples_doubled"] == 0 and r["traces"]["never_trained"] == 0
                       and r["traces"]["trained_again"] <= r["traces"]["explained_up_to"])  # fmt: skip
    config = {k: getattr(args, k) for k in ("quick", "seed", "kinds", "every", "ranks", "join_ranks", "samples",
                                            "epochs", "batch_size", "base_ms", "heartbeat", "liveness_timeout",
                                            "max_restarts", "join_wait", "policy")}  # fmt: skip
    return {
        "bench": "elastic", "mode": "churn", "config": config,
        "goodput_ratio": round(g_c / g_b, 3) if g_b and g_c else None,
        "samples_lost": run["samples_lost"], "samples_doubled": run["samples_doubled"],
        "faults_struck": len(rows), "by_kind": _by_kind(rows),
        "kill9_recovery_goal_s": goal,
        "kill9_within_goal": sum(1 for x in kills if x is not None and x <= goal), "kill9_faults": len(kills),
        "baseline": base, "churn": run,
        "ok": clean(base) and clean(run),
        "bench_wall_s": round(time.monotonic() - t0, 1),
        "note": "one machine, loopback; rates and seconds carry the machine's load (see uptime)",
    }  # fmt: skip
