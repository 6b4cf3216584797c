"""Real processes, real faults: kill -9 and SIGSTOP a rank mid-run.

Each run must still finish, and every epoch's committed coverage must be exactly once.
The ranks' own trace files are the independent audit: every sample appears, and any
sample trained more than once was trained by the dead rank in a window that was never
folded (the summary's ``discarded`` count bounds it).
"""

import random
import signal
import subprocess
import sys
import threading

import pytest

from faults import kill_quietly, strike_after
from runlocal import ROOT, traced_counts, traced_samples

pytestmark = pytest.mark.integration

TRAIN = 1437
BATCH = 16


def _launch(tmp_path, extra):
    summary = tmp_path / "summary.json"
    trace = tmp_path / "trace"
    trace.mkdir()
    cmd = [
        sys.executable, "-m", "flodl", "run", "--local", "--ranks", "4", "--task", "digits",
        "--slowdown", "1,1,2,2", "--base-ms", "3", "--epochs", "2", "--batch-size", str(BATCH),
        "--summary", str(summary), "--trace-dir", str(trace), *extra,
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    return proc, summary, trace


def _finish(proc, summary):
    import json

    out, _ = proc.communicate(timeout=240)
    assert proc.returncode == 0, out[-4000:]
    return json.loads(summary.read_text()), out


def _check(summary, trace, victim):
    for c in summary["coverage"]:
        assert (c["expected"], c["trained"], c["duplicates"], c["missing"]) == (TRAIN, TRAIN, 0, 0), c
    dead = [r for r in summary["ranks"] if r["rank"] == victim][0]
    assert dead["phase"] == "DEAD", dead
    seen = traced_counts(trace)
    for e, counts in seen.items():
        assert len(counts) == TRAIN, f"epoch {e}: a sample was never trained"
    extra = sum(n - 1 for counts in seen.values() for n in counts.values())
    # Trained twice = trained by the victim and never committed: what it reported and
    # the coordinator discarded, plus what it trained and never reported -- the batches
    # its last report frame had not carried yet (batch_report_ms), the one it traced as
    # it died. The coordinator cannot know the second part: the victim's own trace does.
    unreported = traced_samples(trace, victim) - dead["samples"]
    assert 0 <= unreported <= 64 * BATCH, (unreported, dead)  # a report frame holds at most 64 batches
    assert extra <= summary["discarded_samples"] + unreported, (extra, summary["discarded_samples"], unreported)
    survivors = {r["param_digest"] for r in summary["ranks"] if r["rank"] != victim}
    assert len(survivors) == 1


@pytest.mark.parametrize("seed, policy", [(3, "sync"), (17, "cadence"), (5, "cadence")])
def test_kill9_a_rank_mid_epoch(tmp_path, seed, policy):
    rng = random.Random(seed)
    victim, at = rng.randrange(4), rng.randrange(40, 300)
    proc, summary, trace = _launch(tmp_path, ["--policy", policy])
    struck = strike_after(trace, victim, at, signal.SIGKILL)
    data, out = _finish(proc, summary)
    _check(data, trace, victim)
    dead = [r for r in data["ranks"] if r["rank"] == victim][0]
    assert dead["reason"] == "killed by signal 9", dead["reason"]
    assert struck["at_samples"] >= at


def test_sigstop_a_rank_is_declared_dead_by_heartbeat(tmp_path):
    proc, summary, trace = _launch(tmp_path, ["--policy", "sync", "--liveness-timeout", "3"])
    struck = strike_after(trace, 2, 100, signal.SIGSTOP)
    # The stopped process must not outlive the run (the agent waits for its children).
    reaper = threading.Timer(20.0, kill_quietly, args=(struck["pid"],))
    reaper.start()
    try:
        data, out = _finish(proc, summary)
    finally:
        reaper.cancel()
        kill_quietly(struck["pid"])
    _check(data, trace, 2)
    dead = [r for r in data["ranks"] if r["rank"] == 2][0]
    assert "heartbeat" in dead["reason"], dead["reason"]
