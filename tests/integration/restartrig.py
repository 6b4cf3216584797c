"""A run whose coordinator the test kills and restarts: the shared rig of the restart tests.

The coordinator is started as its own process (systemd-style: a restart is the same
command line on the same journal) next to one agent with three ranks; the test waits on
the journal (another process's progress, not a clock), kills, restarts, then audits the
summary, the ranks' traces and a replay of the journal.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from flodl.core import BATCH_RECORDS
from faults import kill_quietly
from runlocal import ROOT, assert_exact_coverage, free_port

__all__ = ["RestartRun", "wait_for", "resume_gap", "check_restarted_run"]


def wait_for(cond, what: str, proc, deadline_s: float = 90.0):
    """Poll another process's progress (its journal), not a clock."""
    t_end = time.monotonic() + deadline_s
    while time.monotonic() < t_end:
        got = cond()
        if got:
            return got
        if proc.poll() is not None:
            raise AssertionError(f"{what}: the process exited ({proc.returncode}) first")
        time.sleep(0.01)
    raise AssertionError(f"never: {what}")


class RestartRun:
    """Coordinator + one agent with 3 ranks, 2 epochs; logs collected for failures."""

    def __init__(self, tmp_path: Path, policy: str, batch: int, coordinator_args=(), agent_args=()):
        self.port = free_port()
        self.session = f"restart-{os.getpid()}-{policy}"
        self.journal = tmp_path / "run.journal"
        self.summary = tmp_path / "summary.json"
        self.trace = tmp_path / "trace"
        self.trace.mkdir()
        self.coord_cmd = [
            sys.executable, "-m", "flodl_coordinator", "serve",
            "--bind", f"tcp://127.0.0.1:{self.port}", "--session", self.session, *coordinator_args,
            "--world-size", "3", "--epochs", "2", "--batch-size", str(batch), "--policy", policy,
            "--liveness-timeout-s", "10", "--summary", str(self.summary), "--journal", str(self.journal),
        ]  # fmt: skip
        self.agent_cmd = [
            sys.executable, "-m", "flodl_worker", "agent",
            "--coordinator", f"tcp://127.0.0.1:{self.port}", "--ranks", "3", "--rank-offset", "0", "--world-size", "3",
            "--session", self.session, "--trace-dir", str(self.trace), *agent_args,
        ]  # fmt: skip
        self.logs: list[str] = []
        self.procs: list[subprocess.Popen] = []

    def _pump(self, proc, tag):
        for line in iter(proc.stdout.readline, ""):
            self.logs.append(f"[{tag}] {line.rstrip()}")

    def _start(self, cmd, tag) -> subprocess.Popen:
        p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.procs.append(p)
        threading.Thread(target=self._pump, args=(p, tag), daemon=True).start()
        return p

    def start_coordinator(self, tag: str) -> subprocess.Popen:
        return self._start(self.coord_cmd, tag)

    def start_agent(self) -> subprocess.Popen:
        return self._start(self.agent_cmd, "agent")

    def tail(self, n: int = 150) -> str:
        return "\n".join(self.logs[-n:])

    def stop_all(self):
        for p in self.procs:
            if p.poll() is None:
                kill_quietly(p.pid)


def resume_gap(journal: list[dict]) -> tuple[float, float | None]:
    """Seconds from the last event journaled before the kill to the restarted
    coordinator's first event, and to its first batch report (None: no batch was left),
    in the coordinators' own event times (one monotonic clock)."""
    i = next(k for k, r in enumerate(journal) if r.get("type") == "_restart")
    before = max(r["now"] for r in journal[:i] if "now" in r)
    after = [r for r in journal[i + 1 :] if "now" in r]
    batch = next((r["now"] for r in after if r["type"] in BATCH_RECORDS), None)
    return after[0]["now"] - before, None if batch is None else batch - before


def check_restarted_run(run: RestartRun, expected: int) -> tuple[dict, dict, dict]:
    """The audit both restart tests share; returns (summary, the restart record, replay)."""
    summary = json.loads(run.summary.read_text())
    assert summary["ok"] is True, summary["reason"]
    assert_exact_coverage(summary, run.trace, 2, expected)
    digests = {r["param_digest"] for r in summary["ranks"]}
    assert len(digests) == 1 and "" not in digests, summary["ranks"]
    assert all(r["phase"] == "LEFT" for r in summary["ranks"]), summary["ranks"]
    (restart,) = summary["coordinator_restarts"]
    assert sorted(restart["resynced"]) == [0, 1, 2], restart
    # The journal with the restart in it replays to the same finished run.
    out = subprocess.run(
        [sys.executable, "-m", "flodl_coordinator", "replay", str(run.journal)],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    rep = json.loads(out.stdout)
    assert rep["finished"] and rep["ok"]
    assert rep["summary"]["coverage"] == summary["coverage"]
    assert rep["summary"]["global_step"] == summary["global_step"]
    return summary, restart, rep
