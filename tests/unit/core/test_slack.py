"""Callback slack and ``EpochFnElapsed`` (reference §10.5, §10.8; scenarios 78 and 79).

The Python core stages the slack for the *first* window of the epoch that follows a
callback, not for the last window before it as upstream does: here an epoch ends on a
round and the callbacks run between epochs (``flodl/core/cadence/_slack.py`` says why). The
scenario-79 numbers are kept; what "the next window" means is ours.
"""

from __future__ import annotations

import json
import math

import pytest

from flodl.core import EpochFnElapsed, Notice, Send, from_record, to_record
from flodl.core.cadence import _slack
from flodl.core import DEAD
from flodl.wire import pb

from .cluster import Cluster


def _boundary(ws: int = 2, anchor: int = 10, **kw) -> Cluster:
    """Scenario 79's state: Cadence E(2,10) after report_timing([500,1000],[10,10],10)
    -- counts [20,10], anchor wall 1000 ms, threshold 100 ms -- with roles on rank 0 and
    epoch 0 aggregated, so ``plan(st, 1)`` asks about epoch 1's first window."""
    c = Cluster(world_size=ws, total=100, batch_size=1, epochs=3, policy="cadence", anchor=anchor, **kw)
    c.join_all()
    st = c.state
    st.cadence.elche.report_timing([500.0, 1000.0][:ws], [10] * ws, 10)
    st.roles.checkpoint_role = st.roles.eval_role = st.roles.epoch_role = 0
    st.metrics.last_aggregated = 0
    return c


# -- the event ------------------------------------------------------------------------------


def test_epoch_fn_elapsed_round_trips_through_json_records():
    ev = EpochFnElapsed(now=1.5, rank=1, epoch=3, elapsed_ms=250.0)
    rec = json.loads(json.dumps(to_record(ev)))
    assert rec == {"type": "EpochFnElapsed", "now": 1.5, "rank": 1, "epoch": 3, "elapsed_ms": 250.0}
    assert from_record(rec) == ev


def test_epoch_fn_elapsed_is_translated_from_the_wire():
    from flodl.core import timing_event

    t = pb.Timing(rank=2, epoch_fn_elapsed=pb.Timing.EpochFnElapsed(epoch=4, elapsed_ms=12.5))
    assert timing_event(7.0, t) == EpochFnElapsed(now=7.0, rank=2, epoch=4, elapsed_ms=12.5)


def test_78_epoch_fn_cost_is_smoothed_and_refreshes_liveness():
    # Scenario 78 (epoch_fn half): EWMA alpha 0.3, first sample seeds. Upstream also
    # subtracts the time from the window ledger; ours feeds ElChe compute-only batch_ms,
    # which never contained callback time, so there is nothing to subtract.
    c = Cluster(world_size=3, total=30, batch_size=1, epochs=1, policy="cadence")
    c.join_all()
    c.now = 5.0
    c.feed(EpochFnElapsed(now=5.0, rank=1, epoch=0, elapsed_ms=100.0))
    assert c.state.roles.epoch_fn_ewma_ms == 100.0
    assert c.state.ranks[1].last_seen == 5.0
    c.feed(EpochFnElapsed(now=5.0, rank=1, epoch=1, elapsed_ms=50.0))
    assert c.state.roles.epoch_fn_ewma_ms == pytest.approx(85.0)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -1.0])
def test_a_non_finite_or_negative_epoch_fn_time_is_ignored_and_counted(bad):
    c = Cluster(world_size=2, total=20, batch_size=1, epochs=1, policy="cadence")
    c.join_all()
    c.feed(EpochFnElapsed(now=0.0, rank=0, epoch=0, elapsed_ms=bad))
    assert c.state.roles.epoch_fn_ewma_ms is None
    assert any("EpochFnElapsed" in k for k in c.state.ignored)


def test_epoch_fn_time_from_a_dead_rank_is_ignored():
    c = Cluster(world_size=2, total=20, batch_size=1, epochs=1, policy="cadence")
    c.join_all()
    c.kill(1)
    c.feed(EpochFnElapsed(now=0.0, rank=1, epoch=0, elapsed_ms=500.0))
    assert c.state.ranks[1].phase is DEAD and c.state.roles.epoch_fn_ewma_ms is None


# -- 79: the plan -----------------------------------------------------------------------------


def test_79_epoch_fn_slack_goes_to_the_epoch_role():
    c = _boundary()
    el = c.state.cadence.elche
    assert el.batch_counts == [20, 10] and el.anchor_wall_ms() == 1000.0
    assert _slack.threshold_ms(c.state) == 100.0
    c.state.roles.epoch_fn_ewma_ms = 1000.0
    slack, why = _slack.plan(c.state, 1)
    assert slack == [1000.0, 0.0], why


@pytest.mark.parametrize(
    "setup, reason",
    [
        (lambda st: setattr(st.roles, "epoch_fn_ewma_ms", 50.0), "no callback cost >= 100 ms"),
        (lambda st: setattr(st.roles, "epoch_fn_ewma_ms", None), "no callback cost >= 100 ms"),
        (lambda st: setattr(st.cadence.elche, "calibrated", False), "not calibrated"),
        (lambda st: setattr(st.metrics, "last_aggregated", None), "no callback cost"),
    ],
    ids=["below-threshold", "no-sample", "uncalibrated", "no-epoch-boundary"],
)
def test_79_no_slack(setup, reason):
    c = _boundary()
    c.state.roles.epoch_fn_ewma_ms = 1000.0
    setup(c.state)
    slack, why = _slack.plan(c.state, 1)
    assert slack is None and reason in why


def test_79_no_slack_without_cadence():
    c = Cluster(world_size=2, total=20, batch_size=1, epochs=2, policy="sync")
    c.join_all()
    c.state.roles.epoch_fn_ewma_ms = 1000.0
    c.state.metrics.last_aggregated = 0
    assert _slack.plan(c.state, 1) == (None, "no ElChe windows (not Cadence)")


def test_the_threshold_is_five_percent_of_the_anchor_wall_once_that_is_larger():
    c = _boundary(anchor=100)  # anchor wall 100 x 100 ms = 10 s -> threshold 500 ms
    assert _slack.threshold_ms(c.state) == 500.0
    c.state.roles.epoch_fn_ewma_ms = 499.0
    assert _slack.plan(c.state, 1)[0] is None
    c.state.roles.epoch_fn_ewma_ms = 500.0
    assert _slack.plan(c.state, 1)[0] == [500.0, 0.0]


def test_checkpoint_and_eval_asked_at_this_boundary_add_up_on_their_ranks():
    c = _boundary(ws=2)
    st, ro = c.state, c.state.roles
    ro.epoch_fn_ewma_ms, ro.checkpoint_ewma_ms, ro.eval_ewma_ms = 300.0, 400.0, 200.0
    st.checkpoints.pending[st.rounds.version] = (0, (0, 1))  # rank 0 refused, rank 1 saves now
    ro.pending_evals[0] = (0, 0)  # eval of epoch 0 on rank 0
    assert _slack.plan(st, 1)[0] == [500.0, 400.0]
    # a save asked before the last finished round and an eval of an older epoch are not
    # paid at this boundary
    st.checkpoints.pending = {st.rounds.version - 1: (0, (1,))}
    ro.pending_evals = {7: (-1, 0)}
    assert _slack.plan(st, 1)[0] == [300.0, 0.0]


def test_slack_follows_a_save_that_failed_over_and_skips_the_dead():
    c = _boundary(ws=2)
    c.state.roles.checkpoint_ewma_ms = 400.0
    c.state.checkpoints.pending[c.state.rounds.version] = (0, (1,))
    assert _slack.plan(c.state, 1)[0] == [0.0, 400.0]
    c.kill(1)  # the save asked of rank 1 fails over to rank 0
    assert c.state.checkpoints.pending[c.state.rounds.version][1] == (1, 0)
    assert _slack.plan(c.state, 1)[0] == [400.0, 0.0]
    c.state.checkpoints.pending[c.state.rounds.version] = (0, (0, 1))  # a stale record
    assert _slack.plan(c.state, 1)[0] is None  # naming a dead rank: nothing to shorten


# -- 79: staging, consumed exactly once --------------------------------------------------------


def test_79_stage_shortens_the_role_window_once_and_the_next_recompute_restores_it():
    c = _boundary()
    el = c.state.cadence.elche
    c.state.roles.epoch_fn_ewma_ms = 1000.0
    out: list = []
    assert _slack.stage(c.state, 1, out)
    # ceil(1000 ms / 50 ms per batch) = 20 batches off a count of 20: at least one is left
    assert el.batch_counts == [1, 10]
    assert el.pending_callback_slack_ms == [0.0, 0.0]  # consumed exactly once
    (note,) = [x for x in out if isinstance(x, Notice)]
    assert note.kind == "callback_slack"
    assert note.data["slack_ms"] == [1000.0, 0.0] and note.data["counts_before"] == [20, 10]
    el.recompute_batch_counts(el.slow_ms())  # the next head: no slack staged any more
    assert el.batch_counts == [20, 10]


def test_a_small_slack_moves_the_count_by_its_batches_past_the_dead_zone():
    c = _boundary()
    el = c.state.cadence.elche
    c.state.roles.epoch_fn_ewma_ms = 120.0  # ceil(120 / 50) = 3 batches off 20 (15 %)
    assert _slack.stage(c.state, 1, [])
    assert el.batch_counts == [17, 10]


def test_nothing_staged_leaves_counts_and_commands_alone():
    c = _boundary()
    out: list = []
    assert not _slack.stage(c.state, 1, out)
    assert out == [] and c.state.cadence.elche.batch_counts == [20, 10]


# -- end to end: the role rank's first window after a callback is shorter ---------------------


class EpochFnCluster(Cluster):
    """Scripted ranks whose epoch role runs an epoch function on ``EpochAggregated``
    (the rank-side contract ``_slack`` assumes) and reports ``EpochFnElapsed``."""

    epoch_fn_ms = 400.0

    def deliver_one(self, rank: int) -> bool:
        r = self.ranks[rank]
        head = r.inbox[0] if r.active and r.inbox else None
        handled = super().deliver_one(rank)
        if head is not None and head.WhichOneof("cmd") == "epoch_aggregated":
            roles = self.roles_told(rank)
            if roles and roles[-1] == rank:
                epoch = head.epoch_aggregated.metrics.epoch
                self.feed(EpochFnElapsed(now=self.now, rank=rank, epoch=epoch, elapsed_ms=self.epoch_fn_ms))
        return handled


def _first_plan(c: Cluster, rank: int, epoch: int) -> int:
    for ctl in c.ranks[rank].received:
        if ctl.WhichOneof("cmd") == "start_epoch" and ctl.start_epoch.plan.epoch == epoch:
            return ctl.start_epoch.plan.partition_size
    raise AssertionError(f"rank {rank} got no StartEpoch of epoch {epoch}")


def test_a_cadence_run_shortens_the_epoch_role_window_its_epoch_fn_lands_in():
    c = EpochFnCluster(world_size=2, total=240, batch_size=2, epochs=3, policy="cadence", speeds=[10.0, 20.0])
    c.join_all()
    res = c.run()
    assert res.ok
    notes = [x for x in c.commands if isinstance(x, Notice) and x.kind == "callback_slack"]
    # Epoch 0's aggregation: no epoch-fn time is known yet. Epoch 1 aggregates after the
    # role reported epoch 0's (400 ms) while both ranks already train epoch 2 (Cadence
    # streams the boundary, ``cadence._boundary``): the window they are running, in which
    # the role runs its epoch function, loses ceil(400 / 10 ms) = 40 batches (floored at 1).
    assert [n.data["epoch"] for n in notes] == [2]
    role = c.state.roles.epoch_role
    assert role == 0  # the fastest rank, elected at calibration
    note = notes[0].data
    assert note["slack_ms"][role] == 400.0
    assert note["counts"][role] == max(1, note["counts_before"][role] - 40)
    assert note["counts"][1] == note["counts_before"][1]  # the other rank is untouched
    at = c.commands.index(notes[0])
    aggregated = [x for x in c.commands[:at] if isinstance(x, Send) and x.kind == "epoch_aggregated"]
    assert aggregated[-1].control.epoch_aggregated.metrics.epoch == 1  # staged as epoch 1 aggregated
    started = [x for x in c.commands[:at] if isinstance(x, Send) and x.kind == "start_epoch"]
    assert any(x.control.start_epoch.plan.epoch == 2 for x in started)  # ... into a window of epoch 2
    after = [x for x in c.commands[at:] if isinstance(x, Notice) and x.kind == "window"]
    assert after and after[0].data["counts"][role] > note["counts"][role]  # the next recompute restores it
    for row in res.summary["coverage"]:
        assert (row["duplicates"], row["missing"]) == (0, 0)
    assert c.state.cadence.elche.pending_callback_slack_ms == [0.0, 0.0]
