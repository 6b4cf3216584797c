"""One real churn run: a coordinator, two host agents, and the faults of a schedule.

The processes (all on this machine, loopback): a coordinator with a journal and the
capacity for ``ranks + join_ranks`` ranks (quorum ``ranks``), two agents holding the
first ``ranks`` ranks between them (``--max-restarts``), and -- while a ``join`` fault
holds -- a third agent with ``join_ranks`` more. ``ChurnRun.run`` starts them, strikes
the schedule's faults (``churn_plan.draw_schedule``; none for the baseline) at their
times after the world's first batch, waits for the run's end and for every agent to
exit, and returns what it saw; ``churn_plan`` measures it.

Which ranks train now is read from the journal as it grows (a thread follows it): a
fault strikes only a rank that trained in the last ``PRE_S`` seconds, so it does not
strike a rank still restarting, and a stopped rank is ended in its own thread so the
schedule goes on meanwhile.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from benchproc import JournalTail, start_ready
from flodl.core import BATCH_RECORDS
from churn_plan import PRE_S, Fault, pick_victim

PY = sys.executable
ROOT = Path(__file__).resolve().parents[1]
AGENT_EXIT_S = 60.0  # after the coordinator's exit, an agent still running this long is a hang


def _signal(pid: int, sig: int) -> bool:
    try:
        os.kill(pid, sig)
        return True
    except ProcessLookupError:
        return False


def _loadavg() -> list[float]:
    return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]


def _lines(path: Path) -> int:
    try:
        with open(path, "rb") as fh:
            return sum(1 for _ in fh)
    except OSError:
        return 0


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def _rank_pid(trace: Path, task: str, rank: int) -> int | None:
    """The pid of rank ``rank``'s current process (its environment names our trace dir)."""
    want = {f"FLODL_TRACE_DIR={trace}".encode(), f"FLODL_RANK={rank}".encode()}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes()
            env = set(Path(f"/proc/{entry}/environ").read_bytes().split(b"\0"))
        except OSError:
            continue
        if task.encode() in cmd and want <= env and _state(int(entry)) not in ("Z", "gone"):
            return int(entry)
    return None


class ChurnRun:
    """The processes of one run and what happened to them, on one monotonic clock."""

    def __init__(self, args, workdir: Path, faults: list[Fault]) -> None:
        self.args, self.dir, self.faults = args, workdir, faults
        self.session = "churn-" + secrets.token_hex(4)
        self.trace = workdir / "trace"
        self.trace.mkdir()
        self.journal = workdir / "journal.jsonl"
        self.summary = workdir / "summary.json"
        self.log = open(workdir / "processes.log", "w", buffering=1)
        self.lock = threading.Lock()
        self.last_batch: dict[int, float] = {}  # rank -> its latest BatchDone's now
        self.first_batch: float | None = None
        self.forgotten: dict[int, float] = {}  # rank -> when the coordinator logged it forgotten (latest)
        self.agents: list[tuple[str, subprocess.Popen]] = []
        self.joiner: subprocess.Popen | None = None
        self.coord: subprocess.Popen | None = None
        self.struck: list[dict] = []
        self.threads: list[threading.Thread] = []
        self.stopped: set[int] = set()  # ranks SIGSTOPped and not yet ended
        self.done = threading.Event()

    # -- processes ----------------------------------------------------------------------

    def _coordinator(self) -> subprocess.Popen:
        a = self.args
        cmd = [
            PY, "-m", "flodl_coordinator", "serve", "--bind", "tcp://127.0.0.1:0", "--session", self.session,
            "--world-size", str(a.ranks + a.join_ranks), "--min-ranks", str(a.ranks), "--join-timeout", "0",
            "--epochs", str(a.epochs), "--batch-size", str(a.batch_size), "--policy", a.policy,
            "--heartbeat-interval-s", str(a.heartbeat), "--liveness-timeout-s", str(a.liveness_timeout),
            "--form-timeout-s", "300", "--summary", str(self.summary), "--journal", str(self.journal),
        ]  # fmt: skip
        coord, self.endpoint = start_ready(cmd, self.log, cwd=ROOT)
        self._thread(self._watch_coordinator, coord.stderr)
        self._thread(self._copy, coord.stdout, "[coordinator] ")
        return coord

    def _agent(self, name: str, ranks: int, offset: int) -> subprocess.Popen:
        a = self.args
        cmd = [
            PY, "-m", "flodl_worker", "agent", "--coordinator", self.endpoint, "--session", self.session,
            "--ranks", str(ranks), "--rank-offset", str(offset), "--world-size", str(a.ranks + a.join_ranks),
            "--host", name, "--slowdown", "1", "--base-ms", str(a.base_ms), "--trace-dir", str(self.trace),
            "--max-restarts", str(a.max_restarts), "--", PY, "-m", a.task, *a.task_args,
        ]  # fmt: skip
        p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
        self._thread(self._copy, p.stdout, f"[{name}] ")
        self.agents.append((name, p))
        return p

    def _thread(self, fn, *args) -> None:
        t = threading.Thread(target=fn, args=args, daemon=True)
        t.start()
        self.threads.append(t)

    def _copy(self, stream, tag: str) -> None:
        for line in iter(stream.readline, ""):
            self.log.write(tag + line)

    def _watch_coordinator(self, stream) -> None:
        for line in iter(stream.readline, ""):
            self.log.write("[coordinator] " + line)
            if " forgotten: " in line:
                rank = int(line.split("rank ", 1)[1].split()[0])
                with self.lock:
                    self.forgotten[rank] = time.monotonic()

    def _follow_journal(self) -> None:
        """Keep ``last_batch`` current: the journal is the run's own record of progress."""
        tail = JournalTail(self.journal, marker=b'"type": "Batch')
        while not self.done.is_set():
            for rec in tail.new():
                if rec.get("type") in BATCH_RECORDS:
                    with self.lock:
                        self.last_batch[rec["rank"]] = rec["now"]
                        if self.first_batch is None:
                            self.first_batch = rec["now"]
            time.sleep(0.05)  # following another process's file: nothing to wait on

    def training(self) -> list[int]:
        now = time.monotonic()
        with self.lock:
            return sorted(r for r, t in self.last_batch.items() if now - t <= PRE_S and r not in self.stopped)

    # -- faults ---------------------------------------------------------------------------

    def _strike(self, fault: Fault) -> dict:
        a = self.args
        rec: dict = {"kind": fault.kind, "planned_at_s": fault.at_s}
        if fault.kind == "join":
            rec["t"] = time.monotonic()
            rec["ranks"] = list(range(a.ranks, a.ranks + a.join_ranks))
            self.joiner = self._agent(f"join{len(self.struck)}", a.join_ranks, a.ranks)
            return rec
        if fault.kind == "leave":
            if self.joiner is None:
                return {**rec, "skipped": "no joined host"}
            # A host that leaves has trained first, for half a fault interval (its first
            # commits are its join time); one still starting after ``join_wait`` s leaves
            # all the same. The rest of the schedule waits as long.
            joined = list(range(a.ranks, a.ranks + a.join_ranks))
            t_wait = time.monotonic()
            trained_at = None
            while time.monotonic() < t_wait + a.join_wait and self.coord.poll() is None:
                if trained_at is None and set(joined) <= set(self.training()):
                    trained_at = time.monotonic()
                if trained_at is not None and time.monotonic() >= trained_at + a.every / 2:
                    break
                time.sleep(0.05)  # waiting on the joined ranks' progress (the journal)
            rec["waited_for_joiners_s"] = round(time.monotonic() - t_wait, 3)
            if self.coord.poll() is not None:
                return {**rec, "skipped": "the run had ended"}
            rec["joiners_trained"] = set(joined) <= set(self.training())
            rec["t"] = time.monotonic()
            rec["ranks"] = joined
            self.joiner.send_signal(signal.SIGTERM)
            self.joiner = None
            return rec
        training = self.training()
        if len(training) - 1 < max(1, a.ranks // 2):  # the campaign churns a world, it does not end it
            return {**rec, "skipped": "too few ranks training"}
        victim = pick_victim(fault, training)
        pid = None if victim is None else _rank_pid(self.trace, a.task, victim)
        if pid is None:
            return {**rec, "skipped": "no rank training", "victim": victim}
        rec.update(victim=victim, ranks=[victim], pid=pid)
        rec["t"] = time.monotonic()
        if fault.kind == "kill9_rank":
            _signal(pid, signal.SIGKILL)
        else:
            _signal(pid, signal.SIGSTOP)
            with self.lock:
                self.stopped.add(victim)
            rec["then"] = fault.then
            self._thread(self._end_stop, victim, pid, rec)
        return rec

    def _end_stop(self, victim: int, pid: int, rec: dict) -> None:
        """Once the coordinator forgot the stopped rank (heartbeat), SIGCONT or SIGKILL it."""
        t_end = rec["t"] + self.args.liveness_timeout + 30
        while time.monotonic() < t_end and not self.done.is_set():
            with self.lock:
                if self.forgotten.get(victim, 0.0) > rec["t"]:
                    break
            time.sleep(0.05)  # waiting on another process's decision, read from its log
        rec["ended_after_s"] = round(time.monotonic() - rec["t"], 3)
        trace = self.trace / f"rank{victim}.trace"
        before = _lines(trace)
        _signal(pid, signal.SIGCONT if rec["then"] == "cont" else signal.SIGKILL)
        with self.lock:
            self.stopped.discard(victim)
        if rec["then"] == "cont":  # what it trains on, forgotten, until it finds out (its traces say)
            t_end = time.monotonic() + self.args.liveness_timeout + 30
            while Path(f"/proc/{pid}").exists() and _state(pid) != "Z" and time.monotonic() < t_end:
                time.sleep(0.05)  # waiting for another process to end
            rec["cont_lived_s"] = round(time.monotonic() - rec["t"] - rec["ended_after_s"], 3)
            rec["trained_after_cont"] = _lines(trace) - before

    # -- the run --------------------------------------------------------------------------

    def run(self) -> dict:
        a = self.args
        coord = self.coord = self._coordinator()
        self._thread(self._follow_journal)
        half = a.ranks // 2
        self._agent("hostA", half, 0)
        self._agent("hostB", a.ranks - half, half)
        out: dict = {"hang": [], "loadavg_start": _loadavg()}
        try:
            deadline = time.monotonic() + a.deadline
            while self.first_batch is None and coord.poll() is None and time.monotonic() < deadline:
                if all(p.poll() is not None for _, p in self.agents):
                    raise RuntimeError(f"every agent exited before the world's first batch; see {self.log.name}")
                time.sleep(0.05)  # the world forms on its own time
            t0 = self.first_batch
            if t0 is None:
                raise RuntimeError(f"no batch within {a.deadline:g} s; see {self.log.name}")
            shift = 0.0  # a leave that waited for its host to train delays the rest as much
            for fault in self.faults:
                while coord.poll() is None and time.monotonic() < t0 + fault.at_s + shift:
                    time.sleep(0.02)  # the schedule's clock
                if coord.poll() is not None:
                    self.struck.append({"kind": fault.kind, "planned_at_s": fault.at_s, "skipped": "the run had ended"})
                    continue
                self.struck.append(self._strike(fault))
                shift += self.struck[-1].get("waited_for_joiners_s", 0.0)
            try:
                coord.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                out["hang"].append("coordinator")
            out["coordinator_exit"] = coord.poll()
            end = time.monotonic() + AGENT_EXIT_S
            for name, p in self.agents:
                try:
                    p.wait(timeout=max(0.1, end - time.monotonic()))
                except subprocess.TimeoutExpired:
                    out["hang"].append(name)
            out["agent_exits"] = {name: p.poll() for name, p in self.agents}
        finally:
            self.done.set()
            for _, p in [("coordinator", coord), *self.agents]:
                if p.poll() is None:
                    p.kill()
            # A rank still running now (a stopped one too) never outlives the bench.
            leftovers = [pid for r in range(a.ranks + a.join_ranks) if (pid := _rank_pid(self.trace, a.task, r))]
            for pid in leftovers:
                _signal(pid, signal.SIGKILL)
            out["leftover_rank_processes"] = len(leftovers)
            for t in self.threads:
                t.join(timeout=5)
            self.log.close()
        out["loadavg_end"] = _loadavg()
        out["first_batch"] = self.first_batch
        out["struck"] = self.struck
        return out
