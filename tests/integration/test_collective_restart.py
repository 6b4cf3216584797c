"""Real processes, collective plane: kill -9 the coordinator mid-epoch, start it again on
its journal (``flodl-coordinator serve --plane collective --journal J``).

The restarted coordinator replays the journal, abandons the open round and announces a
new process-group generation (``flodl.core._collective``: a restart re-forms the group
among the alive ranks); each rank, on hearing the new incarnation, sends its resync and
abandons its pending collective work (``flodl_worker.collective``), then builds the new
generation's group. The run finishes as if nothing happened: every epoch's samples
committed exactly once (summary) and trained exactly once (the ranks' own traces), every
rank on the same parameters, and the journal replays to the same finished run.
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

TRAIN = 1024  # the synthetic task (quick start: no dataset import)
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


def _wait_for(cond, what: str, proc, deadline_s: float = 60.0):
    """Poll another process's progress (its journal), not a clock."""
    t_end = time.monotonic() + deadline_s
    while time.monotonic() < t_end:
        if cond():
            return
        if proc.poll() is not None:
            raise AssertionError(f"{what}: the process exited ({proc.returncode}) first")
        time.sleep(0.01)
    raise AssertionError(f"never: {what}")


class _Run:
    def __init__(self, tmp_path: Path, policy: str):
        self.port = free_port()
        self.session = f"crestart-{os.getpid()}-{policy}"
        self.journal = tmp_path / "run.journal"
        self.summary = tmp_path / "summary.json"
        self.trace = tmp_path / "trace"
        self.trace.mkdir()
        self.coord_cmd = [
            sys.executable, "-m", "flodl_coordinator", "serve",
            "--bind", f"tcp://127.0.0.1:{self.port}", "--session", self.session, "--plane", "collective",
            "--world-size", "3", "--epochs", "2", "--batch-size", str(BATCH), "--policy", policy,
            "--liveness-timeout-s", "10", "--summary", str(self.summary), "--journal", str(self.journal),
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
        cmd = [
            sys.executable, "-m", "flodl_worker", "agent",
            "--coordinator", f"tcp://127.0.0.1:{self.port}", "--ranks", "3", "--world-size", "3",
            "--session", self.session, "--slowdown", "1,2,4", "--base-ms", "2", "--trace-dir", str(self.trace),
            "--", sys.executable, "-m", "flodl_worker.examples.synthetic",
            "--samples", str(TRAIN), "--test-samples", "256", "--hidden", "32",
        ]  # fmt: skip
        return self._start(cmd, "agent")

    def tail(self) -> str:
        return "\n".join(self.logs[-150:])

    def stop_all(self):
        for p in self.procs:
            if p.poll() is None:
                kill_quietly(p.pid)


def _acked_cycles(journal: Path) -> set[int]:
    return {r["cycle"] for r in _journal(journal) if r.get("type") == "SyncAcked"}


def _resume_gap(journal: list[dict]) -> tuple[float, float | None]:
    """Seconds from the killed process's last event to the restarted one's first event,
    and to its first batch report (None: no batch was left), in the journal's times."""
    i = next(k for k, r in enumerate(journal) if r.get("type") == "_restart")
    before = max(r["now"] for r in journal[:i] if "now" in r)
    after = [r for r in journal[i + 1 :] if "now" in r]
    batch = next((r["now"] for r in after if r["type"] == "BatchDone"), None)
    return after[0]["now"] - before, None if batch is None else batch - before


@pytest.mark.parametrize("policy", ["cadence", "sync"])
def test_kill9_the_coordinator_on_the_collective_plane_and_restart_it(tmp_path, policy):
    run = _Run(tmp_path, policy)
    try:
        coord = run.start_coordinator("coordinator-1")
        agent = run.start_agent()
        # Strike while the group of generation 1 is live and reducing: right after a
        # second cycle was acked by someone (the next round is about to open or open).
        _wait_for(lambda: any(c >= 2 for c in _acked_cycles(run.journal)), "cycle 2 acked", coord)
        coord.send_signal(signal.SIGKILL)
        coord.wait(timeout=10)
        assert coord.returncode == -signal.SIGKILL
        coord2 = run.start_coordinator("coordinator-2")  # systemd: same command, same journal
        rc = coord2.wait(timeout=90)
        assert rc == 0, run.tail()
        assert agent.wait(timeout=60) == 0, run.tail()
    finally:
        run.stop_all()
    (tmp_path / "out.txt").write_text("\n".join(run.logs))  # kept for a post-mortem
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
    col = summary["collective"]
    # The restart re-formed the group among the same ranks as a new generation.
    assert col["generation"] >= 2 and col["reforms"] >= 1 and sorted(col["members"]) == [0, 1, 2], col
    assert summary["bus"]["rounds"] == 0
    journal = _journal(run.journal)
    assert sum(r.get("type") == "_restart" for r in journal) == 1
    back, batch = _resume_gap(journal)
    print(f"\n{policy}: the restarted coordinator's first event came {back:.2f}s after the killed one's "
          f"last, its first BatchDone after {batch if batch is None else round(batch, 2)}s; {restart}; {col}")  # fmt: skip
    out = subprocess.run(
        [sys.executable, "-m", "flodl_coordinator", "replay", str(run.journal)],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    rep = json.loads(out.stdout)
    assert rep["finished"] and rep["ok"]
    assert rep["summary"]["coverage"] == cov
    assert rep["summary"]["global_step"] == summary["global_step"]
    assert rep["summary"]["collective"] == col
