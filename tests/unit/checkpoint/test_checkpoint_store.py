"""flodl_coordinator.checkpoints / .checkpointing: atomic commit, verified load, refusals.

The rank's half is played by writing bytes where ``model_path`` says; the rank's
real writer is tested in tests/unit/worker/test_rank_checkpoint.py.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil

import pytest

from flodl.core import CoreConfig, Notice, initial_state
from flodl.core import _coverage
from flodl.core import checkpoint_meta
from flodl.wire import pb
from flodl_coordinator.checkpointing import META_NOTICE, Checkpointing
from flodl_coordinator.checkpoints import (
    LATEST_FILE,
    META_FILE,
    MODEL_FILE,
    CheckpointError,
    CheckpointStore,
    Committed,
    Failed,
    load_checkpoint,
    resolve_resume,
    write_json_atomic,
)
from flodl_coordinator.settings import Settings, SettingsError, load_settings

CFG = dict(world_size=2, batch_size=4, num_epochs=5, seed=7, total_samples=100, policy="sync")


def meta_at(version: int = 3, reason: str = "checkpoint") -> dict:
    st = initial_state(CoreConfig(**CFG))
    _coverage.open_epoch(st.coverage, 0, 100)
    _coverage.record_batch(st.coverage, 0, 0, 8, 16, 1, 1)
    st.rounds.version = version
    return json.loads(json.dumps(checkpoint_meta(st, version, reason=reason)))


def rank_writes(path: str, payload: bytes = b"weights") -> bytes:
    """What a rank does: write model.pt (atomically) and report its sha256."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "wb") as fh:
        fh.write(payload)
    os.replace(path + ".tmp", path)
    return hashlib.sha256(payload).digest()


def save(store: CheckpointStore, version: int = 3, rank: int = 0, payload: bytes = b"weights", **kw):
    path = store.model_path(version, rank)
    sha = rank_writes(path, payload)
    store.stage_meta(version, meta_at(version, **kw))
    return store.on_result(version, rank, error=None, sha256=sha)


def visible(root) -> list[str]:
    return sorted(n for n in os.listdir(root) if not n.startswith("."))


# -- commit ------------------------------------------------------------------------------


def test_commit_publishes_a_complete_checkpoint_and_points_latest_at_it(tmp_path):
    store = CheckpointStore(str(tmp_path))
    (c,) = save(store)
    assert isinstance(c, Committed) and c.path == str(tmp_path / "ckpt-00000003")
    assert visible(tmp_path) == ["ckpt-00000003", LATEST_FILE]
    assert (tmp_path / LATEST_FILE).read_text() == "ckpt-00000003\n"
    assert sorted(os.listdir(c.path)) == [META_FILE, MODEL_FILE]
    assert os.listdir(tmp_path / ".staging") == []  # nothing half-written left behind
    for where in (tmp_path, tmp_path / LATEST_FILE, c.path, os.path.join(c.path, META_FILE)):
        ck = load_checkpoint(str(where))
        assert ck.path == c.path and ck.meta["model"]["sha256"] == hashlib.sha256(b"weights").hexdigest()
        assert ck.meta["model"]["rank"] == 0 and ck.meta["version"] == 3


def test_meta_and_result_join_in_either_order(tmp_path):
    store = CheckpointStore(str(tmp_path))
    path = store.model_path(4, 1)
    sha = rank_writes(path)
    assert store.on_result(4, 1, error=None, sha256=sha) == []  # meta not staged yet
    assert store.awaiting() is False  # nothing decided waits for a rank
    (c,) = store.stage_meta(4, meta_at(4))
    assert isinstance(c, Committed) and c.rank == 1
    path = store.model_path(5, 0)
    assert store.stage_meta(5, meta_at(5)) == [] and store.awaiting()
    (c,) = store.on_result(5, 0, error=None, sha256=rank_writes(path))
    assert isinstance(c, Committed) and not store.awaiting()
    assert (tmp_path / LATEST_FILE).read_text() == "ckpt-00000005\n"


def test_a_shutdown_save_never_overwrites_a_checkpoint_of_the_same_version(tmp_path):
    store = CheckpointStore(str(tmp_path))
    save(store, 3)
    (c,) = save(store, 3, reason="reduce_stall", payload=b"later weights")
    assert c.path.endswith("ckpt-00000003-reduce_stall")
    (c2,) = save(store, 3, reason="reduce_stall")
    assert c2.path.endswith("ckpt-00000003-reduce_stall.2")
    first = load_checkpoint(str(tmp_path / "ckpt-00000003"))
    assert first.meta["model"]["sha256"] == hashlib.sha256(b"weights").hexdigest()


def test_keep_prunes_the_oldest_checkpoints(tmp_path):
    store = CheckpointStore(str(tmp_path), keep=2)
    for v in (1, 2, 3):
        save(store, v)
    assert visible(tmp_path) == ["ckpt-00000002", "ckpt-00000003", LATEST_FILE]


# -- refusals at commit ------------------------------------------------------------------


def test_a_rank_error_is_a_named_failure_and_leaves_nothing(tmp_path):
    store = CheckpointStore(str(tmp_path))
    store.stage_meta(3, meta_at())
    path = store.model_path(3, 0)
    (f,) = store.on_result(3, 0, error="OSError: disk full")
    assert isinstance(f, Failed) and f.reason == "rank 0 could not save: OSError: disk full"
    assert not os.path.exists(os.path.dirname(path)) and visible(tmp_path) == []
    # The core fails over to rank 1 for the same version: that save still commits.
    (c,) = store.on_result(3, 1, error=None, sha256=rank_writes(store.model_path(3, 1)))
    assert isinstance(c, Committed) and c.rank == 1


def test_a_torn_or_invisible_model_is_not_committed(tmp_path):
    store = CheckpointStore(str(tmp_path))
    store.stage_meta(3, meta_at())
    path = store.model_path(3, 0)
    rank_writes(path, b"half")
    (f,) = store.on_result(3, 0, error=None, sha256=hashlib.sha256(b"whole").digest())
    assert isinstance(f, Failed) and "torn" in f.reason
    path = store.model_path(3, 1)  # this rank's file never shows up here (not shared storage)
    (f,) = store.on_result(3, 1, error=None, sha256=b"\0" * 32)
    assert isinstance(f, Failed) and "shared" in f.reason
    assert visible(tmp_path) == []


def test_a_crash_before_the_commit_leaves_the_previous_latest(tmp_path):
    store = CheckpointStore(str(tmp_path))
    save(store, 3)
    rank_writes(store.model_path(4, 0))  # rank saved, coordinator died before meta.json
    assert load_checkpoint(str(tmp_path)).path.endswith("ckpt-00000003")


# -- refusals at load --------------------------------------------------------------------


@pytest.fixture
def committed(tmp_path):
    store = CheckpointStore(str(tmp_path / "ck"))
    (c,) = save(store)
    return c.path


def test_load_refuses_a_missing_commit_marker(committed):
    os.unlink(os.path.join(committed, META_FILE))
    with pytest.raises(CheckpointError, match=r"torn checkpoint .*no meta.json \(the commit marker\)"):
        load_checkpoint(committed)


def test_load_refuses_a_model_whose_sha256_differs(committed):
    with open(os.path.join(committed, MODEL_FILE), "r+b") as fh:
        fh.truncate(3)
    with pytest.raises(CheckpointError, match=r"torn checkpoint .*model.pt sha256 .* differs from the recorded"):
        load_checkpoint(committed)


def test_load_refuses_a_missing_model_or_unreadable_meta(committed):
    os.unlink(os.path.join(committed, MODEL_FILE))
    with pytest.raises(CheckpointError, match="model.pt is missing"):
        load_checkpoint(committed)
    with open(os.path.join(committed, META_FILE), "w") as fh:
        fh.write("{not json")
    with pytest.raises(CheckpointError, match="meta.json is unreadable"):
        load_checkpoint(committed)


def test_load_refuses_a_newer_schema_and_nonsense_paths(committed, tmp_path):
    meta_path = os.path.join(committed, META_FILE)
    meta = json.load(open(meta_path))
    write_json_atomic(meta_path, dict(meta, schema_version=99))
    with pytest.raises(CheckpointError, match="newer than this flodl reads"):
        load_checkpoint(committed)
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(str(tmp_path / "nope"))


def test_resume_refuses_a_checkpoint_of_another_run_with_the_reason(committed):
    with pytest.raises(CheckpointError, match="cannot resume from .*seed 7 in the checkpoint differs from .* 8"):
        resolve_resume(committed, CoreConfig(**dict(CFG, seed=8)))
    ck, point = resolve_resume(committed, CoreConfig(**CFG))
    assert point.uncovered(0) == ((0, 8), (24, 76)) and ck.model_path.endswith(MODEL_FILE)


# -- the service glue --------------------------------------------------------------------


def settings(**over) -> Settings:
    base = dict(world_size=2, batch_size=4, epochs=5, seed=7, policy="sync")
    base.update(over)
    return load_settings(env={}, flags=base)


def test_glue_stamps_paths_joins_the_meta_and_reports(tmp_path):
    cp = Checkpointing(settings(checkpoint_dir=str(tmp_path)))
    ctl = pb.Control(command_id=9, checkpoint=pb.Control.Checkpoint(version=3, target_rank=1, cycle=3))
    out = cp.stamp(1, ctl)
    assert out.checkpoint.path.startswith(str(tmp_path / ".staging")) and ctl.checkpoint.path == ""
    other = pb.Control(command_id=10, throttle=pb.Control.Throttle())
    assert cp.stamp(1, other) is other
    assert cp.on_notice(Notice(META_NOTICE, {"version": 3, "meta": meta_at(3)})) is True
    assert cp.on_notice(Notice("epoch", {})) is False
    assert cp.lingering(0.0) is True  # a decided save waits for its rank (bounded)
    sha = rank_writes(out.checkpoint.path)
    cp.on_result(1, pb.Timing.CheckpointResult(version=3, sha256=sha))
    assert cp.lingering(1.0) is False
    summary = cp.summary()
    assert [c["version"] for c in summary["committed"]] == [3] and summary["failed"] == []


def test_glue_gives_up_lingering_after_the_liveness_timeout(tmp_path):
    cp = Checkpointing(settings(checkpoint_dir=str(tmp_path), liveness_timeout_s=2.0))
    cp.stamp(0, pb.Control(checkpoint=pb.Control.Checkpoint(version=1)))
    cp.on_notice(Notice(META_NOTICE, {"version": 1, "meta": meta_at(1)}))
    assert cp.lingering(10.0) and cp.lingering(11.9)
    assert cp.lingering(12.0) is False and cp.lingering(13.0) is False


def test_glue_resume_stamps_the_model_and_pins_the_epoch_size(committed):
    cp = Checkpointing(settings(resume=committed))
    s = cp.pinned(settings(resume=committed))
    assert s.total_samples == 100 and cp.point.epoch == 0
    ack = cp.stamp_ack(pb.HelloAck(accepted=True, run=pb.RunSpec(seed=7)))
    assert ack.run.resume_from == os.path.join(committed, MODEL_FILE)
    refused = pb.HelloAck(accepted=False, reason="no")
    assert cp.stamp_ack(refused) is refused


def test_a_bad_resume_is_one_line_at_start(committed, tmp_path):
    with pytest.raises(SettingsError, match=r"^resume refused: cannot resume from .*seed 7 .* 9") as e:
        Checkpointing(settings(resume=committed, seed=9))
    assert "\n" not in str(e.value)
    with pytest.raises(SettingsError, match="resume refused: .*does not exist"):
        Checkpointing(settings(resume=str(tmp_path / "missing")))


def test_checkpoint_settings_are_checked(tmp_path):
    with pytest.raises(SettingsError, match="checkpoint_every needs checkpoint_dir"):
        settings(checkpoint_every=1)
    with pytest.raises(SettingsError, match=">= 0"):
        settings(checkpoint_every=-1, checkpoint_dir=str(tmp_path))
    env = {"FLODL_CHECKPOINT_DIR": str(tmp_path), "FLODL_CHECKPOINT_EVERY": "2"}
    s = load_settings(env=env, flags={"world_size": 1})
    assert (s.checkpoint_dir, s.checkpoint_every, s.resume) == (str(tmp_path), 2, "")


def test_coordinator_cli_refuses_a_bad_resume_with_exit_2(committed, capsys):
    from flodl_coordinator.cli import main

    rc = main(["serve", "--world-size", "2", "--seed", "8", "--batch-size", "4", "--policy", "sync",
               "--bind", "tcp://127.0.0.1:0", "--resume", committed])  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1
    assert err[0].startswith("flodl-coordinator: resume refused: cannot resume from") and "seed 7" in err[0]


# -- several epochs at one consensus (issue 11) -----------------------------------------------


def meta_of(version: int, epoch: int) -> dict:
    """A meta of checkpoint ``version`` as of aggregated ``epoch``."""
    m = meta_at(version)
    m.update(last_aggregated_epoch=epoch, epoch=epoch + 1, coverage={"epochs": []})
    return m


def test_a_second_epoch_of_one_consensus_commits_its_own_checkpoint_sharing_the_bytes(tmp_path):
    store = CheckpointStore(str(tmp_path))
    path = store.model_path(3, 0)
    sha = rank_writes(path, b"weights of v3")
    assert store.stage_meta(3, meta_of(3, 0)) == []
    (first,) = store.on_result(3, 0, error=None, sha256=sha)
    (second,) = store.stage_meta(3, meta_of(3, 1))  # epoch 1 aggregated later at the same consensus
    assert (first.epoch, second.epoch) == (0, 1) and second.path.endswith("ckpt-00000003-e1")
    a, b = (os.stat(os.path.join(c.path, MODEL_FILE)) for c in (first, second))
    assert (a.st_ino, a.st_nlink) == (b.st_ino, 2)  # one file, two names: no byte written twice
    assert (tmp_path / LATEST_FILE).read_text() == "ckpt-00000003-e1\n"
    shutil.rmtree(first.path)  # pruned or deleted: the second stands on its own
    ck = load_checkpoint(second.path)
    assert ck.meta["last_aggregated_epoch"] == 1 and ck.meta["model"]["sha256"] == sha.hex()


def test_metas_staged_together_commit_oldest_epoch_first_and_copy_where_links_are_refused(tmp_path, monkeypatch):
    def no_links(src, dst):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_links)
    store = CheckpointStore(str(tmp_path))
    path = store.model_path(4, 1)
    sha = rank_writes(path, b"weights of v4")
    store.stage_meta(4, meta_of(4, 3))
    store.stage_meta(4, meta_of(4, 2))
    got = store.on_result(4, 1, error=None, sha256=sha)
    assert [(c.epoch, os.path.basename(c.path)) for c in got] == [(2, "ckpt-00000004"), (3, "ckpt-00000004-e3")]
    for c in got:
        assert load_checkpoint(c.path).meta["last_aggregated_epoch"] == c.epoch  # whole and verified


def test_a_restarted_coordinator_finds_the_committed_save_a_late_epoch_shares(tmp_path):
    save(CheckpointStore(str(tmp_path)), 5, payload=b"weights of v5")
    (c,) = CheckpointStore(str(tmp_path)).stage_meta(5, meta_of(5, 4))  # a new process: nothing in memory
    assert isinstance(c, Committed) and c.path.endswith("ckpt-00000005-e4")
    assert load_checkpoint(c.path).meta["model"]["sha256"] == hashlib.sha256(b"weights of v5").hexdigest()


def test_the_summary_and_status_list_every_epoch_checkpointed(tmp_path):
    ck = Checkpointing(Settings(checkpoint_dir=str(tmp_path)))
    path = ck.stamp(0, pb.Control(checkpoint=pb.Control.Checkpoint(version=3, target_rank=0, cycle=3))).checkpoint.path
    sha = rank_writes(path)
    for e in (0, 1):
        ck.on_notice(Notice(META_NOTICE, {"version": 3, "meta": meta_of(3, e)}))
    ck.on_result(0, pb.Timing.CheckpointResult(version=3, sha256=sha))
    s = ck.summary()
    assert s["asked"] == [{"version": 3, "epoch": 0}, {"version": 3, "epoch": 1}] and s["missing"] == []
    assert [(c["version"], c["epoch"]) for c in s["committed"]] == [(3, 0), (3, 1)] and s["epochs"] == [0, 1]
    assert ck.status()["epochs"] == [0, 1] and ck.status()["committed"] == 2


def test_a_meta_of_other_weights_never_shares_a_save(tmp_path):
    store = CheckpointStore(str(tmp_path))
    save(store, 6)
    other = dict(meta_of(6, 2), cycle=99)  # names another consensus than the one saved
    (f,) = store.stage_meta(6, other)
    assert isinstance(f, Failed) and "cycle 99" in f.reason and visible(tmp_path) == ["ckpt-00000006", LATEST_FILE]
