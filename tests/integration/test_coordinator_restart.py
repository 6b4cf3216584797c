"""Real processes: kill -9 the coordinator mid-epoch, start it again on its journal.

The restarted coordinator rebuilds its state by replaying the journal, the ranks hear
its new incarnation and resync, and the run finishes as if nothing happened: every
epoch's samples committed exactly once (the summary), every sample trained exactly once
(the ranks' own traces: a batch whose report died with the old process is recovered from
the rank, never trained again), and every rank ends on the same parameters.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from faults import kill_quietly
from runlocal import ROOT, free_port, traced_counts

pytestmark = pytest.mark.integration

TRAIN = 1437  # load_digits, 80% train split
BATCH = 16


def _journal(path: Path) -> list[dict]:
    try:
        text = path.read_text()
    except OSError:
        return []
    out = []
    for line in text.split("\n"):
        try:
            out.append(json.loads(line))
        except ValueError:
            continue  # empty, or the line being written
    return out


def _wait_for(cond, what: str, deadline_s: float = 90.0, proc=None):
    """Poll another process's progress (a file), not a clock."""
    t_end = time.monotonic() + deadline_s
    while time.monotonic() < t_end:
        got = cond()
        if got:
            return got
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"{what}: the process exited ({proc.returncode}) first")
        time.sleep(0.02)
    raise AssertionError(f"never: {what}")


class _Run:
    def __init__(self, tmp_path: Path, policy: str):
        self.port = free_port()
        self.session = f"restart-{os.getpid()}-{policy}"
        self.journal = tmp_path / "run.journal"
        self.summary = tmp_path / "summary.json"
        self.trace = tmp_path / "trace"
        self.trace.mkdir()
        self.coord_cmd = [
            sys.executable, "-m", "flodl_coordinator", "serve",
            "--bind", f"tcp://127.0.0.1:{self.port}", "--session", self.session,
            "--world-size", "3", "--epochs", "2", "--batch-size", str(BATCH), "--policy", policy,
            "--liveness-timeout-s", "10", "--summary", str(self.summary), "--journal", str(self.journal),
        ]  # fmt: skip
        self.logs: list[str] = []
        self.procs: list[subprocess.Popen] = []

    def _pump(self, proc, tag):
        for line in iter(proc.stdout.readline, ""):
            self.logs.append(f"[{tag}] {line.rstrip()}")

    def start_coordinator(self, tag: str) -> subprocess.Popen:
        p = subprocess.Popen(self.coord_cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.procs.append(p)
        threading.Thread(target=self._pump, args=(p, tag), daemon=True).start()
        return p

    def start_agent(self) -> subprocess.Popen:
        cmd = [
            sys.executable, "-m", "flodl_worker", "agent",
            "--coordinator", f"tcp://127.0.0.1:{self.port}", "--ranks", "3", "--world-size", "3",
            "--session", self.session, "--slowdown", "1,1,2", "--base-ms", "3", "--trace-dir", str(self.trace),
            "--", sys.executable, "-m", "flodl_worker.examples.digits",
        ]  # fmt: skip
        p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.procs.append(p)
        threading.Thread(target=self._pump, args=(p, "agent"), daemon=True).start()
        return p

    def batches(self) -> int:
        return sum(1 for r in _journal(self.journal) if r.get("type") == "BatchDone")

    def tail(self) -> str:
        return "\n".join(self.logs[-120:])

    def stop_all(self):
        for p in self.procs:
            if p.poll() is None:
                kill_quietly(p.pid)


def _resume_gap(journal: list[dict]) -> tuple[float, float | None]:
    """Seconds from the last event journaled before the kill to the restarted
    coordinator's first event, and to its first batch report (None: no batch was left),
    in the coordinators' own event times (one monotonic clock)."""
    i = next(k for k, r in enumerate(journal) if r.get("type") == "_restart")
    before = max(r["now"] for r in journal[:i] if "now" in r)
    after = [r for r in journal[i + 1 :] if "now" in r]
    batch = next((r["now"] for r in after if r["type"] == "BatchDone"), None)
    return after[0]["now"] - before, None if batch is None else batch - before


@pytest.mark.parametrize("policy, kill_at", [("cadence", 50), ("sync", 120)])
def test_kill9_the_coordinator_mid_epoch_and_restart_it(tmp_path, policy, kill_at):
    run = _Run(tmp_path, policy)
    try:
        coord = run.start_coordinator("coordinator-1")
        agent = run.start_agent()
        _wait_for(lambda: run.batches() >= kill_at, f"{kill_at} batches journaled", proc=coord)
        coord.send_signal(signal.SIGKILL)
        coord.wait(timeout=10)
        assert coord.returncode == -signal.SIGKILL
        # systemd's Restart=on-failure: the same command line, the same journal.
        coord2 = run.start_coordinator("coordinator-2")
        rc = coord2.wait(timeout=120)
        assert rc == 0, run.tail()
        assert agent.wait(timeout=60) == 0, run.tail()
    finally:
        run.stop_all()
    summary = json.loads(run.summary.read_text())
    assert summary["ok"] is True, summary["reason"]
    cov = summary["coverage"]
    assert [c["epoch"] for c in cov] == [0, 1]
    for c in cov:
        assert (c["expected"], c["trained"], c["duplicates"], c["missing"]) == (TRAIN, TRAIN, 0, 0), c
    seen = traced_counts(run.trace)
    assert sorted(seen) == [0, 1]
    for e, counts in seen.items():
        assert len(counts) == TRAIN, f"epoch {e}: a sample was never trained"
        assert set(counts.values()) == {1}, f"epoch {e}: a sample was trained twice"
    digests = {r["param_digest"] for r in summary["ranks"]}
    assert len(digests) == 1 and "" not in digests, summary["ranks"]
    assert all(r["phase"] == "LEFT" for r in summary["ranks"]), summary["ranks"]
    (restart,) = summary["coordinator_restarts"]
    assert sorted(restart["resynced"]) == [0, 1, 2], restart
    journal = _journal(run.journal)
    assert sum(r.get("type") == "_start" for r in journal) == 1
    assert sum(r.get("type") == "_restart" for r in journal) == 1
    back, batch = _resume_gap(journal)
    print(f"\n{policy}: kill -9 after {kill_at} batches journaled; the restarted coordinator's first "
          f"event came {back:.2f}s after the last one of the killed process, its first BatchDone after "
          f"{batch if batch is None else round(batch, 2)}s; {restart}")  # fmt: skip
    # The journal with the restart in it replays to the same finished run.
    out = subprocess.run(
        [sys.executable, "-m", "flodl_coordinator", "replay", str(run.journal)],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    rep = json.loads(out.stdout)
    assert rep["finished"] and rep["ok"]
    assert rep["summary"]["coverage"] == cov
    assert rep["summary"]["global_step"] == summary["global_step"]
