"""A world that cannot form ends the run, naming who is missing and why (no hang)."""

import json
import os
import select
import subprocess
import sys
import time

import pytest

from runlocal import ROOT, free_port

pytestmark = pytest.mark.integration


def _rank(port: int, rank: int, world: int) -> subprocess.Popen:
    env = dict(
        os.environ,
        FLODL_RANK=str(rank),
        FLODL_WORLD_SIZE=str(world),
        FLODL_CONNECT=f"tcp://127.0.0.1:{port}",
        FLODL_SESSION="formation",
    )
    cmd = [sys.executable, "-m", "flodl_worker.examples.digits"]
    return subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _said_hello(proc: subprocess.Popen, timeout: float = 120.0) -> str:
    """Read the rank's output until it says nobody answered its hello yet (its torch
    import is behind it, its hello queued on the socket): what it printed so far."""
    seen, deadline = "", time.monotonic() + timeout
    while "no answer yet from the coordinator" not in seen:
        left = deadline - time.monotonic()
        assert left > 0 and select.select([proc.stdout], [], [], left)[0], f"no hello within {timeout}s: {seen[-2000:]}"
        line = proc.stdout.readline()
        assert line, f"the rank exited before its hello: {seen[-2000:]}"
        seen += line
    return seen


def test_a_rank_refused_at_hello_fails_the_run_at_the_formation_deadline(tmp_path):
    port = free_port()
    summary = tmp_path / "summary.json"
    # The ranks first, the coordinator once both are past their start-up: its 8 s deadline
    # then starts with their hellos in hand, however slowly a loaded machine imports torch.
    ranks = [_rank(port, 0, 3), _rank(port, 1, 4)]  # rank 1 names the wrong world size; rank 2 never comes
    early = [_said_hello(r) for r in ranks]
    coord = subprocess.Popen(
        [
            sys.executable, "-m", "flodl_coordinator", "serve", "--bind", f"tcp://127.0.0.1:{port}",
            "--session", "formation", "--world-size", "3", "--form-timeout-s", "8", "--summary", str(summary),
        ],  # fmt: skip
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    t0 = time.monotonic()
    try:
        out, _ = coord.communicate(timeout=90)
        took = time.monotonic() - t0
        rank_out = [e + r.communicate(timeout=60)[0] for e, r in zip(early, ranks)]
    finally:
        for p in [coord, *ranks]:
            if p.poll() is None:
                p.kill()
    assert coord.returncode == 1, out[-3000:]
    assert took < 60, took  # bounded by the deadline (8 s) plus start-up, not a hang
    data = json.loads(summary.read_text())
    assert data["ok"] is False
    reason = data["reason"]
    assert reason.startswith("the world did not form within 8s"), reason
    assert "rank 1: refused: world_size 4 differs from the coordinator's 3" in reason
    assert "rank 2: never said hello" in reason and "(admitted: [0])" in reason
    assert data["dropped_frames"].get("hello_refused", 0) >= 1
    assert "hello refused" in out and "world_size 4 differs" in out  # said when it happened
    assert ranks[1].returncode == 2, rank_out[1][-2000:]  # refused: configuration error
    assert ranks[0].returncode == 0, rank_out[0][-2000:]  # told to leave, left cleanly
