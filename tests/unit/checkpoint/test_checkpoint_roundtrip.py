"""Save path end to end: service + two real rank processes, checkpoints committed.

The core decides the checkpoints (``checkpoint_every=1``): after each aggregated epoch
it sends ``Checkpoint{version, role, cycle}`` to the role rank and emits the
``checkpoint_meta`` notice. The shell stamps a staging path, the role rank saves the
consensus it holds, the shell joins the meta and commits. The last checkpoint must
hold the run's final parameters exactly.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading

import pytest
import torch

from flodl_coordinator.checkpoints import load_checkpoint
from flodl_coordinator.service import CoordinatorService
from flodl_coordinator.settings import load_settings

SESSION = "ckpt-roundtrip"
SYNTHETIC = ("--samples", "64", "--test-samples", "32", "--features", "8", "--classes", "3", "--hidden", "16")


@pytest.mark.integration
def test_consensus_checkpoints_commit_and_hold_the_final_parameters(tmp_path):
    ck_dir = tmp_path / "ck"
    settings = load_settings(env={}, flags={
        "world_size": 2, "bind": "tcp://127.0.0.1:0", "session": SESSION, "epochs": 2, "seed": 5,
        "batch_size": 16, "policy": "sync", "liveness_timeout_s": 30.0, "final_eval": False,
        "checkpoint_dir": str(ck_dir), "checkpoint_every": 1, "checkpoint_keep": 2, "summary": str(tmp_path / "summary.json"),
    })  # fmt: skip
    ready, box = threading.Event(), {}
    svc = CoordinatorService(settings, ready=lambda ep: (box.setdefault("ep", ep), ready.set()))
    t = threading.Thread(target=lambda: box.setdefault("rc", svc.run(install_signals=False)), daemon=True)
    t.start()
    assert ready.wait(10)
    procs = []
    try:
        for r in range(2):
            env = dict(os.environ, FLODL_RANK=str(r), FLODL_WORLD_SIZE="2", FLODL_CONNECT=box["ep"],
                       FLODL_SESSION=SESSION, OMP_NUM_THREADS="1")  # fmt: skip
            cmd = [sys.executable, "-m", "flodl_worker.examples.synthetic", *SYNTHETIC]
            procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
        t.join(120)
        assert not t.is_alive(), "the run did not finish"
    finally:
        svc.request_stop()
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(10)
    assert box["rc"] == 0, [p.stderr.read().decode()[-2000:] for p in procs]
    summary = json.loads((tmp_path / "summary.json").read_text())
    cks = summary["checkpoints"]
    assert cks["failed"] == [] and len(cks["committed"]) == 2  # one per epoch
    versions = [c["version"] for c in cks["committed"]]
    assert versions[-1] == summary["averages"] and versions[0] < versions[-1]
    assert sorted(n for n in os.listdir(ck_dir) if not n.startswith(".")) == [
        f"ckpt-{v:08d}" for v in versions
    ] + ["latest"]  # keep=2
    assert os.listdir(ck_dir / ".staging") == []

    latest = load_checkpoint(str(ck_dir))
    assert latest.meta["version"] == summary["averages"] and latest.meta["model"]["rank"] == 0
    model = torch.load(latest.model_path, map_location="cpu", weights_only=True)["model"]
    digest = hashlib.sha256(b"".join(v.to(torch.float32).numpy().astype("<f4").tobytes() for v in model.values()))
    assert {r["param_digest"] for r in summary["ranks"]} == {digest.hexdigest()}  # the final consensus
    # The loop meter timed each round's trigger frame (a rank's frame after which the
    # round opened: its decision and its RequestParams to both ranks).
    loop = summary["coordinator_loop"]
    assert loop["round_triggers"] == summary["averages"]
    assert 0.0 < loop["round_trigger_p50_le_ms"] <= loop["round_trigger_p99_le_ms"] <= loop["round_trigger_max_ms"]
