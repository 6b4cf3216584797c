"""The rank runtime against a scripted fake coordinator (docs/protocol.md, rank life cycle).

One real rank process (``python -m flodl_worker.examples.synthetic``, small sizes) dials
a ROUTER the test drives frame by frame.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch

from flodl.rank import CAUSES
from flodl.shuffle import epoch_permutation
from flodl.wire import pack_round, pb, unpack_round
from flodl_worker.rank import EXIT_CONFIG, gamma_mass, rank_main

SYNTHETIC = ("--samples", "64", "--test-samples", "32", "--features", "8", "--classes", "3", "--hidden", "16")
SEED = 7
STARTUP_S = 30.0  # python + torch import on a loaded 2-core machine: seconds, not minutes


def spec(**over) -> pb.RunSpec:
    base = dict(
        world_size=1, total_samples=64, batch_size=16, num_epochs=1, seed=SEED,
        policy=pb.POLICY_SYNC, plane=pb.PLANE_BUS, gamma=1.0,
        heartbeat_interval_s=0.25, liveness_timeout_s=10.0,
    )
    base.update(over)
    return pb.RunSpec(**base)


def start_rank(procs, py, coordinator, tmp_path, **env):
    full = {
        "FLODL_RANK": "0",
        "FLODL_WORLD_SIZE": "1",
        "FLODL_CONNECT": coordinator.endpoint,
        "FLODL_SESSION": coordinator.session,
        "FLODL_HOST": "test-host",
        "FLODL_TRACE_DIR": str(tmp_path),
    }
    full.update(env)
    return procs.start(py("flodl_worker.examples.synthetic", *SYNTHETIC), env=full)


def start_epoch(coordinator, route, offset: int, size: int) -> None:
    plan = pb.EpochPlan(epoch=0, partition_offset=offset, partition_size=size)
    coordinator.control(route, start_epoch=pb.Control.StartEpoch(plan=plan))


def admit(coordinator, run: pb.RunSpec):
    route, d = coordinator.expect("hello", timeout=STARTUP_S)  # torch import
    coordinator.send(route, "hello_ack", pb.HelloAck(accepted=True, run=run))
    return route, d.envelope


def expect_batches(coordinator, want: list[tuple[int, int]], first_step: int = 1):
    for i, (offset, samples) in enumerate(want):
        _, d = coordinator.expect("timing", "batch")
        b = d.envelope.timing.batch
        assert (b.epoch, b.offset, b.samples, b.step_count) == (0, offset, samples, first_step + i)
        assert b.batch_ms > 0 and b.data_ms >= 0 and np.isfinite(b.batch_loss) and b.lr == pytest.approx(0.05)


def wait_exit(proc, timeout: float = 20.0) -> tuple[int, str]:
    _, err = proc.communicate(timeout=timeout)
    return proc.returncode, err.decode(errors="replace")


def norm(arrays) -> float:
    return float(np.sqrt(sum(float((a.astype(np.float64) ** 2).sum()) for a in arrays)))


@pytest.mark.integration
def test_rank_full_cycle_against_fake_coordinator(coordinator, procs, py, tmp_path):
    proc = start_rank(procs, py, coordinator, tmp_path)
    route, d = coordinator.expect("hello", timeout=STARTUP_S)
    env = d.envelope
    h = env.hello
    assert env.sender.kind == pb.Sender.KIND_RANK and env.sender.rank == 0 and env.sender.host == "test-host"
    assert (h.rank, h.world_size, h.dataset_len, h.task, h.host) == (0, 1, 64, "synthetic", "test-host")
    assert len(h.model_sig) == 32 and h.pid == proc.pid

    coordinator.raw(route, b"\xffnot a protobuf")  # a bad frame: dropped, counted, logged once
    coordinator.send(route, "hello_ack", pb.HelloAck(accepted=True, run=spec()))
    start_epoch(coordinator, route, 0, 64)
    expect_batches(coordinator, [(0, 16), (16, 16), (32, 16), (48, 16)])
    _, d = coordinator.expect("metrics")
    m = d.envelope.metrics
    assert (m.rank, m.epoch, m.batches_processed, m.samples_processed) == (0, 0, 4, 64)
    assert m.compute_only_ms > 0 and m.epoch_ms >= m.compute_only_ms and np.isfinite(m.avg_loss)
    assert m.share_complete_ms == pytest.approx(m.compute_only_ms + m.data_starve_ms)

    # Averaging: upload weighted by n**gamma = 4, consensus back, sync_ack.
    coordinator.control(route, request_params=pb.Control.RequestParams(cycle=1))
    _, d = coordinator.expect("round")
    up = d.envelope.round
    assert (up.cycle, up.phase, up.kind, up.weight) == (1, pb.ROUND_PHASE_PARAMS, pb.ROUND_KIND_MODEL, 4.0)
    weighted = unpack_round(up, d.blobs)
    assert [a.shape for a in weighted] == [(16, 8), (16,), (3, 16), (3,)]  # parameters() order
    pre = [a / 4.0 for a in weighted]
    rng = np.random.default_rng(0)
    consensus = [rng.standard_normal(a.shape).astype(np.float32) for a in pre]
    header, blobs = pack_round(consensus, cycle=1, weight=4.0)
    coordinator.send(route, "round", header, blobs)
    _, d = coordinator.expect("timing", "sync_ack")
    ack = d.envelope.timing.sync_ack
    assert (ack.cycle, ack.step_count) == (1, 4)
    assert ack.pre_norm == pytest.approx(norm(pre), rel=1e-5)
    assert ack.post_norm == pytest.approx(norm(consensus), rel=1e-5)
    assert ack.divergence == pytest.approx(norm([c - p for c, p in zip(consensus, pre)]) / norm(consensus), rel=1e-4)
    coordinator.control(route, update=pb.Control.Update(version=1, cycle=1))
    # Released with no plan: it waits at the barrier until the next command. Its
    # heartbeat says it did wait (sent at once, the eval could land in the same drain
    # as the Update on a loaded machine, and the barrier would be charged nothing).
    coordinator.expect("timing", "heartbeat", skip_heartbeats=False)

    coordinator.control(route, execute_eval=pb.Control.ExecuteEval(schedule_id=9, epoch=0, target_rank=0, final=True))
    _, d = coordinator.expect("timing", "eval_result")
    ev = d.envelope.timing.eval_result
    assert (ev.schedule_id, ev.epoch, ev.final, ev.HasField("error")) == (9, 0, True, False)
    assert 0.0 <= ev.metric <= 1.0
    coordinator.control(route, execute_eval=pb.Control.ExecuteEval(schedule_id=10, target_rank=5))  # not mine
    # Another rank died: what this one waits from now until the next consensus is recovery.
    coordinator.control(route, declare_dead=pb.Control.DeclareDead(rank=3))
    for _ in range(2):  # the second is sent a heartbeat interval after the rank read it
        coordinator.expect("timing", "heartbeat", skip_heartbeats=False)

    # A final eval with a path also writes the model it measured: the consensus, as a plain state_dict.
    out = tmp_path / "out" / "model.pt"
    coordinator.control(route, execute_eval=pb.Control.ExecuteEval(
        schedule_id=11, target_rank=0, final=True, save_model_path=str(out)))  # fmt: skip
    _, d = coordinator.expect("timing", "eval_result")
    ev = d.envelope.timing.eval_result
    assert not ev.HasField("model_error") and ev.model_sha256 == hashlib.sha256(out.read_bytes()).digest()
    state = torch.load(out, weights_only=True)
    assert list(state) == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert all(np.array_equal(state[k].numpy(), c) for k, c in zip(state, consensus))
    (tmp_path / "a-file").write_text("")
    coordinator.control(route, execute_eval=pb.Control.ExecuteEval(
        schedule_id=12, target_rank=0, final=True, save_model_path=str(tmp_path / "a-file" / "model.pt")))  # fmt: skip
    _, d = coordinator.expect("timing", "eval_result")
    ev = d.envelope.timing.eval_result
    assert ev.model_sha256 == b"" and "a-file" in ev.model_error and not ev.HasField("error")  # the eval still counts

    coordinator.control(route, shutdown=pb.Control.Shutdown(reason="done"))
    _, d = coordinator.expect("timing", "exiting")
    ex = d.envelope.timing.exiting
    digest = hashlib.sha256(b"".join(c.astype("<f4").tobytes() for c in consensus)).digest()
    assert (ex.param_digest, ex.steps) == (digest, 4)
    # Where its time went, by cause (flodl.rank.TimeAccount): every cause it went through
    # is charged, and they add up to its wall time.
    acct = d.envelope.timing.time_account
    causes = {c: getattr(acct, f"{c}_s") for c in CAUSES}
    for cause in ("startup", "training", "averaging", "eval", "barrier", "recovery"):  # (sync: no calibration)
        assert causes[cause] > 0, (cause, causes)
    assert causes["calibration"] == causes["checkpoint"] == 0
    assert sum(causes.values()) == pytest.approx(acct.wall_s, rel=1e-9)
    code, err = wait_exit(proc)
    assert code == 0, err
    assert err.count("dropped a frame from the coordinator (malformed)") == 1

    trace = (tmp_path / "rank0.trace").read_text().split("\n")[:-1]
    assert trace == [f"0 {i}" for i in epoch_permutation(SEED, 0, 64)]


@pytest.mark.integration
def test_rank_throttle_extend_and_zero_mass_round(coordinator, procs, py, tmp_path):
    proc = start_rank(procs, py, coordinator, tmp_path)
    route, _ = admit(coordinator, spec())
    # Throttled before the plan arrives: the rank takes the plan but trains nothing,
    # while it still heartbeats and answers RequestParams.
    coordinator.control(route, throttle=pb.Control.Throttle())
    start_epoch(coordinator, route, 0, 20)
    for _ in range(2):
        coordinator.expect("timing", "heartbeat", skip_heartbeats=False)
    coordinator.control(route, request_params=pb.Control.RequestParams(cycle=5))
    _, d = coordinator.expect("round")
    up = d.envelope.round
    assert up.weight == 0.0 and d.blobs == [] and all(t.elided for t in up.tensors)  # idle guard
    zeros, _ = pack_round([np.zeros(tuple(t.shape), np.float32) for t in up.tensors], cycle=5, weight=0.0)
    coordinator.send(route, "round", zeros)
    _, d = coordinator.expect("timing", "sync_ack")
    ack = d.envelope.timing.sync_ack
    assert (ack.cycle, ack.step_count, ack.divergence) == (5, 0, 0.0)  # weight 0: kept local
    assert ack.pre_norm == pytest.approx(ack.post_norm) and ack.post_norm > 0

    # Extend the plan in training with a non-adjacent range: no batch straddles the gap.
    extend = pb.Control.ExtendPartition(epoch=0, partition_offset=40, partition_size=8)
    coordinator.control(route, extend_partition=extend)
    # Sync, a rank joined: still throttled, the rank gives back its tail beyond 24 samples
    # and names exactly what left its plan.
    coordinator.control(route, trim_partition=pb.Control.TrimPartition(epoch=0, keep=24))
    _, d = coordinator.expect("timing", "partition_trimmed")
    trimmed = d.envelope.timing.partition_trimmed
    assert (trimmed.epoch, trimmed.kept, [(s.offset, s.size) for s in trimmed.released]) == (0, 24, [(44, 4)])
    assert trimmed.command_id == coordinator.command_id  # the trim it answers
    coordinator.control(route, update=pb.Control.Update(version=1))
    expect_batches(coordinator, [(0, 16), (16, 4), (40, 4)])
    _, d = coordinator.expect("metrics")
    assert (d.envelope.metrics.batches_processed, d.envelope.metrics.samples_processed) == (3, 24)

    coordinator.control(route, shutdown_with_save=pb.Control.ShutdownWithSave(detail="bye"))
    _, d = coordinator.expect("timing", "exiting")
    assert d.envelope.timing.exiting.steps == 3
    code, err = wait_exit(proc)
    assert code == 0, err
    perm = epoch_permutation(SEED, 0, 64)
    ids = [int(line.split()[1]) for line in (tmp_path / "rank0.trace").read_text().splitlines()]
    assert ids == [int(i) for i in perm[0:20]] + [int(i) for i in perm[40:44]]


@pytest.mark.integration
def test_only_the_elected_rank_runs_epoch_fn_and_reports_its_time(coordinator, procs, py, tmp_path):
    env = {"FLODL_RANK": "0", "FLODL_WORLD_SIZE": "1", "FLODL_CONNECT": coordinator.endpoint,
           "FLODL_SESSION": coordinator.session, "FLODL_HOST": "test-host"}  # fmt: skip
    proc = procs.start(py("flodl_worker.examples.synthetic", *SYNTHETIC, "--epoch-report"), env=env)
    route, _ = admit(coordinator, spec(num_epochs=2))
    metrics = lambda e: pb.Control.EpochAggregated(metrics=pb.EpochMetrics(epoch=e, avg_loss=0.5))  # noqa: E731
    # Another rank holds the role: epoch 0's callback is not ours.
    coordinator.control(route, set_epoch_callback_role=pb.Control.SetEpochCallbackRole(rank=1))
    coordinator.control(route, epoch_aggregated=metrics(0))
    # Elected now: epoch 1's callback runs here and its cost comes back.
    coordinator.control(route, set_epoch_callback_role=pb.Control.SetEpochCallbackRole(rank=0))
    coordinator.control(route, epoch_aggregated=metrics(1))
    _, d = coordinator.expect("timing", "epoch_fn_elapsed")
    e = d.envelope.timing.epoch_fn_elapsed
    assert e.epoch == 1 and e.elapsed_ms > 0
    coordinator.control(route, shutdown=pb.Control.Shutdown(reason="done"))
    coordinator.expect("timing", "exiting")
    code, err = wait_exit(proc)
    assert code == 0, err
    assert "epoch 2: avg loss 0.5000, held-out accuracy" in err and "epoch 1:" not in err


@pytest.mark.integration
def test_rank_trains_through_an_open_round_and_keeps_those_steps(coordinator, procs, py, tmp_path):
    # Cadence overlap: the rank trains its next window (k = 2 steps) while its round is
    # open; the consensus then lands as theta <- consensus + (theta_now - snapshot), bit
    # for bit, and the ack still reports the snapshot's step and the snapshot-vs-consensus
    # divergence.
    proc = start_rank(procs, py, coordinator, tmp_path)
    route, _ = admit(coordinator, spec(policy=pb.POLICY_CADENCE))
    start_epoch(coordinator, route, 0, 32)
    expect_batches(coordinator, [(0, 16), (16, 16)])
    coordinator.expect("metrics")
    coordinator.control(route, request_params=pb.Control.RequestParams(cycle=1))
    _, d = coordinator.expect("round")
    assert d.envelope.round.weight == 2.0
    pre = [a / np.float32(2.0) for a in unpack_round(d.envelope.round, d.blobs)]
    start_epoch(coordinator, route, 32, 32)  # trained while the round is open
    expect_batches(coordinator, [(32, 16), (48, 16)], first_step=3)
    coordinator.expect("metrics")
    # Read theta now (after 4 steps) through a second snapshot, weight = steps since average.
    coordinator.control(route, request_params=pb.Control.RequestParams(cycle=2))
    _, d = coordinator.expect("round")
    assert d.envelope.round.weight == 4.0
    now = [a / np.float32(4.0) for a in unpack_round(d.envelope.round, d.blobs)]
    rng = np.random.default_rng(1)
    consensus = [rng.standard_normal(a.shape).astype(np.float32) for a in pre]
    header, blobs = pack_round(consensus, cycle=1, weight=2.0)
    coordinator.send(route, "round", header, blobs)
    _, d = coordinator.expect("timing", "sync_ack")
    ack = d.envelope.timing.sync_ack
    assert (ack.cycle, ack.step_count) == (1, 2)  # the snapshot's step
    assert ack.post_norm == pytest.approx(norm(consensus), rel=1e-5)
    assert ack.divergence == pytest.approx(norm([c - p for c, p in zip(consensus, pre)]) / norm(consensus), rel=1e-4)
    coordinator.control(route, shutdown=pb.Control.Shutdown(reason="done"))
    _, d = coordinator.expect("timing", "exiting")
    want = [c + (n - p) for c, n, p in zip(consensus, now, pre)]
    digest = hashlib.sha256(b"".join(w.astype("<f4").tobytes() for w in want)).digest()
    assert (d.envelope.timing.exiting.param_digest, d.envelope.timing.exiting.steps) == (digest, 4)
    code, err = wait_exit(proc)
    assert code == 0, err


@pytest.mark.integration
def test_rank_refused_hello_exits_2_with_reason(coordinator, procs, py, tmp_path):
    proc = start_rank(procs, py, coordinator, tmp_path)
    route, _ = coordinator.expect("hello", timeout=STARTUP_S)
    coordinator.send(route, "hello_ack", pb.HelloAck(accepted=False, reason="model signature differs from rank 0"))
    code, err = wait_exit(proc)
    assert code == 2
    assert "model signature differs from rank 0" in err


@pytest.mark.integration
def test_rank_gives_up_when_no_hello_ack(coordinator, procs, py, tmp_path):
    proc = start_rank(procs, py, coordinator, tmp_path, FLODL_HELLO_TIMEOUT_S="0.5")
    coordinator.expect("hello", timeout=STARTUP_S)
    code, err = wait_exit(proc)
    assert code == 1
    assert "no hello_ack from the coordinator" in err


@pytest.mark.integration
def test_rank_exits_when_coordinator_goes_silent(coordinator, procs, py, tmp_path):
    proc = start_rank(procs, py, coordinator, tmp_path)
    admit(coordinator, spec(heartbeat_interval_s=0.1, liveness_timeout_s=0.8))
    for _ in range(3):  # it keeps heartbeating while it waits for a plan...
        coordinator.expect("timing", "heartbeat", skip_heartbeats=False)
    code, err = wait_exit(proc)  # ...and gives up, loudly, after liveness_timeout_s of silence
    assert code == 1
    assert "heard nothing from the coordinator" in err and "liveness_timeout_s" in err


def test_rank_bad_environment_is_one_line_and_exit_2(capsys):
    fail = lambda *a: pytest.fail("must not be called")  # noqa: E731
    for env, needle in [
        ({}, "FLODL_WORLD_SIZE is not set"),  # (FLODL_RANK unset: unpinned, the coordinator numbers it)
        ({"FLODL_RANK": "x", "FLODL_WORLD_SIZE": "2", "FLODL_CONNECT": "tcp://h:1"}, "'x' is not an integer"),
        ({"FLODL_RANK": "2", "FLODL_WORLD_SIZE": "2", "FLODL_CONNECT": "tcp://h:1"}, "out of range"),
        ({"FLODL_RANK": "0", "FLODL_WORLD_SIZE": "2", "FLODL_CONNECT": "h:1"}, "must start with tcp://"),
        ({"FLODL_RANK": "0", "FLODL_WORLD_SIZE": "1", "FLODL_CONNECT": "tcp://h", "FLODL_SLOWDOWN": "-1"}, "SLOWDOWN"),
    ]:
        assert rank_main(fail, fail, fail, [], env=env) == EXIT_CONFIG
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and needle in err, err


def test_gamma_mass_idle_guard():
    assert gamma_mass(0, 0.0) == 0.0 and gamma_mass(0, -1.0) == 0.0 and gamma_mass(-3, 1.0) == 0.0
    assert gamma_mass(4, 1.0) == 4.0 and gamma_mass(4, 0.0) == 1.0 and gamma_mass(4, 0.5) == 2.0


def test_a_training_rank_s_batch_reports_are_its_heartbeats(coordinator, procs, py, tmp_path):
    # 40 batches of 20 ms (FLODL_SLOWDOWN), heartbeats every 0.1 s: while batches go out
    # the rank sends no heartbeat frame of its own -- a report sent once one is due is the
    # heartbeat, with the time account on it -- and once it waits, heartbeats come again.
    proc = procs.start(py("flodl_worker.examples.synthetic", *SYNTHETIC[:1], "640", *SYNTHETIC[2:]), env={
        "FLODL_RANK": "0", "FLODL_WORLD_SIZE": "1", "FLODL_CONNECT": coordinator.endpoint,
        "FLODL_SESSION": coordinator.session, "FLODL_HOST": "test-host", "FLODL_TRACE_DIR": str(tmp_path),
        "FLODL_SLOWDOWN": "1", "FLODL_BASE_MS": "20",
    })  # fmt: skip
    route, _ = admit(coordinator, spec(total_samples=640, heartbeat_interval_s=0.1))
    start_epoch(coordinator, route, 0, 640)
    batches = accounts = beats_while_training = 0
    while batches < 40:
        _, d = coordinator.recv(skip_heartbeats=False)
        t = d.envelope.timing
        if d.envelope.WhichOneof("body") != "timing":
            continue
        if t.WhichOneof("event") == "heartbeat":
            beats_while_training += batches > 0  # (one may go out before the first batch)
            continue
        if t.WhichOneof("event") == "batch":
            batches += 1
            accounts += t.HasField("time_account")
            assert not t.HasField("time_account") or t.time_account.wall_s > 0
    # (A heartbeat can still fall due in the instant between a batch's report and the next
    # look, with nothing held: at most a stray one or two, where every interval sent one.)
    assert beats_while_training <= 2, beats_while_training
    assert accounts >= 4, accounts  # 0.8 s of batches: about one account per 0.1 s interval
    beats = 0
    while beats < 2:  # the partition is done (its metrics next), the rank waits: it heartbeats
        _, d = coordinator.recv(skip_heartbeats=False, timeout=5.0)
        if d.envelope.WhichOneof("body") == "timing" and d.envelope.timing.WhichOneof("event") == "heartbeat":
            assert d.envelope.timing.HasField("time_account")
            beats += 1
    coordinator.control(route, shutdown=pb.Control.Shutdown(reason="test"))
    code, err = wait_exit(proc)
    assert code == 0, err
