"""Outer optimizers (SlowMo, Nesterov/DiLoCo) against a hand computation, in the reducer,
and their state through a checkpoint: written before meta, verified, restored, refused."""

from __future__ import annotations

import hashlib
import io
import json
import os

import numpy as np
import pytest

from flodl.core import CoreConfig, Notice, initial_state
from flodl.core import _coverage, checkpoint_meta
from flodl.wire import bf16_to_f32, f32_to_bf16, pack_round, pb, unpack_round
from flodl_coordinator.checkpointing import META_NOTICE, OUTER_FILE, Checkpointing
from flodl_coordinator.checkpoints import META_FILE, CheckpointError, load_checkpoint
from flodl_coordinator.outer import OuterError, OuterOptimizer, load_state, save_state
from flodl_coordinator.reducer import BusReducer
from flodl_coordinator.settings import Settings, SettingsError, load_settings

CONSENSUS = [np.float32(1.0), np.float32(0.5), np.float32(0.8), np.float32(0.2)]  # c_1 .. c_4


def run(kind, lr, mu):
    opt = OuterOptimizer(kind, lr=lr, momentum=mu)
    return [float(opt.step(t, [np.array([c], np.float32)])[0][0]) for t, c in enumerate(CONSENSUS, 1)]


def hand(kind, lr, mu):
    """The recurrences of flodl_coordinator.outer, by hand, in float64."""
    g, u, out = float(CONSENSUS[0]), 0.0, [float(CONSENSUS[0])]
    for c in CONSENSUS[1:]:
        delta = g - float(c)
        u = mu * u + delta
        g = g - lr * (u if kind == "slowmo" else delta + mu * u)
        out.append(g)
    return out


@pytest.mark.parametrize("kind", ["slowmo", "nesterov"])
def test_outer_steps_match_the_hand_computation(kind):
    np.testing.assert_allclose(run(kind, 0.7, 0.9), hand(kind, 0.7, 0.9), rtol=1e-6)


def test_slowmo_and_nesterov_worked_example():
    # c = 1, 0.5, 0.8: slowmo lr 0.5, beta 0.5: u = 0.5, g = 0.75; delta = -0.05, u = 0.2, g = 0.65
    assert run("slowmo", 0.5, 0.5)[:3] == pytest.approx([1.0, 0.75, 0.65])
    # nesterov lr 0.5, mu 0.5: u = 0.5, g = 1 - 0.5 (0.5 + 0.25) = 0.625;
    #   delta = -0.175, u = 0.075, g = 0.625 - 0.5 (-0.175 + 0.0375) = 0.69375
    assert run("nesterov", 0.5, 0.5)[:3] == pytest.approx([1.0, 0.625, 0.69375])


@pytest.mark.parametrize("kind", ["none", "slowmo", "nesterov"])
def test_lr_one_momentum_zero_is_plain_averaging(kind):
    assert run(kind, 1.0, 0.0) == pytest.approx([float(c) for c in CONSENSUS], abs=1e-7)


def test_the_reducer_applies_the_outer_step_after_the_division_and_anchors_on_what_it_sent():
    """Nesterov in the reducer: the global the ranks receive is the outer step of the
    weighted mean; with bf16 the anchor is the bf16 value sent, bit for bit."""
    rng = np.random.default_rng(3)
    for bf16 in (False, True):
        red = BusReducer(bf16_wire=bf16, outer=OuterOptimizer("nesterov", lr=0.7, momentum=0.9))
        means, sent = [], []
        for cycle in (1, 2, 3):
            ps = [rng.standard_normal((4, 3)).astype(np.float32) for _ in range(2)]
            red.open(cycle, [0, 1])
            red.contribute(0, *pack_round([ps[0] * np.float32(1.0)], cycle=cycle, weight=1.0))
            res = red.contribute(1, *pack_round([ps[1] * np.float32(3.0)], cycle=cycle, weight=3.0))
            means.append((ps[0] + 3 * ps[1]) / np.float32(4.0))
            sent.append(unpack_round(res.header, res.blobs)[0])
            np.testing.assert_array_equal(red.outer.latest.anchor[0], sent[-1])
        g, u = means[0], np.zeros_like(means[0])
        for c, got in zip(means[1:], sent[1:]):
            delta = g - c
            u = 0.9 * u + delta
            g = g - 0.7 * (delta + 0.9 * u)
            if bf16:
                g = bf16_to_f32(f32_to_bf16(g.astype(np.float32)))
            np.testing.assert_allclose(got, g, rtol=1e-5 if not bf16 else 2e-2, atol=1e-5 if not bf16 else 2e-2)
            g = got  # continue from what was sent (the reducer's anchor)


def test_zero_mass_round_is_no_outer_step():
    red = BusReducer(outer=OuterOptimizer("slowmo", lr=0.5, momentum=0.5))
    red.open(1, [0])
    red.contribute(0, *pack_round([np.ones(3, np.float32)], cycle=1, weight=1.0))
    red.open(2, [0])
    res = red.contribute(0, *pack_round([np.zeros(3, np.float32)], cycle=2, weight=0.0))
    assert res.header.weight == 0.0 and red.outer.latest.cycle == 1 and red.outer.latest.steps == 1
    assert red.outer.state_at(2) is red.outer.latest  # the state after cycle 2 is cycle 1's


def test_state_round_trip_and_refusals(tmp_path):
    opt = OuterOptimizer("nesterov", lr=0.7, momentum=0.9)
    for t, c in enumerate([1.0, 0.5, 0.25], 1):
        opt.step(t, [np.full((2, 3), c, np.float32), np.full(4, -c, np.float32)])
    path = tmp_path / OUTER_FILE
    with open(path, "wb") as fh:
        save_state(opt.latest, fh)
    got = load_state(str(path))
    assert (got.kind, got.cycle, got.steps, got.lr, got.beta) == ("nesterov", 3, 3, 0.7, 0.9)
    for a, b in zip(got.anchor + got.momentum, opt.latest.anchor + opt.latest.momentum):
        np.testing.assert_array_equal(a, b)
    fresh = OuterOptimizer("nesterov", lr=0.7, momentum=0.9)
    fresh.restore(got)
    nxt = [np.full((2, 3), 0.1, np.float32), np.full(4, -0.1, np.float32)]
    for a, b in zip(fresh.step(4, nxt), opt.step(4, nxt)):
        np.testing.assert_array_equal(a, b)  # resumed = never stopped
    with pytest.raises(OuterError, match="for 'nesterov', this run uses 'slowmo'"):
        OuterOptimizer("slowmo", lr=0.7, momentum=0.9).restore(got)
    path.write_bytes(b"not an npz")
    with pytest.raises(OuterError, match="unreadable"):
        load_state(str(path))
    with pytest.raises(OuterError, match="shapes differ"):
        fresh.step(5, [np.ones(3, np.float32)])


@pytest.mark.parametrize(
    "flags, match",
    [
        ({"outer_optimizer": "adam"}, "outer_optimizer must be one of none, slowmo, nesterov"),
        ({"outer_optimizer": "slowmo", "outer_lr": 0}, "outer_lr must be a finite number > 0"),
        ({"outer_optimizer": "nesterov", "outer_momentum": 1.0}, r"outer_momentum must be in \[0, 1\)"),
        ({"outer_optimizer": "slowmo", "plane": "collective"}, "outer_optimizer needs plane = bus"),
    ],
)
def test_settings_refuse_bad_outer_settings_in_one_line(flags, match):
    with pytest.raises(SettingsError, match=match) as e:
        load_settings(env={}, flags={"world_size": 2, **flags})
    assert "\n" not in str(e.value)


def test_settings_reach_the_reducer_from_env_and_flags():
    s = load_settings(env={"FLODL_OUTER_OPTIMIZER": "slowmo", "FLODL_OUTER_LR": "0.5"}, flags={"world_size": 2, "outer_momentum": 0.25})
    assert (s.outer_optimizer, s.outer_lr, s.outer_momentum) == ("slowmo", 0.5, 0.25)
    ck = Checkpointing(s)
    assert (ck.outer.kind, ck.outer.lr, ck.outer.beta) == ("slowmo", 0.5, 0.25)


# -- through a checkpoint --------------------------------------------------------------

CFG = dict(world_size=2, batch_size=4, num_epochs=5, seed=7, total_samples=100, policy="sync")


def _meta(version: int, cycle: int) -> dict:
    st = initial_state(CoreConfig(**CFG))
    _coverage.open_epoch(st.coverage, 0, 100)
    _coverage.record_batch(st.coverage, 0, 0, 8, 16, 1, 1)
    st.rounds.version = version
    return json.loads(json.dumps(checkpoint_meta(st, version, cycle=cycle)))


def _settings(tmp_path, **kw) -> Settings:
    base = dict(world_size=2, batch_size=4, epochs=5, seed=7, total_samples=100, policy="sync",
                checkpoint_dir=str(tmp_path / "ck"), outer_optimizer="slowmo", outer_lr=0.5, outer_momentum=0.5)  # fmt: skip
    base.update(kw)
    return Settings(**base)


def _checkpoint_at_cycle(tmp_path, ck: Checkpointing, version: int, cycle: int) -> str:
    path = ck.store.model_path(version, 0)
    with open(path, "wb") as fh:
        fh.write(b"model")
    ck.on_notice(Notice(META_NOTICE, {"version": version, "meta": _meta(version, cycle)}))
    ck.on_result(0, pb.Timing.CheckpointResult(version=version, sha256=hashlib.sha256(b"model").digest()))
    (c,) = ck.store.committed
    return c.path


def test_outer_state_of_the_checkpoint_cycle_is_saved_verified_and_restored(tmp_path):
    ck = Checkpointing(_settings(tmp_path))
    red = BusReducer(outer=ck.outer)
    for cycle, value in ((1, 1.0), (2, 0.5), (3, 0.8)):
        red.open(cycle, [0])
        red.contribute(0, *pack_round([np.full(3, value, np.float32)], cycle=cycle, weight=1.0))
    want = ck.outer.state_at(2)
    # The core names the last *finished* round (2) while the reducer is already past it (3).
    path = _checkpoint_at_cycle(tmp_path, ck, 4, cycle=2)
    meta = json.loads(open(os.path.join(path, META_FILE)).read())
    assert set(meta["sidecars"]) == {OUTER_FILE} and meta["cycle"] == 2
    assert sorted(os.listdir(path)) == [META_FILE, "model.pt", OUTER_FILE]

    resumed = Checkpointing(_settings(tmp_path, checkpoint_dir="", resume=path))
    got = resumed.outer.latest
    assert got.cycle == 2 and got.steps == 2
    np.testing.assert_array_equal(got.anchor[0], want.anchor[0])
    np.testing.assert_array_equal(got.momentum[0], want.momentum[0])

    with pytest.raises(SettingsError, match="resume refused: the saved outer state is for 'slowmo'"):
        Checkpointing(_settings(tmp_path, checkpoint_dir="", resume=path, outer_optimizer="nesterov"))
    assert Checkpointing(_settings(tmp_path, checkpoint_dir="", resume=path, outer_optimizer="none")).outer.latest is None

    with open(os.path.join(path, OUTER_FILE), "r+b") as fh:  # torn / tampered
        fh.seek(-8, os.SEEK_END)
        fh.write(b"\0" * 8)
    with pytest.raises(CheckpointError, match=f"torn checkpoint .*{OUTER_FILE} sha256"):
        load_checkpoint(path)
    with pytest.raises(SettingsError, match="resume refused: torn checkpoint"):
        Checkpointing(_settings(tmp_path, checkpoint_dir="", resume=path))
    os.unlink(os.path.join(path, OUTER_FILE))
    with pytest.raises(CheckpointError, match=f"{OUTER_FILE} is missing"):
        load_checkpoint(path)


def test_no_outer_optimizer_writes_no_sidecar(tmp_path):
    ck = Checkpointing(_settings(tmp_path, outer_optimizer="none"))
    path = _checkpoint_at_cycle(tmp_path, ck, 1, cycle=0)
    assert "sidecars" not in load_checkpoint(path).meta and not os.path.exists(os.path.join(path, OUTER_FILE))


def test_npz_is_plain_arrays_no_pickle():
    opt = OuterOptimizer("slowmo", lr=0.5, momentum=0.5)
    opt.step(1, [np.ones(2, np.float32)])
    buf = io.BytesIO()
    save_state(opt.latest, buf)
    buf.seek(0)
    with np.load(buf, allow_pickle=False) as z:
        assert str(z["kind"]) == "slowmo" and z["g0"].dtype == np.float32
