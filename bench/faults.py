"""Fault bench: how fast a real local run notices a dead rank, and what the fault costs.

Each run is a real cluster on this machine -- coordinator, relay, ranks (torch, the
digits task, emulated speeds) -- with one fault struck at the victim rank once it has
trained ``--strike-samples`` samples (its own trace file; progress, not a clock). Kinds:

* ``kill9_agent``: SIGKILL; the host agent sees the child end and reports it at once
  (``RankExitReported``, reason "killed by signal 9").
* ``kill9_no_agent``: SIGKILL of a rank started *without* an agent (coordinator, relay
  and ranks started by this script, as a user without ``flodl-worker agent`` would):
  nobody reports the exit and the relay hides the broken connection, so only heartbeat
  staleness (``--liveness-timeout``) can tell.
* ``sigstop``: SIGSTOP under the agent: the process is alive but silent (a hang), so again
  only the heartbeat. The stopped process is SIGKILLed once the coordinator forgot it.
* ``kill9_coordinator``: SIGKILL of the *coordinator* (ranks under the agent), struck once
  its journal holds ``--kill-batches`` reported batches (``BatchDone``/``BatchesDone``) (progress, not a clock), and
  restarted at once with the same command line and journal (systemd's
  ``Restart=on-failure``): it replays the journal, rebinds the run's endpoint, and the
  ranks resync with the new incarnation. No rank is struck; ``--victim`` is unused.

Measured per run, all on CLOCK_MONOTONIC (``time.monotonic`` is system-wide on Linux, and
the coordinator's journal stamps every event's ``now`` with it):

* ``detection_s``: the fault -> the event whose step made the core forget the victim
  (found by replaying the coordinator's journal through ``flodl.core``);
* ``resume_s``: the fault -> the first ``BatchDone`` of a survivor after that decision;
* ``survivor_stall_s``: the longest gap in the survivors' merged batch stream between
  the fault and that resume (what the fault cost the survivors; ``baseline_gap_s`` is the
  median gap of that stream in the seconds before the fault, for scale);
* ``survivor_batches_before_decision``: batches survivors trained after the fault and
  before the decision (Cadence windows keep them busy for a while);
* ``missing`` / ``duplicates``: committed coverage from the run summary (must be 0/0);
  ``discarded_samples``: trained by the victim in windows never folded, handed back.

For ``kill9_coordinator`` instead (same clock; ``t_kill`` is just before the SIGKILL):

* ``restart_s``: the kill -> the new coordinator's ``COORDINATOR_READY`` line read here
  (``restart_first_event_s``: -> the first event it journaled, its ``CoordinatorRestarted``);
* ``resume_s``: the kill -> the first ``BatchDone`` journaled by the new coordinator
  (it processes training again; it may be a frame a rank queued during the outage);
* ``rank_gap_s``: the largest gap in any rank's stream of batch steps that overlaps
  [kill, resume] (``rank_gap_rank``: whose; ``rank_baseline_gap_s``: that rank's median
  gap in the 2 s before the kill, for scale). The ranks' trace files carry no times, so
  a thread here stamps each growth of ``rank<R>.trace`` (one flushed write per batch),
  polling every ``TRACE_POLL_S``: the gaps are good to about that much;
  ``batches_trained_during_outage``: steps of all ranks between the kill and READY;
* ``replayed_events``: the journal's events the new process replayed before READY;
* ``resynced_batches``: batches the ranks reported in their ``RankResynced`` (trained
  while the coordinator was down, or reports that died with it);
* ``coverage`` per epoch (``duplicates`` / ``missing``: must be 0/0), ``run_ok``,
  ``ranks_lost`` (replaying the journal, every ForgetRank but a clean leave: must be
  empty), ``rank_phases`` (the summary's: LEFT), ``coordinator_restarts`` (the
  summary's rows: exactly one).

Prints one JSON object: per kind the median over ``--reps`` runs and every run.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from benchproc import JournalTail, start_ready
from flodl.core import BATCH_RECORDS, BatchDone, BatchesDone, ForgetRank, RankViolation, batches_in, from_record, initial_state, step
from flodl_coordinator.settings import Settings, journaled_settings
from flodl_worker.agent import AgentConfig, rank_env

KINDS = ("kill9_agent", "kill9_no_agent", "sigstop", "kill9_coordinator")
TRACE_POLL_S = 0.002  # the trace watcher's period (kill9_coordinator's rank gaps)
TASK = "flodl_worker.examples.digits"
PY = sys.executable


class Run:
    """One cluster: the processes, their logs, and when the coordinator forgot the victim."""

    def __init__(self, args, kind: str, workdir: Path) -> None:
        self.args, self.kind, self.dir = args, kind, workdir
        self.session = "bench-" + secrets.token_hex(4)
        self.trace = workdir / "trace"
        self.trace.mkdir()
        self.journal = workdir / "journal.jsonl"
        self.summary = workdir / "summary.json"
        self.procs: list[subprocess.Popen] = []
        self.ranks: list[subprocess.Popen] = []
        self.relay = self.agent = None
        self.forgotten = threading.Event()
        self.log = open(workdir / "processes.log", "w")
        self.steps: dict[int, list[float]] = {}  # rank -> monotonic times its trace grew
        self.done = threading.Event()
        self.t_ready: float | None = None  # the restarted coordinator's READY line

    # -- processes ----------------------------------------------------------------------

    def start(self) -> None:
        a = self.args
        cmd = [
            PY, "-m", "flodl_coordinator", "serve", "--bind", "tcp://127.0.0.1:0", "--session", self.session,
            "--world-size", str(a.ranks), "--epochs", str(a.epochs), "--batch-size", str(a.batch_size),
            "--policy", a.policy, "--liveness-timeout-s", str(a.liveness_timeout),
            "--summary", str(self.summary), "--journal", str(self.journal),
        ]  # fmt: skip
        self.coord_cmd = cmd
        endpoint = self._start_coordinator()
        if self.kind == "kill9_coordinator":
            threading.Thread(target=self._watch_traces, daemon=True).start()
        if self.kind == "kill9_no_agent":
            self._start_bare(endpoint)
        else:
            self._start_agent(endpoint)

    def _start_coordinator(self) -> str:
        """Start the coordinator (``self.coord_cmd``, the same for a restart); its endpoint."""
        coord, endpoint = start_ready(self.coord_cmd, self.log)
        self.procs.append(coord)
        self.coord = coord
        threading.Thread(target=self._watch_coordinator, args=(coord,), daemon=True).start()
        threading.Thread(target=self._copy, args=(coord.stdout,), daemon=True).start()
        return endpoint

    def _watch_traces(self) -> None:
        """Stamp every growth of each rank's trace file (one flushed write per batch)."""
        size: dict[int, int] = {}
        while not self.done.is_set():
            t = time.monotonic()
            for r in range(self.args.ranks):
                try:
                    n = os.stat(self.trace / f"rank{r}.trace").st_size
                except OSError:
                    continue
                if n > size.get(r, 0):
                    size[r] = n
                    self.steps.setdefault(r, []).append(t)
            time.sleep(TRACE_POLL_S)  # the ranks' files are all there is to watch

    def _ready(self, stream, token: str) -> str:
        for line in iter(stream.readline, ""):
            if line.startswith(token):
                return line.split()[1]
            self.log.write(line)
        raise RuntimeError(f"no {token} line; see {self.log.name}")

    def _copy(self, stream) -> None:
        for line in iter(stream.readline, ""):
            self.log.write(line)

    def _watch_coordinator(self, coord: subprocess.Popen) -> None:
        mark = f"rank {self.args.victim} forgotten"
        for line in iter(coord.stderr.readline, ""):
            self.log.write("[coordinator] " + line)
            if mark in line:
                self.forgotten.set()

    def _agent_config(self, endpoint: str) -> AgentConfig:
        a = self.args
        return AgentConfig(
            coordinator=endpoint, ranks=a.ranks, command=(PY, "-m", TASK), world_size=a.ranks,
            session=self.session, slowdown=tuple(a.slow), base_ms=a.base_ms, trace_dir=str(self.trace),
        )  # fmt: skip

    def _start_agent(self, endpoint: str) -> None:
        a = self.args
        cmd = [
            PY, "-m", "flodl_worker", "agent", "--coordinator", endpoint, "--ranks", str(a.ranks),
            "--rank-offset", "0", "--world-size", str(a.ranks), "--session", self.session, "--slowdown", a.slowdown,
            "--base-ms", str(a.base_ms), "--trace-dir", str(self.trace), "--", PY, "-m", TASK,
        ]  # fmt: skip
        self.agent = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        self.procs.append(self.agent)

    def _start_bare(self, endpoint: str) -> None:
        bind = f"ipc://{self.dir}/relay.sock"
        cmd = [PY, "-m", "flodl_worker", "relay", "--coordinator", endpoint, "--bind", bind]
        self.relay = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self.log, text=True, bufsize=1)
        self.procs.append(self.relay)
        front = self._ready(self.relay.stdout, "RELAY_READY")
        threading.Thread(target=self._copy, args=(self.relay.stdout,), daemon=True).start()
        cfg = self._agent_config(endpoint)
        for local in range(self.args.ranks):
            env = rank_env(cfg, local, front, dict(os.environ))
            p = subprocess.Popen([PY, "-m", TASK], env=env, stdout=self.log, stderr=subprocess.STDOUT)
            self.ranks.append(p)
            self.procs.append(p)

    def victim_pid(self) -> int | None:
        if self.ranks:
            return self.ranks[self.args.victim].pid
        want = {f"FLODL_TRACE_DIR={self.trace}".encode(), f"FLODL_RANK={self.args.victim}".encode()}
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                env = set(Path(f"/proc/{entry}/environ").read_bytes().split(b"\0"))
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
            except OSError:
                continue
            if want <= env and TASK.encode() in cmdline:
                return int(entry)
        return None

    # -- the fault ------------------------------------------------------------------------

    def strike(self) -> tuple[float, int]:
        """Wait for the victim's progress, then strike; returns (monotonic time, pid)."""
        path = self.trace / f"rank{self.args.victim}.trace"
        deadline = time.monotonic() + self.args.deadline
        while time.monotonic() < deadline:
            if _lines(path) >= self.args.strike_samples:
                pid = self.victim_pid()
                if pid is not None:
                    sig = signal.SIGSTOP if self.kind == "sigstop" else signal.SIGKILL
                    t = time.monotonic()
                    os.kill(pid, sig)
                    return t, pid
            if self.coord.poll() is not None:
                raise RuntimeError(f"the run ended before the strike; see {self.log.name}")
            time.sleep(0.005)  # polling another process's progress: nothing to wait on
        raise RuntimeError(f"rank {self.args.victim} never traced {self.args.strike_samples} samples")

    def strike_coordinator(self) -> tuple[float, int]:
        """Once the journal reports ``--kill-batches`` batches, kill -9 the
        coordinator and start it again at once on the same command line and journal;
        returns (monotonic time of the kill, the killed pid)."""
        want, seen = self.args.kill_batches, 0
        tail = JournalTail(self.journal, marker=b'"type": "Batch')
        deadline = time.monotonic() + self.args.deadline
        while time.monotonic() < deadline:
            seen += sum(batches_in(rec) for rec in tail.new())
            if seen >= want:
                old = self.coord
                t = time.monotonic()
                old.send_signal(signal.SIGKILL)
                old.wait(timeout=30)  # reaped: its socket and journal handle are gone
                self._start_coordinator()  # returns on its READY line
                self.t_ready = time.monotonic()
                return t, old.pid
            if self.coord.poll() is not None:
                raise RuntimeError(f"the run ended before {want} batches were journaled; see {self.log.name}")
            time.sleep(0.005)  # polling another process's progress: nothing to wait on
        raise RuntimeError(f"the journal never reported {want} batches")

    def finish(self, pid: int) -> int:
        a = self.args
        if self.kind == "sigstop":  # reap the hung process once the coordinator let it go
            self.forgotten.wait(a.liveness_timeout + 60)
            _signal(pid, signal.SIGKILL)
        return self.coord.wait(timeout=a.deadline)  # its summary and journal say it all

    def stop(self) -> None:
        self.done.set()
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
        self.log.close()


def _lines(path: Path) -> int:
    try:
        with open(path, "rb") as fh:
            return sum(1 for _ in fh)
    except OSError:
        return 0


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


# -- analysis -------------------------------------------------------------------------------


def analyse(journal: Path, summary: dict, victim: int, t_fault: float) -> dict:
    """Replay the journal through the core: when was the victim forgotten, and what did
    the survivors' batch stream do around it."""
    records = [json.loads(line) for line in journal.read_text().splitlines() if line.strip()]
    settings = journaled_settings(records[0]["settings"], str(journal))
    state = initial_state(settings.core_config())
    decided_at, reason = None, None
    survivor = []
    for rec in records[1:]:
        if str(rec.get("type", "")).startswith("_"):
            continue  # a service record (restart, ...), not an event
        ev = from_record(rec)
        if isinstance(ev, (BatchDone, BatchesDone)) and ev.rank != victim:
            survivor.append(ev.now)
        if decided_at is not None:
            continue
        try:
            state, cmds = step(state, ev)
        except RankViolation:
            continue
        for c in cmds:
            if isinstance(c, ForgetRank) and c.rank == victim:
                decided_at, reason = ev.now, c.reason
    survivor.sort()
    out: dict = {"decision_reason": reason}
    if decided_at is not None:
        out["detection_s"] = decided_at - t_fault
        after = [t for t in survivor if t > decided_at]
        before = [t for t in survivor if t <= t_fault]
        if after:
            resume = after[0]
            out["resume_s"] = resume - t_fault
            seq = before[-1:] + [t for t in survivor if t_fault < t <= resume]
            out["survivor_stall_s"] = max((b - a for a, b in zip(seq, seq[1:])), default=0.0)
        recent = [t for t in before if t >= t_fault - 2.0]
        gaps = [b - a for a, b in zip(recent, recent[1:])]
        out["baseline_gap_s"] = statistics.median(gaps) if gaps else None
        out["survivor_batches_before_decision"] = sum(1 for t in survivor if t_fault < t <= decided_at)
    cov = summary.get("coverage", [])
    out["missing"] = sum(c["missing"] for c in cov)
    out["duplicates"] = sum(c["duplicates"] for c in cov)
    out["discarded_samples"] = summary.get("discarded_samples")
    out["run_ok"] = summary.get("ok")
    dead = [r for r in summary.get("ranks", []) if r["rank"] == victim]
    out["victim_phase"] = dead[0]["phase"] if dead else None
    out["epochs_completed"] = summary.get("epochs_completed")
    return out


def analyse_coordinator(journal: Path, summary: dict, steps: dict[int, list[float]], t_kill: float,
                        t_ready: float) -> dict:  # fmt: skip
    """The coordinator's outage from its journal (one monotonic clock across both
    processes on this host), the ranks' step streams around it, and the run's outcome."""
    records = [json.loads(line) for line in journal.read_text().splitlines() if line.strip()]
    i = next(k for k, r in enumerate(records) if r.get("type") == "_restart")
    before, after = records[:i], [r for r in records[i + 1 :] if "now" in r]
    out: dict = {"restart_s": t_ready - t_kill}
    done = [r for r in before if r.get("type") in BATCH_RECORDS]
    out["kill_batches"] = sum(batches_in(r) for r in done)
    out["kill_epoch"] = (done[-1]["epoch"] if "epoch" in done[-1] else done[-1]["batches"][-1]["epoch"]) if done else None
    out["replayed_events"] = records[i].get("replayed_events")  # what the restart replayed
    out["last_event_before_kill_s"] = t_kill - max(r["now"] for r in before if "now" in r)
    if after:
        out["restart_first_event_s"] = after[0]["now"] - t_kill
    resume = next((r["now"] for r in after if r.get("type") in BATCH_RECORDS), None)
    if resume is not None:
        out["resume_s"] = resume - t_kill
    out["resynced_batches"] = sum(len(r.get("batches", ())) for r in after if r.get("type") == "RankResynced")
    # Replay everything through the core: a restart must not cost a rank (leaving at
    # the end of the run is a ForgetRank too, with one of these reasons).
    settings = journaled_settings(records[0]["settings"], str(journal))
    state, lost = initial_state(settings.core_config()), []
    left = ("exited cleanly", "exited after Shutdown")
    for rec in records[1:]:
        if str(rec.get("type", "")).startswith("_"):
            continue
        ev = from_record(rec)
        try:
            state, cmds = step(state, ev)
        except RankViolation:
            continue
        lost += [f"{c.rank}: {c.reason}" for c in cmds if isinstance(c, ForgetRank) and c.reason not in left]
    out["ranks_lost"] = lost
    # Each rank's batch steps: the largest gap overlapping [kill, resume].
    end = resume if resume is not None else t_ready
    worst = None
    for rank, ts in sorted(steps.items()):
        for a, b in zip(ts, ts[1:]):
            if b > t_kill and a < end and (worst is None or b - a > worst[0]):
                worst = (b - a, rank)
    if worst is not None:
        out["rank_gap_s"], out["rank_gap_rank"] = worst
        base = [t for t in steps[worst[1]] if t_kill - 2.0 <= t <= t_kill]
        gaps = [b - a for a, b in zip(base, base[1:])]
        out["rank_baseline_gap_s"] = statistics.median(gaps) if gaps else None
    out["batches_trained_during_outage"] = sum(1 for ts in steps.values() for t in ts if t_kill < t <= t_ready)
    cov = summary.get("coverage", [])
    out["coverage"] = [{k: c[k] for k in ("epoch", "duplicates", "missing")} for c in cov]
    out["missing"] = sum(c["missing"] for c in cov)
    out["duplicates"] = sum(c["duplicates"] for c in cov)
    out["run_ok"] = summary.get("ok")
    out["epochs_completed"] = summary.get("epochs_completed")
    out["rank_phases"] = sorted({r["phase"] for r in summary.get("ranks", [])})
    out["coordinator_restarts"] = summary.get("coordinator_restarts")
    return out


def one_run(args, kind: str) -> dict:
    with tempfile.TemporaryDirectory(prefix=f"flodl-fault-{kind}-") as d:
        run = Run(args, kind, Path(d))
        try:
            run.start()
            if kind == "kill9_coordinator":
                t_fault, pid = run.strike_coordinator()
            else:
                t_fault, pid = run.strike()
            rc = run.finish(pid)
        except Exception as e:  # a bench reports a broken run instead of dying on it
            run.stop()
            tail = (Path(d) / "processes.log").read_text()[-1500:]
            return {"error": f"{type(e).__name__}: {e}", "log_tail": tail}
        run.stop()
        if not run.summary.exists():
            return {"error": f"no summary (coordinator exit {rc})"}
        summary = json.loads(run.summary.read_text())
        try:
            if kind == "kill9_coordinator":
                res = analyse_coordinator(run.journal, summary, run.steps, t_fault, run.t_ready)
            else:
                res = analyse(run.journal, summary, args.victim, t_fault)
        except Exception as e:
            return {"error": f"journal analysis failed: {type(e).__name__}: {e}"}
        res["coordinator_exit"] = rc
        return _rounded(res)


def _rounded(v):
    if isinstance(v, float):
        return round(v, 4)
    if isinstance(v, dict):
        return {k: _rounded(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_rounded(x) for x in v]
    return v


def _median(runs: list[dict], key: str):
    vals = [r[key] for r in runs if isinstance(r.get(key), (int, float))]
    return round(statistics.median(vals), 4) if vals else None


NUMERIC = ("detection_s", "resume_s", "survivor_stall_s", "baseline_gap_s", "survivor_batches_before_decision",
           "discarded_samples")  # fmt: skip
NUMERIC_COORDINATOR = ("restart_s", "restart_first_event_s", "resume_s", "rank_gap_s", "rank_baseline_gap_s",
                       "batches_trained_during_outage", "resynced_batches", "last_event_before_kill_s")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated subset of {','.join(KINDS)}")
    p.add_argument("--reps", type=int, default=2, help="runs per kind (median reported; default 2)")
    p.add_argument("--ranks", type=int, default=3)
    p.add_argument("--victim", type=int, default=1, help="the rank struck (default 1)")
    p.add_argument("--policy", default="cadence", choices=("cadence", "sync"))
    p.add_argument("--slowdown", default="1,1,2")
    p.add_argument("--base-ms", type=float, default=10.0)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--liveness-timeout", type=float, default=3.0, help="seconds of silence = dead (default 3)")
    p.add_argument("--strike-samples", type=int, default=200, help="victim's trained samples before the strike")
    p.add_argument("--kill-batches", type=int, default=135,
                   help="kill9_coordinator: batches reported in the journal before the kill (default 135: mid epoch 1)")
    p.add_argument("--deadline", type=float, default=300.0, help="give up on one run after this many seconds")
    args = p.parse_args(argv)
    args.slow = [float(x) for x in args.slowdown.split(",")]
    kinds = [k for k in args.kinds.split(",") if k]
    bad = [k for k in kinds if k not in KINDS]
    if bad:
        p.error(f"unknown kinds {bad}; choose from {KINDS}")
    t0 = time.monotonic()
    result: dict = {
        "bench": "faults",
        "config": {k: getattr(args, k) for k in ("reps", "ranks", "victim", "policy", "slowdown", "base_ms",
                                                 "epochs", "batch_size", "liveness_timeout", "strike_samples",
                                                 "kill_batches")},
        "kinds": {},
    }  # fmt: skip
    result["config"]["heartbeat_interval_s"] = Settings().heartbeat_interval_s
    for kind in kinds:
        runs = [one_run(args, kind) for _ in range(args.reps)]
        ok = [r for r in runs if "error" not in r]
        if kind == "kill9_coordinator":
            result["kinds"][kind] = {
                "median": {k: _median(ok, k) for k in NUMERIC_COORDINATOR},
                "max_missing": max((r["missing"] for r in ok), default=None),
                "max_duplicates": max((r["duplicates"] for r in ok), default=None),
                "all_ok": bool(ok) and len(ok) == len(runs) and all(r.get("run_ok") is True for r in ok),
                "ranks_lost": sorted({x for r in ok for x in r.get("ranks_lost", [])}),
                "rank_phases": sorted({x for r in ok for x in r.get("rank_phases", [])}),
                "restarts_per_run": [len(r.get("coordinator_restarts") or []) for r in ok],
                "runs": runs,
            }
            continue
        result["kinds"][kind] = {
            "median": {k: _median(ok, k) for k in NUMERIC},
            "max_missing": max((r["missing"] for r in ok), default=None),
            "max_duplicates": max((r["duplicates"] for r in ok), default=None),
            "decision_reasons": sorted({r.get("decision_reason") or "none" for r in ok}),
            "runs": runs,
        }
    result["bench_wall_s"] = round(time.monotonic() - t0, 1)
    print(json.dumps(result, indent=2, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
