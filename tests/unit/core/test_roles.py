"""flodl.core._roles: callback roles (election, death, calibration), eval failover, intents.

Scenarios from the reference §12 I (77, 81, 82, 83), adapted to the bus core: no NCCL
dispatch folding, no callback slack (79).
"""

from __future__ import annotations

import pytest

from flodl.core import (
    FINAL_SCHEDULE_ID,
    CheckpointDone,
    CoreConfig,
    EvalDone,
    IntentRaised,
    Notice,
    Send,
    replay,
)
from flodl.core import _roles
from flodl.core import FINAL_EVAL, SHUTTING_DOWN

from .cluster import Cluster, controls


def notices(cmds, kind):
    return [x for x in cmds if isinstance(x, Notice) and x.kind == kind]


def roles(c: Cluster) -> tuple:
    ro = c.state.roles
    return (ro.checkpoint_role, ro.eval_role, ro.epoch_role)


# -- config ------------------------------------------------------------------------------


def test_policy_is_validated_and_rank_n_is_clamped():
    assert CoreConfig(world_size=3).epoch_callback_policy == "fastest"
    CoreConfig(world_size=3, epoch_callback_policy="rank:1")
    for bad in ("slowest", "rank:", "rank:-1", "rank:x", "Rank:1"):
        with pytest.raises(ValueError):
            CoreConfig(world_size=3, epoch_callback_policy=bad)
    ro = _roles.initial_roles(CoreConfig(world_size=3, epoch_callback_policy="rank:7"))
    assert (ro.checkpoint_role, ro.eval_role, ro.epoch_role) == (2, 2, 2)


# -- 81: Fastest resolution and re-resolution on death -----------------------------------


def _cadence3(**kw) -> Cluster:
    c = Cluster(world_size=3, total=120, batch_size=4, epochs=2, policy="cadence", **kw)
    c.join_all()
    return c


def test_81_fastest_is_the_lowest_pace():
    c = _cadence3()
    c.state.cadence.elche.report_timing([100, 50, 200], [10] * 3, 0)
    assert _roles.resolve_fastest(c.state) == 1


def test_81_tie_goes_to_the_lowest_rank():
    c = _cadence3()
    c.state.cadence.elche.report_timing([100, 50, 50], [10] * 3, 0)
    assert _roles.resolve_fastest(c.state) == 1


def test_81_no_pace_and_rank_0_dead_resolves_to_1():
    c = Cluster(world_size=3, total=120, batch_size=4, epochs=2, policy="sync")
    c.join_all()
    c.kill(0)
    assert _roles.resolve_fastest(c.state) == 1
    assert roles(c) == (1, 1, 1)  # Sync has no pace: every role went to the lowest alive


def test_81_death_of_the_holder_re_resolves_every_role_and_dirties():
    c = _cadence3()
    c.state.cadence.elche.report_timing([100, 50, 200], [10] * 3, 0)
    ro = c.state.roles
    ro.checkpoint_role = ro.eval_role = ro.epoch_role = 1
    ro.dirty = False
    c.kill(1)
    assert roles(c) == (0, 0, 0) and ro.dirty


def test_81_rank_policy_ignores_re_resolution_but_moves_the_checkpoint_role():
    c = _cadence3(epoch_callback_policy="rank:2")
    assert roles(c) == (2, 2, 2)
    c.kill(2)
    assert roles(c) == (0, 2, 2)  # only the checkpoint role fails over
    c = _cadence3(epoch_callback_policy="rank:0")
    c.state.roles.dirty = False
    c.kill(0)
    assert roles(c) == (1, 0, 0) and not c.state.roles.dirty


# -- 82: calibration election ------------------------------------------------------------


def test_82_calibration_election():
    c = _cadence3()
    ro = c.state.roles
    assert roles(c) == (0, 0, 0)
    ro.dirty = False
    _roles.on_calibration(c.state)  # no pace yet: nothing moves
    assert roles(c) == (0, 0, 0) and not ro.dirty and not ro.calibration_elected
    c.state.cadence.elche.report_timing([4000, 4000, 1200], [10] * 3, 0)
    _roles.on_calibration(c.state)
    assert roles(c) == (2, 2, 2) and ro.dirty
    # once: a later pace change does not move them (roles are sticky)
    c.state.cadence.elche.report_timing([100, 4000, 4000], [10] * 3, 0)
    _roles.on_calibration(c.state)
    assert roles(c) == (2, 2, 2)


def test_82_rank_policy_is_not_elected():
    c = _cadence3(epoch_callback_policy="rank:1")
    c.state.cadence.elche.report_timing([4000, 4000, 1200], [10] * 3, 0)
    _roles.on_calibration(c.state)
    assert roles(c) == (1, 1, 1)


def test_a_cadence_run_elects_the_fastest_announces_it_and_evaluates_there():
    c = Cluster(world_size=3, total=240, batch_size=4, epochs=3, policy="cadence", speeds=[30.0, 20.0, 10.0])
    c.join_all()
    res = c.run()
    assert res.ok
    assert roles(c) == (2, 2, 2)
    assert c.roles_told(0) == [0, 2]  # the first dispatch, then once after the calibration
    (x,) = controls(c.commands, "execute_eval")
    assert x[0] == 2 and x[1].execute_eval.final
    assert res.summary["accuracy"] == 0.875
    assert replay(c.config, c.journal) == c.state


# -- 77: checkpoint failover moves the checkpoint role ------------------------------------


def _one_pending(world_size: int = 3) -> Cluster:
    c = Cluster(world_size=world_size, total=60, batch_size=4, epochs=3, policy="sync", checkpoint_every=1)
    for r in c.ranks:
        r.deaf.add("checkpoint")
    c.join_all()
    c.run_until(lambda: c.sends("checkpoint"))
    return c


def test_77_failover_moves_the_role_then_gives_up():
    c = _one_pending()
    v = c.sends("checkpoint")[0].control.checkpoint.version
    cmds = c.feed(CheckpointDone(now=c.now, rank=0, version=v, error="x"))
    sent = [(x.rank, x.control.checkpoint.version) for x in cmds if isinstance(x, Send) and x.kind == "checkpoint"]
    assert sent == [(1, v)] and c.state.roles.checkpoint_role == 1
    c.feed(CheckpointDone(now=c.now, rank=1, version=v, error="x"))
    assert c.state.roles.checkpoint_role == 2 and c.state.checkpoints.pending[v][1] == (0, 1, 2)
    cmds = c.feed(CheckpointDone(now=c.now, rank=2, version=v, error="x"))
    assert notices(cmds, "checkpoint_abandoned") and v not in c.state.checkpoints.pending


def test_77_success_after_a_failure_keeps_the_saver_as_role_and_seeds_the_ewma():
    c = _one_pending()
    v = c.sends("checkpoint")[0].control.checkpoint.version
    c.feed(CheckpointDone(now=c.now, rank=0, version=v, error="x"))
    c.feed(CheckpointDone(now=c.now, rank=1, version=v, elapsed_ms=7.0))
    ro = c.state.roles
    assert v not in c.state.checkpoints.pending
    assert ro.checkpoint_role == 1 and ro.checkpoint_ewma_ms == 7.0
    # the next regular save goes to the role (rank 1), not the lowest alive rank
    c.run_until(lambda: len(c.sends("checkpoint")) >= 3)
    assert c.sends("checkpoint")[2].rank == 1


def test_callback_cost_ewma():
    c = _one_pending()
    _roles.absorb_cost(c.state, "checkpoint", 100.0)
    _roles.absorb_cost(c.state, "checkpoint", 50.0)
    assert c.state.roles.checkpoint_ewma_ms == pytest.approx(85.0)


# -- final eval failover -------------------------------------------------------------------


def test_a_final_eval_error_is_resent_to_the_next_untried_rank():
    c = Cluster(world_size=3, total=12, batch_size=4, epochs=1, policy="sync")
    for r in c.ranks:
        r.deaf.add("execute_eval")
    c.join_all()
    c.run_until(lambda: c.state.run.phase is FINAL_EVAL)
    base = dict(schedule_id=FINAL_SCHEDULE_ID, epoch=1, final=True)
    cmds = c.feed(EvalDone(now=c.now, rank=0, metric=0.0, error="no held-out set", **base))
    (retry,) = [x for x in cmds if isinstance(x, Send) and x.kind == "execute_eval"]
    assert retry.rank == 1 and retry.control.execute_eval.final
    assert notices(cmds, "final_eval_retry") and not notices(cmds, "final_eval")
    c.feed(EvalDone(now=c.now, rank=1, metric=0.5, elapsed_ms=30.0, **base))
    assert c.state.run.phase is SHUTTING_DOWN
    assert c.state.roles.eval_ewma_ms == pytest.approx(0.3 * 30.0)  # the error (0 ms) seeded it
    assert c.run().summary["accuracy"] == 0.5


def test_every_rank_failing_the_final_eval_skips_the_accuracy():
    c = Cluster(world_size=3, total=12, batch_size=4, epochs=1, policy="sync", eval_error="no held-out set")
    c.join_all()
    res = c.run()
    assert res.ok and res.summary["accuracy"] is None
    assert [x[0] for x in controls(c.commands, "execute_eval")] == [0, 1, 2]


# -- 83: intents ---------------------------------------------------------------------------


def test_83_intents_set_both_flags():
    c = Cluster(world_size=2, total=32, batch_size=4, epochs=2, policy="sync")
    c.join_all()
    c.feed(IntentRaised(now=c.now, rank=1, kind="eval"))
    c.feed(IntentRaised(now=c.now, rank=0, kind="checkpoint"))
    ro = c.state.roles
    assert ro.pending_eval_intent and ro.pending_checkpoint_intent


def _intents(**kw) -> Cluster:
    c = Cluster(world_size=2, total=32, batch_size=4, epochs=3, policy="sync", **kw)
    c.join_all()
    c.feed(IntentRaised(now=c.now, rank=1, kind="eval"))
    c.feed(IntentRaised(now=c.now, rank=0, kind="checkpoint"))
    return c


def test_83_intents_are_served_at_the_next_aggregation():
    c = _intents(checkpoint_on_failure=True)
    res = c.run()
    assert res.ok
    evals = controls(c.commands, "execute_eval")
    (rank, ctl), final = evals[0], evals[1]
    x = ctl.execute_eval
    assert (rank, x.schedule_id, x.epoch, x.target_rank, x.final) == (0, 0, 0, 0, False)
    assert final[1].execute_eval.final
    cks = c.sends("checkpoint")
    assert len(cks) == 1 and cks[0].rank == 0
    metas = [n.data for n in c.of_type(Notice) if n.kind == "checkpoint_meta"]
    assert metas[0]["meta"]["epoch"] == 1  # saved right after epoch 0 aggregated
    assert res.summary["evals"] == [{"epoch": 0, "metric": 0.875}]
    ro = c.state.roles
    assert not ro.pending_eval_intent and not ro.pending_checkpoint_intent and ro.pending_evals == {}
    # both went out after epoch 0's aggregation and before epoch 1's dispatch
    k = [x.kind if isinstance(x, Send) else getattr(x, "kind", "") for x in c.commands]
    agg = k.index("epoch_aggregated")
    second_start = [i for i, v in enumerate(k) if v == "start_epoch"][2]  # 2 ranks x epoch 0
    assert agg < k.index("checkpoint") < second_start and agg < k.index("execute_eval") < second_start
    assert replay(c.config, c.journal) == c.state


def test_83_a_checkpoint_intent_without_checkpoints_is_dropped_with_a_notice():
    c = _intents()
    res = c.run()
    assert res.ok and not c.sends("checkpoint")
    (drop,) = [n for n in c.of_type(Notice) if n.kind == "intent_dropped"]
    assert drop.data["kind"] == "checkpoint" and drop.data["epoch"] == 0
    assert res.summary["evals"] == [{"epoch": 0, "metric": 0.875}]


def test_83_an_eval_intent_goes_to_the_eval_role_and_errors_are_only_reported():
    c = Cluster(world_size=2, total=32, batch_size=4, epochs=2, policy="sync", eval_error="broken")
    c.join_all()
    c.state.roles.eval_role = 1
    c.feed(IntentRaised(now=c.now, rank=0, kind="eval"))
    res = c.run()
    first = controls(c.commands, "execute_eval")[0]
    assert first[0] == 1 and not first[1].execute_eval.final
    assert [n.data["epoch"] for n in c.of_type(Notice) if n.kind == "eval_failed"] == [0]
    assert res.summary["evals"] == []
