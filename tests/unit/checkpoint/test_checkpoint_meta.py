"""flodl.core._checkpoint: the meta a checkpoint records and the resume point it gives.

States are built by hand (coverage ledger calls) or by driving the real core with the
in-memory Cluster; the meta always goes through a JSON round trip, as on disk.
"""

from __future__ import annotations

import json

import pytest

from flodl.core import CoreConfig, LocalViolation, checkpoint_meta, initial_state, resume_plan, validate_meta
from flodl.core import _coverage
from flodl.core._checkpoint import SCHEMA_VERSION, complement, covered_ranges


def config(**over) -> CoreConfig:
    base = dict(world_size=2, batch_size=1, num_epochs=5, seed=7, total_samples=100, policy="sync")
    base.update(over)
    return CoreConfig(**base)


def roundtrip(meta: dict) -> dict:
    return json.loads(json.dumps(meta))


def scenario_84():
    """Spec scenario 84, in our terms: epochs 0-1 aggregated; in epoch 2, (0,40) is
    committed and (50,30) is trained by rank 1 but not yet folded (in flight)."""
    st = initial_state(config())
    for e in (0, 1):
        _coverage.open_epoch(st.coverage, e, 100)
        _coverage.record_batch(st.coverage, 0, e, 0, 100, e + 1, e + 1)  # folded at once
        _coverage.freeze(st.coverage, e)
    st.metrics.last_aggregated = 1
    _coverage.open_epoch(st.coverage, 2, 100)
    _coverage.record_batch(st.coverage, 0, 2, 0, 40, 3, 2)
    _coverage.commit(st.coverage, 0, 3)
    _coverage.record_batch(st.coverage, 1, 2, 50, 30, 1, 0)  # pending: not committed
    st.rounds.version, st.rounds.cycle, st.rounds.global_step = 12, 12, 70
    return st


# -- ranges ------------------------------------------------------------------------------


def test_covered_ranges_are_the_runs_of_committed_positions():
    assert covered_ranges(bytearray(b"\x00\x01\x01\x00\x01")) == [(1, 2), (4, 1)]
    assert covered_ranges(bytearray(5)) == []
    assert covered_ranges(bytearray(b"\x01" * 4)) == [(0, 4)]
    assert covered_ranges(bytearray()) == []


def test_complement_is_what_is_left_of_the_epoch():
    assert complement([(1, 2), (4, 1)], 5) == [(0, 1), (3, 1)]
    assert complement([], 7) == [(0, 7)]
    assert complement([(0, 7)], 7) == []
    assert complement(complement([(2, 3), (9, 1)], 10), 10) == [(2, 3), (9, 1)]


# -- checkpoint_meta ---------------------------------------------------------------------


def test_meta_records_the_epoch_in_progress_as_covered_ranges():
    meta = roundtrip(checkpoint_meta(scenario_84(), 12))
    assert meta["schema_version"] == SCHEMA_VERSION
    assert (meta["version"], meta["cycle"], meta["global_step"], meta["averages"]) == (12, 12, 70, 12)
    assert (meta["epoch"], meta["last_aggregated_epoch"], meta["reason"]) == (2, 1, "checkpoint")
    assert meta["run"] == {
        "seed": 7, "world_size": 2, "total_samples": 100, "batch_size": 1, "num_epochs": 5, "policy": "sync",
    }  # fmt: skip
    assert meta["coverage"]["epochs"] == [{"epoch": 2, "expected": 100, "covered": [[0, 40]], "discarded": 0}]
    assert [row["epoch"] for row in meta["history"]["coverage"]] == [0, 1]
    assert all(row["missing"] == 0 for row in meta["history"]["coverage"])
    assert meta["policy_state"] == {}  # Sync has no scheduler state


def test_meta_reads_the_state_and_changes_nothing():
    st = scenario_84()
    before = (bytes(st.coverage.epochs[2].committed), dict(st.coverage.pending), st.rounds.version)
    checkpoint_meta(st, 12, reason="reduce_stall", cycle=0)
    assert (bytes(st.coverage.epochs[2].committed), dict(st.coverage.pending), st.rounds.version) == before


def test_meta_policy_state_is_opaque_but_must_be_json_safe():
    st = scenario_84()
    meta = checkpoint_meta(st, 12, policy_state={"elche": {"anchor": 4, "ms": [1.5, 2.0]}, "guard": None})
    assert roundtrip(meta)["policy_state"] == {"elche": {"anchor": 4, "ms": [1.5, 2.0]}, "guard": None}
    with pytest.raises(LocalViolation, match="policy_state.bad"):
        checkpoint_meta(st, 12, policy_state={"bad": object()})
    with pytest.raises(LocalViolation, match="reason"):
        checkpoint_meta(st, 12, reason="whim")


def test_meta_under_cadence_carries_elche_state_by_default():
    st = initial_state(config(policy="cadence"))
    ps = roundtrip(checkpoint_meta(st, 0))["policy_state"]
    assert set(ps) == {"elche"} and {"anchor", "phase", "calibration_count"} <= set(ps["elche"])


# -- resume_plan -------------------------------------------------------------------------


def test_resume_plan_trains_exactly_the_uncovered_positions():
    point = resume_plan(roundtrip(checkpoint_meta(scenario_84(), 12)))
    assert (point.epoch, point.last_aggregated_epoch, point.global_step, point.version) == (2, 1, 70, 12)
    assert point.uncovered(2) == ((40, 60),)  # the in-flight (50,30) was never folded
    assert point.covered_in(2) == ((0, 40),)
    assert point.remaining(2) == 60
    assert point.uncovered(1) == () and point.uncovered(0) == ()  # aggregated: done
    assert point.uncovered(3) == ((0, 100),)  # not started


def test_resume_plan_of_a_fresh_run_is_epoch_zero_whole():
    point = resume_plan(roundtrip(checkpoint_meta(initial_state(config()), 0)))
    assert (point.epoch, point.last_aggregated_epoch, point.uncovered(0)) == (0, None, ((0, 100),))


def test_resume_plan_refuses_an_unreadable_meta_by_name():
    meta = roundtrip(checkpoint_meta(scenario_84(), 12))
    del meta["global_step"]
    with pytest.raises(ValueError, match="global_step"):
        resume_plan(meta)


# -- validate_meta -----------------------------------------------------------------------


def test_validate_accepts_its_own_run_and_names_every_mismatch():
    meta = roundtrip(checkpoint_meta(scenario_84(), 12))
    assert validate_meta(meta, config()) == []
    reasons = validate_meta(meta, config(seed=8, world_size=3, batch_size=2, policy="cadence", total_samples=99))
    text = " | ".join(reasons)
    assert len(reasons) == 5
    assert "seed 7 in the checkpoint differs from this run's 8" in text
    assert "world_size 2" in text and "batch_size 1" in text and "'sync'" in text and "total_samples 100" in text


def test_validate_checks_the_cohort_size_when_the_config_leaves_it_open():
    meta = roundtrip(checkpoint_meta(scenario_84(), 12))
    assert validate_meta(meta, config(total_samples=0)) == []
    assert validate_meta(meta, config(total_samples=0), total_samples=100) == []
    assert "total_samples 100" in validate_meta(meta, config(total_samples=0), total_samples=64)[0]


def test_validate_refuses_a_finished_run_and_newer_or_garbled_schemas():
    meta = roundtrip(checkpoint_meta(scenario_84(), 12))
    assert "nothing left to train" in validate_meta(meta, config(num_epochs=2))[0]
    assert validate_meta(meta, config(num_epochs=3)) == []
    newer = dict(meta, schema_version=SCHEMA_VERSION + 1)
    assert "newer" in validate_meta(newer, config())[0]
    assert validate_meta([], config()) == ["meta is not a JSON object"]
    assert "schema_version" in validate_meta({}, config())[0]


@pytest.mark.parametrize(
    "covered, why",
    [([[0, 40], [30, 20]], "overlaps"), ([[90, 20]], "outside"), ([[5, 0]], "empty"), ([[1]], "not [offset, size]")],
)
def test_validate_refuses_malformed_coverage(covered, why):
    meta = roundtrip(checkpoint_meta(scenario_84(), 12))
    meta["coverage"]["epochs"][0]["covered"] = covered
    (reason,) = validate_meta(meta, config())
    assert "coverage of epoch 2 is malformed" in reason and why in reason


# -- against the real core ---------------------------------------------------------------


def _committed(cluster, epoch: int) -> set[int]:
    """Positions of ``epoch`` committed, from the ranks' own record of what they trained
    and the core's folded step per rank -- independently of the coverage ledger."""
    out: set[int] = set()
    for r in cluster.ranks:
        folded = cluster.state.ranks[r.rank].folded_step
        for e, off, n, step in r.trained:
            if e == epoch and step <= folded:
                out.update(range(off, off + n))
    return out


@pytest.mark.parametrize("policy", ["sync", "cadence"])
def test_meta_of_a_live_core_covers_exactly_the_committed_positions(Cluster, policy):
    c = Cluster(world_size=3, total=120, batch_size=4, epochs=3, policy=policy, anchor=2)
    c.join_all()
    st = c.state
    # Mid-epoch 1: epoch 0 aggregated, a few rounds into epoch 1, no round open.
    c.run_until(
        lambda: st.metrics.last_aggregated == 0
        and 1 in st.coverage.epochs
        and 0 < st.coverage.epochs[1].unique < 120
        and st.rounds.phase.__name__ == "IDLE"
    )
    assert c.finished is None and st.metrics.last_aggregated == 0
    trained = {p for r in c.ranks for e, off, n, _ in r.trained if e == 1 for p in range(off, off + n)}
    meta = roundtrip(checkpoint_meta(st, st.rounds.version))
    point = resume_plan(meta)
    covered = {p for off, n in point.covered_in(1) for p in range(off, off + n)}
    left = {p for off, n in point.uncovered(1) for p in range(off, off + n)}
    assert covered == _committed(c, 1) and covered
    assert covered | left == set(range(120)) and not covered & left  # each sample exactly once
    assert trained - covered <= left  # trained but never folded: trained again after resume
    assert point.epoch == 1 and point.uncovered(0) == () and point.uncovered(2) == ((0, 120),)
    assert validate_meta(meta, c.config, total_samples=120) == []
