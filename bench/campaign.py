"""Random-fault campaign: many real local runs, one fault each at a random moment.

Each run is a real cluster on this machine -- a coordinator with a journal, one host
agent that starts the relay and the ranks (torch, the digits task, emulated speeds) --
and one fault, drawn with the run's seed:

* ``kill9_rank`` / ``sigstop_rank``: SIGKILL / SIGSTOP of a random rank (a stopped rank is
  SIGKILLed once the coordinator forgot it, so its agent sees it end);
* ``kill9_relay``: SIGKILL of the host's relay (the agent restarts it);
* ``kill9_coordinator``: SIGKILL of the coordinator, started again at once on the same
  command line and journal (what systemd's ``Restart=on-failure`` does).

The moment is drawn too: with probability ``--early`` a random time in the first
seconds after the coordinator is ready -- *before the world forms* (the ranks are still
importing torch or saying hello; ``struck_before_formation`` says whether it really was,
from the coordinator's ``world_formed`` log line) -- else once the victim (rank 0 for
the relay and coordinator faults) has trained a random number of samples.

Per run: ``outcome`` (``completed``: exit 0 and the summary says ok; ``failed``: the run
ended not ok, with its reason; ``hang``: still running at ``--deadline``, then killed),
``lost`` / ``doubled`` (committed coverage from the summary: missing / duplicates summed
over epochs; a completed run must have every epoch), and the fault's details. The
totals line is the campaign's verdict: goal ``completed == runs`` and 0 / 0 / 0.

    python bench/campaign.py --runs 20 --seed 1 > campaign.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from benchproc import start_ready
from faults import _lines, _rounded, _signal

PY = sys.executable
TASK = "flodl_worker.examples.digits"
KINDS = ("kill9_rank", "sigstop_rank", "kill9_relay", "kill9_coordinator")


def _proc_env(pid: int) -> set[bytes]:
    try:
        return set(Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"))
    except OSError:
        return set()


def _children(ppid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == ppid:
                out.append(int(entry))
    return out


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


class Cluster:
    """The processes of one run, and what the coordinator said (with monotonic stamps)."""

    def __init__(self, args, workdir: Path) -> None:
        self.args, self.dir = args, workdir
        self.session = "campaign-" + secrets.token_hex(4)
        self.trace = workdir / "trace"
        self.trace.mkdir()
        self.journal = workdir / "journal.jsonl"
        self.summary = workdir / "summary.json"
        self.log = open(workdir / "processes.log", "w")
        self.lock = threading.Lock()
        self.coord: subprocess.Popen | None = None
        self.agent: subprocess.Popen | None = None
        self.formed_at: float | None = None
        self.forgotten: dict[int, float] = {}
        self.endpoint = ""

    def start(self) -> None:
        a = self.args
        self.coord_cmd = [
            PY, "-m", "flodl_coordinator", "serve", "--bind", "tcp://127.0.0.1:0", "--session", self.session,
            "--world-size", str(a.ranks), "--epochs", str(a.epochs), "--batch-size", str(a.batch_size),
            "--policy", a.policy, "--liveness-timeout-s", str(a.liveness_timeout),
            "--form-timeout-s", str(a.form_timeout), "--summary", str(self.summary), "--journal", str(self.journal),
        ]  # fmt: skip
        self.start_coordinator()
        cmd = [
            PY, "-m", "flodl_worker", "agent", "--coordinator", self.endpoint, "--ranks", str(a.ranks),
            "--rank-offset", "0", "--world-size", str(a.ranks), "--session", self.session, "--slowdown", a.slowdown,
            "--base-ms", str(a.base_ms), "--trace-dir", str(self.trace), *a.agent_args, "--", PY, "-m", TASK,
        ]  # fmt: skip
        self.agent = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)

    def start_coordinator(self) -> None:
        """Start (or restart: the same command line and journal) and wait for READY."""
        coord, self.endpoint = start_ready(self.coord_cmd, self.log)
        self.coord = coord
        threading.Thread(target=self._watch, args=(coord.stderr,), daemon=True).start()
        threading.Thread(target=self._copy, args=(coord.stdout,), daemon=True).start()

    def _copy(self, stream) -> None:
        for line in iter(stream.readline, ""):
            self.log.write(line)

    def _watch(self, stream) -> None:
        for line in iter(stream.readline, ""):
            now = time.monotonic()
            self.log.write("[coordinator] " + line)
            with self.lock:
                if "world_formed" in line and self.formed_at is None:
                    self.formed_at = now
                if " forgotten: " in line:
                    rank = int(line.split("rank ", 1)[1].split()[0])
                    self.forgotten.setdefault(rank, now)

    def admitted(self, rank: int) -> bool:
        """Whether the journal holds an admitted hello of ``rank`` (it said hello)."""
        try:
            text = self.journal.read_text()
        except OSError:
            return False
        return any(f'"rank": {rank},' in line and '"type": "RankHello"' in line for line in text.splitlines())

    def rank_pid(self, rank: int) -> int | None:
        want = {f"FLODL_TRACE_DIR={self.trace}".encode(), f"FLODL_RANK={rank}".encode()}
        for entry in os.listdir("/proc"):
            if entry.isdigit() and TASK.encode() in _cmdline(int(entry)) and want <= _proc_env(int(entry)):
                return int(entry)
        return None

    def relay_pid(self) -> int | None:
        if self.agent is None:
            return None
        kids = [p for p in _children(self.agent.pid) if b"relay" in _cmdline(p)]
        return kids[0] if kids else None

    def stop(self) -> None:
        """Everything this run started, descendants included, is gone after this."""
        pids = []
        for p in (self.agent, self.coord):
            if p is not None:
                pids += _children(p.pid)
        for pid in pids:
            pids += _children(pid)
        for p in (self.agent, self.coord):
            if p is not None and p.poll() is None:
                p.kill()
        for pid in pids:
            _signal(pid, signal.SIGKILL)
        for p in (self.agent, self.coord):
            if p is not None:
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    pass
        self.log.close()


def _strike(c: Cluster, kind: str, victim: int, early: bool, at: float, samples: int, deadline: float) -> dict:
    """Wait for the moment, then strike; returns what was struck and when."""
    t0 = time.monotonic()
    while True:
        now = time.monotonic()
        if now > deadline:
            raise RuntimeError("the moment never came")
        if c.coord.poll() is not None:
            raise RuntimeError(f"the run ended (exit {c.coord.returncode}) before the strike")
        due = (now - t0 >= at) if early else _lines(c.trace / f"rank{victim}.trace") >= samples
        if due:
            if kind == "kill9_coordinator":
                pid = c.coord.pid
            elif kind == "kill9_relay":
                pid = c.relay_pid()
            else:
                pid = c.rank_pid(victim)
            if pid is not None:
                break
        time.sleep(0.005)  # polling other processes' progress: nothing to wait on
    t = time.monotonic()
    with c.lock:
        before_formation = c.formed_at is None
    if kind == "kill9_coordinator":
        old = c.coord
        old.send_signal(signal.SIGKILL)
        old.wait(timeout=30)
        c.start_coordinator()
    else:
        os.kill(pid, signal.SIGSTOP if kind == "sigstop_rank" else signal.SIGKILL)
    if kind == "sigstop_rank":
        # Once the coordinator let it go, end it so its agent sees the exit (and restarts it).
        # A rank stopped before its hello was never known to the coordinator, which cannot
        # forget it: it is ended after liveness_timeout_s, as a watchdog would end a hung
        # process (left alone, the formation deadline fails the run, naming it).
        hung_until = time.monotonic() + c.args.liveness_timeout
        while victim not in c.forgotten and time.monotonic() < deadline and c.coord.poll() is None:
            if before_formation and time.monotonic() >= hung_until and not c.admitted(victim):
                break
            time.sleep(0.05)
        _signal(pid, signal.SIGKILL)
    return {"struck_after_s": round(t - t0, 3), "struck_before_formation": before_formation, "pid": pid}


def one_run(args, i: int) -> dict:
    rng = random.Random(args.seed * 1000 + i)
    kind = rng.choice(args.kinds)
    victim = rng.randrange(args.ranks) if kind.endswith("_rank") else 0
    early = rng.random() < args.early
    at = rng.uniform(0.0, args.early_window)
    samples = rng.randrange(20, args.max_strike_samples)
    res: dict = {"run": i, "kind": kind, "victim": victim, "early": early}
    res.update({"at_s": round(at, 3)} if early else {"at_samples": samples})
    with tempfile.TemporaryDirectory(prefix="flodl-campaign-") as d:
        c = Cluster(args, Path(d))
        deadline = time.monotonic() + args.deadline
        try:
            c.start()
            res.update(_strike(c, kind, victim, early, at, samples, deadline))
            while c.coord.poll() is None and time.monotonic() < deadline:
                time.sleep(0.1)  # the run's own end is what we wait for
            hang = c.coord.poll() is None
            rc = c.coord.returncode
        except Exception as e:  # a campaign reports a broken run instead of dying on it
            c.stop()
            res.update(outcome="error", error=f"{type(e).__name__}: {e}")
            return res
        c.stop()
        if hang:
            res.update(outcome="hang", log_tail=(Path(d) / "processes.log").read_text()[-1500:])
            return res
        summary = json.loads(c.summary.read_text()) if c.summary.exists() else {}
        cov = summary.get("coverage", [])
        ok = rc == 0 and summary.get("ok") is True
        res.update(
            outcome="completed" if ok and len(cov) == args.epochs else "failed",
            coordinator_exit=rc,
            reason=summary.get("reason"),
            lost=sum(x["missing"] for x in cov),
            doubled=sum(x["duplicates"] for x in cov),
            epochs_committed=len(cov),
            coordinator_restarts=len(summary.get("coordinator_restarts") or []),
        )
        if res["outcome"] != "completed":
            res["log_tail"] = (Path(d) / "processes.log").read_text()[-1500:]
        return _rounded(res)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated subset of {','.join(KINDS)}")
    p.add_argument("--ranks", type=int, default=3)
    p.add_argument("--policy", default="cadence", choices=("cadence", "sync", "async"))
    p.add_argument("--slowdown", default="1,1,2")
    p.add_argument("--base-ms", type=float, default=5.0)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--liveness-timeout", type=float, default=5.0)
    p.add_argument("--form-timeout", type=float, default=60.0)
    p.add_argument("--early", type=float, default=0.3, help="share of faults struck in the first seconds")
    p.add_argument("--early-window", type=float, default=4.0, help="an early fault strikes in [0, this] s")
    p.add_argument("--max-strike-samples", type=int, default=700)
    p.add_argument("--agent-arg", dest="agent_args", action="append", default=None,
                   help="argument for the agent (repeat; default --max-restarts=2: a rank that dies before "
                   "the world forms is started again and joins)")
    p.add_argument("--deadline", type=float, default=240.0, help="a run still going after this is a hang")
    args = p.parse_args(argv)
    args.kinds = [k for k in args.kinds.split(",") if k]
    if args.agent_args is None:
        args.agent_args = ["--max-restarts=2"]
    bad = [k for k in args.kinds if k not in KINDS]
    if bad:
        p.error(f"unknown kinds {bad}; choose from {KINDS}")
    t0 = time.monotonic()
    runs = []
    for i in range(args.runs):
        r = one_run(args, i)
        runs.append(r)
        print(json.dumps({k: r.get(k) for k in ("run", "kind", "early", "struck_before_formation", "outcome",
                                                 "lost", "doubled", "reason")}), file=sys.stderr)  # fmt: skip
    totals = {
        "runs": len(runs),
        "completed": sum(r["outcome"] == "completed" for r in runs),
        "failed": sum(r["outcome"] == "failed" for r in runs),
        "hangs": sum(r["outcome"] == "hang" for r in runs),
        "errors": sum(r["outcome"] == "error" for r in runs),
        "samples_lost": sum(r.get("lost", 0) for r in runs),
        "samples_doubled": sum(r.get("doubled", 0) for r in runs),
        "struck_before_formation": sum(bool(r.get("struck_before_formation")) for r in runs),
    }
    config = {k: v for k, v in vars(args).items()}
    out = {"bench": "campaign", "config": config, "totals": totals, "runs": runs,
           "bench_wall_s": round(time.monotonic() - t0, 1)}  # fmt: skip
    print(json.dumps(out, indent=2, sort_keys=True))
    return 0 if totals["completed"] == totals["runs"] and not totals["samples_lost"] and not totals["samples_doubled"] else 1


if __name__ == "__main__":
    sys.exit(main())
