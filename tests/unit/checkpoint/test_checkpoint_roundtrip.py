"""Save path end to end: service + two real rank processes, checkpoints committed.

Until the core decides checkpoints itself, a shim around the service's ``step`` plays
the integrator's part exactly as the checkpoint docs prescribe: at every finished round
it emits ``Checkpoint{version, role, cycle}`` *before* the ``Update``s and the
``checkpoint_meta`` notice. Everything after that is the real thing: the shell stamps
a staging path, the role rank saves the consensus it just applied, the shell joins the
meta and commits. The last checkpoint must hold the run's final parameters exactly.
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

from flodl.core import Notice, Send
from flodl.core._checkpoint import checkpoint_meta
from flodl.wire import pb
from flodl_coordinator import service as service_mod
from flodl_coordinator.checkpoints import load_checkpoint
from flodl_coordinator.service import CoordinatorService
from flodl_coordinator.settings import load_settings

SESSION = "ckpt-roundtrip"
SYNTHETIC = ("--samples", "64", "--test-samples", "32", "--features", "8", "--classes", "3", "--hidden", "16")


def checkpoint_every_round(real_step):
    def step(state, event):
        state, cmds = real_step(state, event)
        out, done = [], False
        for c in cmds:
            if not done and isinstance(c, Send) and c.kind == "update":
                v, role = state.rounds.version, state.alive_ranks()[0]
                ck = pb.Control.Checkpoint(version=v, target_rank=role, cycle=state.rounds.cycle)
                out.append(Send(role, pb.Control(command_id=0, checkpoint=ck)))
                out.append(Notice("checkpoint_meta", {"version": v, "meta": checkpoint_meta(state, v)}))
                done = True
            out.append(c)
        return state, out

    return step


@pytest.mark.integration
def test_consensus_checkpoints_commit_and_hold_the_final_parameters(tmp_path, monkeypatch):
    monkeypatch.setattr(service_mod, "step", checkpoint_every_round(service_mod.step))
    ck_dir = tmp_path / "ck"
    settings = load_settings(env={}, flags={
        "world_size": 2, "bind": "tcp://127.0.0.1:0", "session": SESSION, "epochs": 2, "seed": 5,
        "batch_size": 16, "policy": "sync", "liveness_timeout_s": 30.0, "final_eval": False,
        "checkpoint_dir": str(ck_dir), "checkpoint_keep": 2, "summary": str(tmp_path / "summary.json"),
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
    assert cks["failed"] == [] and len(cks["committed"]) == summary["averages"]
    assert sorted(n for n in os.listdir(ck_dir) if not n.startswith(".")) == [
        f"ckpt-{v:08d}" for v in (summary["averages"] - 1, summary["averages"])
    ] + ["latest"]  # keep=2
    assert os.listdir(ck_dir / ".staging") == []

    latest = load_checkpoint(str(ck_dir))
    assert latest.meta["version"] == summary["averages"] and latest.meta["model"]["rank"] == 0
    model = torch.load(latest.model_path, map_location="cpu", weights_only=True)["model"]
    digest = hashlib.sha256(b"".join(v.to(torch.float32).numpy().astype("<f4").tobytes() for v in model.values()))
    assert {r["param_digest"] for r in summary["ranks"]} == {digest.hexdigest()}  # the final consensus
