"""Reference §12 I (callbacks and roles), scenarios 76-84, against the real core.

Already covered elsewhere: 77, 81, 82, 83 -- ``test_roles.py``; 78's epoch_fn half and
79 -- ``test_slack.py``; 84's resume from coverage -- ``test_checkpointing.py::
test_a_resumed_run_trains_exactly_the_uncovered_positions``.

Deliberate differences from upstream (ARCHITECTURE.md wins):

* 76/78: upstream also subtracts a callback's elapsed time from the window ledger. Our
  ledger sums each batch's own ``batch_ms`` (compute only), which never contains
  callback time, so only the EWMA moves.
* 80: checkpoints and evals are decided at an epoch's aggregation (every rank then holds
  the consensus) rather than folded into ``dispatch_epoch``, on every plane; evals are
  asked by an intent (there is no ``eval_every``). What 80 pins -- a targeted command
  to the role rank only, never a broadcast -- holds.
* 84: there is no one-shot ``checkpoint_at_epoch``; a save happens at an epoch boundary or
  on failure, and a mid-epoch meta (the failure save) carries the uncovered ranges.
"""

from __future__ import annotations

import pytest

from flodl.core import CheckpointDone, EvalDone, IntentRaised, Send

from .cluster import Cluster, controls


def _with_checkpoints(**kw) -> Cluster:
    c = Cluster(world_size=2, total=32, batch_size=4, epochs=3, policy="sync", checkpoint_every=1, **kw)
    c.join_all()
    c.run_until(lambda: c.sends("checkpoint"))
    return c


def test_76_checkpoint_success_bookkeeping():
    c = _with_checkpoints()
    (ck,) = c.sends("checkpoint")
    v = ck.control.checkpoint.version
    assert ck.rank == 0 and v in c.state.checkpoints.pending
    c.feed(CheckpointDone(now=c.now, rank=0, version=v, elapsed_ms=30.0))
    ro = c.state.roles
    assert ro.checkpoint_ewma_ms == 30.0 and ro.checkpoint_role == 0
    assert v not in c.state.checkpoints.pending  # tried(7) forgotten


def test_76_ewma_of_two_saves_is_85():
    c = _with_checkpoints()
    v = c.sends("checkpoint")[0].control.checkpoint.version
    c.feed(CheckpointDone(now=c.now, rank=0, version=v, elapsed_ms=100.0))
    c.run_until(lambda: len(c.sends("checkpoint")) >= 2)
    v2 = c.sends("checkpoint")[1].control.checkpoint.version
    c.feed(CheckpointDone(now=c.now, rank=0, version=v2, elapsed_ms=50.0))
    assert c.state.roles.checkpoint_ewma_ms == pytest.approx(85.0)


def test_78_eval_bookkeeping_an_error_still_updates_the_ewma():
    c = Cluster(world_size=2, total=32, batch_size=4, epochs=3, policy="sync")
    for r in c.ranks:
        r.deaf.add("execute_eval")  # answered by hand below
    c.join_all()
    c.feed(IntentRaised(now=c.now, rank=1, kind="eval"))
    c.run_until(lambda: controls(c.commands, "execute_eval"))
    (rank, x) = controls(c.commands, "execute_eval")[0]
    e = x.execute_eval
    c.feed(EvalDone(now=c.now, rank=rank, schedule_id=e.schedule_id, epoch=e.epoch, metric=0.5, elapsed_ms=30.0))
    assert c.state.roles.eval_ewma_ms == 30.0
    c.feed(IntentRaised(now=c.now, rank=1, kind="eval"))
    c.run_until(lambda: len(controls(c.commands, "execute_eval")) >= 2)
    (rank, x) = controls(c.commands, "execute_eval")[1]
    e = x.execute_eval
    c.feed(EvalDone(now=c.now, rank=rank, schedule_id=e.schedule_id, epoch=e.epoch, metric=0.0,
                    elapsed_ms=10.0, error="no held-out set"))  # fmt: skip
    assert c.state.roles.eval_ewma_ms == pytest.approx(0.3 * 10.0 + 0.7 * 30.0)
    assert c.state.roles.evals == [{"epoch": 0, "metric": 0.5}]


@pytest.mark.parametrize("policy", ["sync", "cadence"])
def test_80_checkpoint_and_eval_are_targeted_at_the_role_rank_only(policy):
    c = Cluster(world_size=2, total=32, batch_size=4, epochs=2, policy=policy, checkpoint_every=1,
                epoch_callback_policy="rank:1")  # fmt: skip
    c.join_all()
    c.feed(IntentRaised(now=c.now, rank=0, kind="eval"))
    assert c.run().ok
    targeted = [x for x in c.commands if isinstance(x, Send) and x.kind in ("checkpoint", "execute_eval")]
    assert targeted and {x.rank for x in targeted} == {1}
    assert all(x.control.checkpoint.target_rank == 1 for x in targeted if x.kind == "checkpoint")
    assert all(x.control.execute_eval.target_rank == 1 for x in targeted if x.kind == "execute_eval")
    assert "checkpoint" not in c.out(0) and "execute_eval" not in c.out(0)
