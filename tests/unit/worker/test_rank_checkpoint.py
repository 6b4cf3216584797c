"""The rank's half of a checkpoint, against a scripted fake coordinator.

A real rank process (``flodl_worker.examples.synthetic``, small sizes) saves model +
optimizer state on ``Checkpoint`` -- the consensus it was told to save, or an error
naming why not -- and a second process started with ``RunSpec.resume_from`` loads it:
its state dicts equal the saved ones, and its final parameters are the consensus.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch

from flodl.wire import pack_round, pb, unpack_round

SYNTHETIC = ("--samples", "64", "--test-samples", "32", "--features", "8", "--classes", "3", "--hidden", "16")
STARTUP_S = 30.0  # python + torch import on a loaded machine


def spec(**over) -> pb.RunSpec:
    base = dict(
        world_size=1, total_samples=64, batch_size=16, num_epochs=1, seed=7,
        policy=pb.POLICY_SYNC, plane=pb.PLANE_BUS, gamma=1.0,
        heartbeat_interval_s=0.25, liveness_timeout_s=10.0,
    )  # fmt: skip
    base.update(over)
    return pb.RunSpec(**base)


def start_rank(procs, py, coordinator):
    env = {
        "FLODL_RANK": "0",
        "FLODL_WORLD_SIZE": "1",
        "FLODL_CONNECT": coordinator.endpoint,
        "FLODL_SESSION": coordinator.session,
        "FLODL_HOST": "test-host",
    }
    return procs.start(py("flodl_worker.examples.synthetic", *SYNTHETIC), env=env)


def admit(coordinator, run: pb.RunSpec):
    route, _ = coordinator.expect("hello", timeout=STARTUP_S)
    coordinator.send(route, "hello_ack", pb.HelloAck(accepted=True, run=run))
    return route


def checkpoint(coordinator, route, version: int, path: str, cycle: int, target: int = 0) -> None:
    ck = pb.Control.Checkpoint(version=version, target_rank=target, path=str(path), cycle=cycle)
    coordinator.control(route, checkpoint=ck)


def expect_result(coordinator) -> pb.Timing.CheckpointResult:
    _, d = coordinator.expect("timing", "checkpoint_result")
    return d.envelope.timing.checkpoint_result


def train_epoch(coordinator, route, offset: int, size: int) -> None:
    plan = pb.EpochPlan(epoch=0, partition_offset=offset, partition_size=size)
    coordinator.control(route, start_epoch=pb.Control.StartEpoch(plan=plan))
    for _ in range((size + 15) // 16):
        coordinator.expect("timing", "batch")
    coordinator.expect("metrics")


def average(coordinator, route, cycle: int, consensus: list[np.ndarray]) -> None:
    coordinator.control(route, request_params=pb.Control.RequestParams(cycle=cycle))
    _, d = coordinator.expect("round")
    assert [a.shape for a in unpack_round(d.envelope.round, d.blobs)] == [a.shape for a in consensus]
    header, blobs = pack_round(consensus, cycle=cycle, weight=4.0)
    coordinator.send(route, "round", header, blobs)
    _, d = coordinator.expect("timing", "sync_ack")
    assert d.envelope.timing.sync_ack.cycle == cycle


def load(path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


def assert_same(a, b, where="state") -> None:
    """Recursive equality of state dicts (tensors bit for bit)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert set(a) == set(b), where
        for k in a:
            assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def wait_exit(proc, timeout: float = 20.0) -> tuple[int, str]:
    _, err = proc.communicate(timeout=timeout)
    return proc.returncode, err.decode(errors="replace")


@pytest.mark.integration
def test_rank_saves_the_consensus_on_checkpoint_and_a_new_rank_resumes_from_it(coordinator, procs, py, tmp_path):
    proc = start_rank(procs, py, coordinator)
    route = admit(coordinator, spec())
    train_epoch(coordinator, route, 0, 64)  # 4 steps: SGD momentum buffers exist

    # Armed before the round: saved right after the consensus of cycle 1 is applied.
    checkpoint(coordinator, route, 1, tmp_path / "a" / "model.pt", cycle=1)
    checkpoint(coordinator, route, 7, tmp_path / "other" / "model.pt", cycle=0, target=5)  # not mine: silence
    checkpoint(coordinator, route, 2, "", cycle=0)
    res = expect_result(coordinator)  # the armed one has not answered yet: this is v2's
    assert (res.version, res.HasField("error")) == (2, True) and "no path" in res.error
    rng = np.random.default_rng(0)
    consensus = [rng.standard_normal(s).astype(np.float32) for s in [(16, 8), (16,), (3, 16), (3,)]]
    average(coordinator, route, 1, consensus)  # the ack comes first: the round is not held up
    res = expect_result(coordinator)
    a = tmp_path / "a" / "model.pt"
    assert (res.version, res.cycle, res.HasField("error")) == (1, 1, False)
    assert res.sha256 == hashlib.sha256(a.read_bytes()).digest() and res.elapsed_ms > 0
    saved = load(a)
    assert [v.numpy().tolist() for v in saved["model"].values()] == [c.tolist() for c in consensus]
    assert len(saved["optimizer"]["state"]) == 4 and (saved["version"], saved["cycle"]) == (1, 1)
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["model.pt"]  # no temp left behind

    # Still holding that consensus (no step since): saved at once, identical weights.
    checkpoint(coordinator, route, 3, tmp_path / "b" / "model.pt", cycle=1)
    assert not expect_result(coordinator).HasField("error")
    assert_same(load(tmp_path / "b" / "model.pt")["model"], saved["model"])
    # One more step (Cadence trains on after a round): cycle 1 is still the consensus the
    # rank holds, so the same request saves it -- those weights, not the stepped ones.
    train_epoch(coordinator, route, 0, 16)
    checkpoint(coordinator, route, 4, tmp_path / "c" / "model.pt", cycle=1)
    res = expect_result(coordinator)
    assert not res.HasField("error"), res.error
    assert_same(load(tmp_path / "c" / "model.pt")["model"], saved["model"])
    # After the next consensus, cycle 1 is refused by name (no longer held).
    consensus2 = [c + 1.0 for c in consensus]
    average(coordinator, route, 2, consensus2)
    checkpoint(coordinator, route, 5, tmp_path / "e" / "model.pt", cycle=1)
    res = expect_result(coordinator)
    assert res.HasField("error") and "no longer held" in res.error and "last applied cycle 2" in res.error
    assert not (tmp_path / "e" / "model.pt").exists()
    coordinator.control(route, shutdown=pb.Control.Shutdown(reason="done"))
    coordinator.expect("timing", "exiting")
    code, err = wait_exit(proc)
    assert code == 0, err

    # A new rank resumes from a: model and optimizer state load before any step.
    proc = start_rank(procs, py, coordinator)
    route = admit(coordinator, spec(resume_from=str(a)))
    checkpoint(coordinator, route, 9, tmp_path / "d" / "model.pt", cycle=0)
    assert not expect_result(coordinator).HasField("error")
    again = load(tmp_path / "d" / "model.pt")
    assert_same(again["model"], saved["model"], "model")
    assert_same(again["optimizer"], saved["optimizer"], "optimizer")
    assert again["global_step"] == saved["global_step"]
    coordinator.control(route, shutdown=pb.Control.Shutdown(reason="done"))
    _, d = coordinator.expect("timing", "exiting")
    digest = hashlib.sha256(b"".join(c.astype("<f4").tobytes() for c in consensus)).digest()
    assert (d.envelope.timing.exiting.param_digest, d.envelope.timing.exiting.steps) == (digest, 0)
    code, err = wait_exit(proc)
    assert code == 0, err


@pytest.mark.integration
def test_rank_refuses_a_resume_file_it_cannot_load_and_exits_2(coordinator, procs, py, tmp_path):
    bad = tmp_path / "model.pt"
    bad.write_bytes(b"not a checkpoint")
    proc = start_rank(procs, py, coordinator)
    admit(coordinator, spec(resume_from=str(bad)))
    code, err = wait_exit(proc)
    assert code == 2
    assert f"cannot resume: {bad} is not a loadable checkpoint" in err
