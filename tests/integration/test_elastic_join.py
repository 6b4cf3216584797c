"""Elastic membership with real processes (issue 12): ranks join a running world.

(a) A 2-rank world that a second agent's two ranks join mid-run -- that agent pins no
    rank: the coordinator numbers them, the free slots 2 and 3: every epoch committed
    exactly once (summary and the ranks' own traces), all four final digests identical,
    and the epochs after the join are faster than before it.
(b) kill -9 a rank under an agent with ``--max-restarts 2``: its restarted process takes
    the slot again (seeded with the consensus), trains, and coverage stays exact.
(c) the same on the collective plane (gloo): the survivors re-form without the killed
    rank, its restart is admitted and joins a new generation that includes it, seeded by
    a broadcast from the store host; it trains; coverage exact, digests identical.

The first ranks are slowed (``--slowdown``) so the run is still training when the late
processes are up -- on a loaded machine a rank's start (torch import) takes seconds; the
tests wait for the joins by the coordinator's own words, never by a clock.
"""

import json
import signal
import subprocess
import sys
import time

import pytest

from faults import strike_after
from runlocal import (ROOT, alarming, assert_committed_once_despite_a_death, assert_exact_coverage, free_port, output_of,
                      unreported_by)

pytestmark = pytest.mark.integration

DIGITS_TRAIN = 1437
BATCH = 16


def _wait_for(path, text, proc, deadline_s=180.0):
    t_end = time.monotonic() + deadline_s
    while time.monotonic() < t_end:
        if text in path.read_text():
            return
        assert proc.poll() is None, f"coordinator exited before {text!r}:\n{path.read_text()[-3000:]}"
        time.sleep(0.1)  # polling another process's log; nothing to wait on
    raise AssertionError(f"never saw {text!r}")


def _agent(endpoint, tmp_path, name, *args):
    cmd = [
        sys.executable, "-m", "flodl_worker", "agent", "--coordinator", endpoint, "--session", "elastic",
        "--world-size", "4", "--trace-dir", str(tmp_path / "trace"), "--base-ms", "1", *args,
        "--", sys.executable, "-m", "flodl_worker.examples.digits",
    ]  # fmt: skip
    log = open(tmp_path / f"{name}.log", "w")
    return subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)


def test_two_ranks_of_a_second_agent_join_a_running_world(tmp_path):
    port = free_port()
    endpoint = f"tcp://127.0.0.1:{port}"
    summary, coord_log = tmp_path / "summary.json", tmp_path / "coordinator.log"
    (tmp_path / "trace").mkdir()
    coord = subprocess.Popen(
        [
            sys.executable, "-m", "flodl_coordinator", "serve", "--bind", endpoint, "--session", "elastic",
            "--max-ranks", "4", "--min-ranks", "2", "--join-timeout", "0", "--epochs", "20",
            "--batch-size", str(BATCH), "--policy", "cadence", "--summary", str(summary),
        ],  # fmt: skip
        cwd=ROOT, stdout=open(coord_log, "w"), stderr=subprocess.STDOUT,
    )
    procs = [coord]
    try:
        procs.append(_agent(endpoint, tmp_path, "first", "--ranks", "2", "--rank-offset", "0", "--slowdown", "60"))
        _wait_for(coord_log, "world_formed", coord)  # the quorum formed the world: it trains
        # ... and trained an epoch on its own: the throughput the joiners add is measured
        # against it (forked ranks come up in under a second: started at the formation,
        # they joined inside epoch 0, and no epoch was left without them).
        _wait_for(coord_log, "epoch 1/20", coord)
        # No --rank-offset: its ranks are numbered by the coordinator, the lowest free slots.
        procs.append(_agent(endpoint, tmp_path, "second", "--ranks", "2", "--slowdown", "1"))
        assert coord.wait(timeout=300) == 0, coord_log.read_text()[-4000:]
        for p in procs[1:]:
            assert p.wait(timeout=60) == 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    data = json.loads(summary.read_text())
    log = coord_log.read_text()
    assert data["ok"] is True, data["reason"]
    el = data["elastic"]
    assert el["formed_with"] == [0, 1] and el["vacant"] == []
    assert sorted(j["rank"] for j in el["joins"]) == [2, 3] and not any(j["refill"] for j in el["joins"])
    assert "rank 2 seeded with the consensus of cycle" in log and "rank 3 seeded with the consensus of cycle" in log
    second = (tmp_path / "second.log").read_text()
    assert "admitted as rank 2" in second and "admitted as rank 3" in second, second[-3000:]
    assert data["bus"]["seeds_sent"] == 2 and data["bus"]["seed_bytes"] > 0
    assert_exact_coverage(data, tmp_path / "trace", 20, DIGITS_TRAIN)
    digests = {r["param_digest"] for r in data["ranks"]}
    assert len(digests) == 1 and "" not in digests, data["ranks"]
    assert all(r["samples"] > 0 for r in data["ranks"]), data["ranks"]
    # Throughput rises: the epochs the joiners trained in are faster than those before.
    before = [e["epoch_ms"] for e in data["epochs"] if not any(e["per_rank_throughput"][2:])]
    after = [e["epoch_ms"] for e in data["epochs"] if all(e["per_rank_throughput"][2:])]
    assert before and after, data["epochs"]
    assert sum(after) / len(after) < sum(before) / len(before), (before, after)
    bad = alarming(log)
    assert not bad, bad  # joins are news, not warnings


def _killed_and_restarted(tmp_path, slowdown, *args):
    """``flodl run --local``, 3 digits ranks, rank 1 (the fast one) killed -9 after 64
    traced samples under ``--max-restarts 2``; returns (summary, launcher output)."""
    summary, trace = tmp_path / "summary.json", tmp_path / "trace"
    trace.mkdir()
    cmd = [
        # The victim is fast, the others slow: while it is away the run crawls (it outlasts
        # the restart), and once it is back it trains most of the rest.
        sys.executable, "-m", "flodl", "run", "--local", "--ranks", "3", "--task", "digits", "--slowdown", slowdown,
        "--base-ms", "1", "--batch-size", str(BATCH), "--policy", "cadence", "--max-restarts", "2",
        "--max-failure", "2", "--summary", str(summary), "--trace-dir", str(trace),
        "--log-level", "INFO",  # the restart and the join are INFO lines (the launcher shows WARNING and up by default)
        *args,
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    out = output_of(proc, timeout=300, before=lambda: strike_after(trace, 1, 64, signal.SIGKILL))
    assert proc.returncode == 0, out[-4000:]
    data = json.loads(summary.read_text())
    assert data["ok"] is True, data["reason"]
    (join,) = data["elastic"]["joins"]
    assert (join["rank"], join["refill"], join["restart_count"]) == (1, True, 1)  # FLODL_RESTART_COUNT=1
    back = data["ranks"][1]
    assert back["phase"] == "LEFT" and back["steps"] > 0, back  # the new process trained, then left cleanly
    assert "restarting it in" in out and "rank_joined" in out
    assert_committed_once_despite_a_death(data, trace, DIGITS_TRAIN, unreported_by(data, trace, 1))
    digests = {r["param_digest"] for r in data["ranks"]}
    assert len(digests) == 1 and "" not in digests, data["ranks"]
    return data, out


def test_a_killed_rank_restarted_by_its_agent_rejoins_and_trains(tmp_path):
    _killed_and_restarted(tmp_path, "40,1,40", "--epochs", "30")


def test_a_killed_rank_restarted_by_its_agent_rejoins_the_collective_group(tmp_path):
    # Slower peers, fewer epochs: the crawl while the victim is away outlasts a restart
    # that takes 20 s on a loaded machine (torch import); after it, the victim trains fast.
    data, out = _killed_and_restarted(tmp_path, "80,1,80", "--plane", "collective", "--epochs", "10")
    col = data["collective"]
    # 1: the world; 2: the survivors; 3: with the restarted rank, which it seeded.
    assert (col["generation"], col["members"], col["seeds"], col["failures"]) == (3, [0, 1, 2], 1, 0), col
    assert "collective_generation: generation=3 joiners=[1] members=[0, 1, 2]" in out
    assert "joined the running world: parameters and buffers from the generation 3 broadcast" in out
    assert data["ranks"][1]["samples"] > 0
