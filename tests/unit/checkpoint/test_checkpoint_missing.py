"""Issue 9: an asked checkpoint that is not committed is never lost quietly.

The shell's ``Checkpointing`` knows every version whose meta the core decided; one
that ends uncommitted (every rank refused it, its commit failed, nobody answered, or
the core deferred it to a round that never finished) is *missing*: the summary's
``checkpoints.missing``, ``/status`` and the exit code say so, naming the versions.
"""

from __future__ import annotations

import hashlib
import json

from flodl.core import CoreConfig, Notice, RunFinished, checkpoint_meta, initial_state
from flodl.wire import pb
from flodl_coordinator.checkpointing import META_NOTICE, Checkpointing
from flodl_coordinator.service import CoordinatorService
from flodl_coordinator.settings import load_settings


def settings(tmp_path, **over):
    flags = {"world_size": 2, "bind": "tcp://127.0.0.1:0", "epochs": 3, "batch_size": 4, "policy": "sync",
             "checkpoint_dir": str(tmp_path / "ck"), "checkpoint_every": 1, "summary": str(tmp_path / "s.json"),
             # no rank runs here, so no final eval writes the output model: only checkpoints are judged
             "final_eval": False}
    flags.update(over)
    return load_settings(env={}, flags=flags)


def meta_notice(version: int) -> Notice:
    st = initial_state(CoreConfig(world_size=2, batch_size=4, num_epochs=3, total_samples=100, policy="sync"))
    return Notice(META_NOTICE, {"version": version, "meta": json.loads(json.dumps(checkpoint_meta(st, version)))})


def ask(ck: Checkpointing, version: int, rank: int) -> str:
    ctl = pb.Control(checkpoint=pb.Control.Checkpoint(version=version, target_rank=rank, cycle=version))
    return ck.stamp(rank, ctl).checkpoint.path


def test_a_version_every_rank_refused_is_missing_with_the_reason(tmp_path):
    ck = Checkpointing(settings(tmp_path))
    ck.on_notice(meta_notice(3))
    ask(ck, 3, 0)
    ck.on_result(0, pb.Timing.CheckpointResult(version=3, error="the consensus of cycle 3 is no longer held"))
    ck.on_abandoned(Notice("checkpoint_abandoned", {"version": 3, "tried": [0, 1], "detail": "rank 1: no space"}))
    # v4 is asked and made: not missing
    ck.on_notice(meta_notice(4))
    path = ask(ck, 4, 1)
    with open(path, "wb") as fh:
        fh.write(b"weights")
    ck.on_result(1, pb.Timing.CheckpointResult(version=4, sha256=hashlib.sha256(b"weights").digest()))
    missing = ck.missing()
    assert [m["version"] for m in missing] == [3]
    assert "abandoned after ranks [0, 1]" in missing[0]["reason"] and "no space" in missing[0]["reason"]
    s = ck.summary()
    assert [a["version"] for a in s["asked"]] == [3, 4] and [c["version"] for c in s["committed"]] == [4]
    assert s["missing"] == missing
    assert ck.status()["missing"] == missing and ck.status()["committed"] == 1


def test_a_save_deferred_to_a_round_that_never_finished_is_missing(tmp_path):
    ck = Checkpointing(settings(tmp_path))
    st = initial_state(CoreConfig(world_size=2, batch_size=4, num_epochs=3, total_samples=100, policy="sync"))
    st.checkpoints.deferred = "checkpoint"
    st.rounds.cycle = 9
    (m,) = ck.missing(st)
    assert m["version"] is None and "round 9" in m["reason"] and "never finished" in m["reason"]


def test_the_run_is_not_ok_and_exits_1_when_an_asked_checkpoint_is_missing(tmp_path):
    svc = CoordinatorService(settings(tmp_path))
    svc.checkpointing.on_notice(meta_notice(5))
    svc.checkpointing.on_notice(meta_notice(7))
    ask(svc.checkpointing, 5, 0)
    svc.checkpointing.on_result(0, pb.Timing.CheckpointResult(version=5, error="OSError: [Errno 28] No space left"))
    svc.finished = RunFinished(ok=True, reason="completed", summary={})
    assert svc._finish() == 1
    with open(tmp_path / "s.json", encoding="utf-8") as fh:
        summary = json.load(fh)
    assert summary["ok"] is False
    assert "2 asked checkpoint(s) not committed (v5, v7)" in summary["reason"]
    assert [m["version"] for m in summary["checkpoints"]["missing"]] == [5, 7]
    assert "No space left" in summary["checkpoints"]["missing"][0]["reason"]


def test_a_run_whose_checkpoints_were_all_made_stays_ok(tmp_path):
    svc = CoordinatorService(settings(tmp_path))
    svc.finished = RunFinished(ok=True, reason="completed", summary={})
    assert svc._finish() == 0
    with open(tmp_path / "s.json", encoding="utf-8") as fh:
        assert json.load(fh)["checkpoints"]["missing"] == []
