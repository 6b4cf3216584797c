"""Reference §12 G (membership, failure, rendezvous), scenarios 58-71, against the real core.

Already covered elsewhere (not repeated here):

* 58 staleness unblocks the cycle -- ``test_averaging.py::test_dead_rank_unblocks_the_gate``
  (the full command sequence is pinned below as well);
* 59 ExtendPartition -- ``test_dispatch.py::test_extend_partition_split_equally_among_survivors``;
* 68 percent thresholds -- ``test_max_failure.py::test_scenario_68_*``;
* 69 clean exit -- ``test_membership.py::test_clean_exit_then_staleness_declares_nothing``,
  ``test_exited_rank_skipped_by_broadcasts``; ``test_max_failure.py::test_clean_exits_do_not_count``;
* 70 reported death -- ``test_membership.py::test_reported_death_immediate_duplicates_ignored_out_of_range_refused``.

Deliberate differences from upstream (ARCHITECTURE.md wins):

* A DEAD rank is never addressed again, so a failure's ``ShutdownWithSave`` goes to the
  survivors only (upstream broadcast it to every rank, dead ones included).
* 63-67 (NCCL re-rendezvous) belong to the *collective* plane: they are driven in
  ``test_collective.py`` (the UID generator is our TCPStore host; a lone survivor
  trains on in a group of one instead of ``ShutdownWithSave(SingleSurvivor)``).
* 60's "no ledger" is the world not formed yet: liveness then vacates a slot, never kills.
"""

from __future__ import annotations

from flodl.core import (
    CoreConfig,
    ForgetRank,
    HeartbeatSeen,
    Notice,
    OpenRound,
    RunFinished,
    Send,
    SyncAcked,
    Tick,
    initial_state,
    step,
)
from flodl.core import ACTIVE, DEAD, FORMING, JOINING, VACANT
from flodl.wire import pb

from .cluster import Cluster, controls, window_plan


def _notices(cmds, kind):
    return [x for x in cmds if isinstance(x, Notice) and x.kind == kind]


def _drain(c: Cluster, *ranks: int) -> None:
    for r in ranks:
        while c.deliver_one(r):
            pass


# -- 58 ------------------------------------------------------------------------------------


def test_58_staleness_unblocks_the_cycle_full_sequence():
    # Sync ws 3, timeout 1 s; ranks 0 and 1 step, rank 2 is silent.
    c = Cluster(policy="sync", world_size=3, total=30, batch_size=2, liveness_timeout_s=1.0, defer_acks=True)
    c.join_all()
    for r in (0, 1):
        _drain(c, r)
        c.train_one(r)
    for r in (0, 1):
        c.feed(HeartbeatSeen(now=1.0, rank=r))
    assert not [x for x in c.feed(Tick(now=1.0)) if isinstance(x, ForgetRank)]  # 1 s is not > 1 s
    for r in (0, 1):
        c.feed(HeartbeatSeen(now=1.5, rank=r))
    cmds = c.feed(Tick(now=1.5))
    assert ForgetRank(2, "heartbeat stale (>1s)") in cmds
    assert OpenRound(1, (0, 1)) in cmds
    kinds = [(x.rank, x.kind) for x in cmds if isinstance(x, Send) and x.kind in ("request_params", "throttle")]
    assert kinds == [(0, "request_params"), (1, "request_params"), (0, "throttle"), (1, "throttle")]
    c.feed(SyncAcked(now=1.5, rank=0, cycle=1, step_count=1))
    assert c.state.rounds.version == 0
    cmds = c.feed(SyncAcked(now=1.5, rank=1, cycle=1, step_count=1))
    assert c.state.rounds.version == 1
    assert [r for r, _ in controls(cmds, "update")] == [0, 1]


# -- 60 ------------------------------------------------------------------------------------


def test_60_before_the_world_forms_time_kills_nobody():
    # (form_timeout_s=0: no formation deadline, the reference's behaviour; with one, the
    # run fails after it instead -- test_membership's formation tests.)
    cfg = CoreConfig(world_size=2, batch_size=4, policy="sync", liveness_timeout_s=1.0, form_timeout_s=0.0)
    st = initial_state(cfg)
    for now in (0.0, 5.0, 1e6):
        st, cmds = step(st, Tick(now=now))
        assert cmds == []
    assert [rec.phase for rec in st.ranks] == [VACANT, VACANT] and st.run.phase is FORMING


def test_60_a_silent_joining_rank_reopens_its_slot_it_is_not_a_death():
    c = Cluster(policy="sync", world_size=2, liveness_timeout_s=1.0)
    c.hello(0)
    assert c.state.ranks[0].phase is JOINING
    cmds = c.feed(Tick(now=2.0))
    assert c.state.ranks[0].phase is VACANT
    assert not _notices(cmds, "rank_lost") and c.finished is None


# -- 61 ------------------------------------------------------------------------------------


def test_61_max_failure_is_checked_before_all_lost_when_everyone_goes_silent():
    # Sync ws 3, Absolute(1), timeout 1 s, all silent: one sweep kills all three. The
    # max_failure verdict comes first; nobody is left to address (no ShutdownWithSave sent).
    c = Cluster(policy="sync", world_size=3, total=30, batch_size=1, liveness_timeout_s=1.0, max_failure="1")
    c.join_all()
    cmds = c.feed(Tick(now=1.5))
    assert [x.rank for x in cmds if isinstance(x, ForgetRank)] == [0, 1, 2]
    assert not [x for x in cmds if isinstance(x, Send) and x.kind == "shutdown_with_save"]
    (note,) = _notices(cmds, "shutdown_with_save")
    assert note.data["reason"] == "SAVE_REASON_MAX_FAILURE_EXCEEDED" and note.data["ranks"] == []
    (fin,) = [x for x in cmds if isinstance(x, RunFinished)]
    assert not fin.ok and fin.reason.startswith("max_failure exceeded: 3 dead rank(s), limit 1")


def test_61_one_silent_rank_ends_the_run_and_the_meta_carries_elche():
    # Cadence ws 3, anchor 3, checkpoint_on_failure: the save names the reason and carries
    # the ElChe state (anchor 3, one smoothed entry per rank), then ShutdownWithSave{1}.
    c = Cluster(policy="cadence", world_size=3, total=300, batch_size=1, epochs=2, anchor=3,
                liveness_timeout_s=1.0, max_failure="1", checkpoint_on_failure=True)  # fmt: skip
    c.join_all()
    c.run_until(lambda: c.state.cadence.elche.calibrated)
    c.silence(2)
    t = c.now + 1.5
    for r in (0, 1):
        c.feed(HeartbeatSeen(now=t, rank=r))
    cmds = c.feed(Tick(now=t))
    kinds = [x.kind for x in cmds if isinstance(x, Send) and x.kind in ("checkpoint", "shutdown_with_save")]
    assert kinds == ["checkpoint", "shutdown_with_save", "shutdown_with_save"]
    saves = controls(cmds, "shutdown_with_save")
    assert [r for r, _ in saves] == [0, 1]
    assert {x.shutdown_with_save.reason for _, x in saves} == {pb.SAVE_REASON_MAX_FAILURE_EXCEEDED}
    assert pb.SAVE_REASON_MAX_FAILURE_EXCEEDED == 1
    meta = _notices(cmds, "checkpoint_meta")[0].data["meta"]
    assert meta["reason"] == "max_failure_exceeded"
    elche = meta["policy_state"]["elche"]
    assert elche["anchor"] == 3 and len(elche["smoothed_ms_per_batch"]) == 3


# -- 62 ------------------------------------------------------------------------------------


def test_62_one_sweep_loses_every_rank():
    c = Cluster(policy="sync", world_size=3, total=30, batch_size=1, liveness_timeout_s=1.0)
    c.join_all()
    cmds = c.feed(Tick(now=1.5))
    lost = _notices(cmds, "rank_lost")
    assert [(n.data["rank"], n.data["reason"]) for n in lost] == [(r, "heartbeat stale (>1s)") for r in range(3)]
    (note,) = _notices(cmds, "shutdown_with_save")
    assert note.data["reason"] == "SAVE_REASON_ALL_RANKS_LOST" and note.data["ranks"] == []
    (fin,) = [x for x in cmds if isinstance(x, RunFinished)]
    assert not fin.ok and fin.reason == "all ranks lost"
    assert [rec.phase for rec in c.state.ranks] == [DEAD] * 3


# -- 63-67: the collective plane ---------------------------------------------------------


def test_63_to_67_the_collective_plane_is_accepted():
    # The scenarios themselves: test_collective.py.
    st = initial_state(CoreConfig(world_size=3, plane="collective"))
    assert st.collective is not None and st.collective.generation == 0


# -- 71 ------------------------------------------------------------------------------------


def test_71_progressive_death_reclaims_the_chunk_in_flight_and_the_survivor_takes_it_first():
    # Cadence ws 2: rank 1 holds its first chunk untouched; rank 0 ran its window and waits
    # at the reduce barrier. Rank 1's death reopens its chunk, the round fires for rank 0
    # alone and rank 0's next window starts with exactly the reclaimed range.
    c = Cluster(policy="cadence", world_size=2, total=100, batch_size=2, epochs=1, anchor=2,
                run_ahead=False)  # the reference's barrier: rank 0 waits there, it does not run ahead
    c.join_all()
    st = c.state
    pool = st.cadence.pools[0]
    _, off1, n1 = st.cadence.in_flight[1]
    _drain(c, 0)
    while c.train_one(0):
        pass
    assert 0 not in st.cadence.in_flight and st.ranks[1].phase is ACTIVE
    cmds = c.kill(1)
    assert pool.in_flight(1) == 0
    assert OpenRound(1, (0,)) in cmds
    (start,) = [window_plan(x)[1] for _, x in controls(cmds) if window_plan(x)]
    assert start[1:] == (off1, n1)
    assert st.cadence.in_flight[0] == (0, off1, n1)
    res = c.run()
    assert res.ok
    row = res.summary["coverage"][0]
    assert (row["trained"], row["duplicates"], row["missing"]) == (100, 0, 0)
