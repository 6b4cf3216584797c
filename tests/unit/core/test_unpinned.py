"""Unpinned hellos (issue 12): ranks numbered in admission order when the agent pins none."""

from flodl.core import ACTIVE, DEAD, JOINING, UNPINNED, VACANT, RankExiting, RankHello, Reply, Tick, replay

from .cluster import MODEL_SIG, Cluster


def _ack(cmds):
    (reply,) = [c for c in cmds if isinstance(c, Reply)]
    return reply.ack


def _unpinned(c, route, incarnation, agent="agent-a", local=0, **over):
    kw = dict(now=c.now, route=route, rank=UNPINNED, world_size=c.config.world_size, model_sig=MODEL_SIG,
              dataset_len=c.total, incarnation=incarnation, agent=agent, local_rank=local)  # fmt: skip
    kw.update(over)
    return c.feed(RankHello(**kw))


def _shell(c, slot, **over):
    """An unpinned hello from the cluster's rank ``slot`` (its route): the slot it should get."""
    r = c.ranks[slot]
    return _unpinned(c, r.route, r.incarnation, **over)


def test_unpinned_hellos_take_the_lowest_free_slot_in_admission_order_and_a_retransmit_keeps_it():
    c = Cluster(policy="sync", world_size=4)
    c.feed(Tick(now=0.0))
    c.hello(1)  # a pinned one holds slot 1
    assert _ack(_unpinned(c, (b"x",), 7, local=0)).rank == 0
    assert _ack(_unpinned(c, (b"y",), 8, local=1)).rank == 2  # 1 is taken: the next free one
    again = _ack(_unpinned(c, (b"x",), 7, local=0))
    assert again.accepted and again.rank == 0 and c.state.ignored["hello retransmit"] == 1
    assert [(r.route, r.phase) for r in c.state.ranks[:3]] == [((b"x",), JOINING), (c.ranks[1].route, JOINING),
                                                               ((b"y",), JOINING)]  # fmt: skip
    assert (c.state.ranks[2].agent, c.state.ranks[2].local_rank) == ("agent-a", 1)
    assert c.state.unpinned_slot_of("agent-a", 1) == 2 and c.state.unpinned_slot_of("agent-b", 1) is None


def test_an_unpinned_world_forms_trains_exactly_once_and_replays_to_the_same_slots():
    c = Cluster(policy="cadence", world_size=3, total=120, batch_size=8, epochs=2)
    c.feed(Tick(now=0.0))
    for slot in range(3):
        assert _ack(_shell(c, slot, local=slot)).rank == slot
    assert all(r.phase is ACTIVE for r in c.state.ranks)
    fin = c.run()
    assert fin.ok, fin.reason
    for cov in fin.summary["coverage"]:
        assert (cov["trained"], cov["duplicates"], cov["missing"]) == (cov["expected"], 0, 0), cov
    record: list = []
    assert replay(c.config, c.journal, record=record) == c.state and record == c.commands


def test_a_live_rank_is_never_taken_and_a_full_world_refuses_by_name():
    c = Cluster(policy="sync", world_size=2)
    c.join_all()
    ack = _ack(_unpinned(c, (b"late",), 3))
    assert not ack.accepted and ack.reason == "no free slot: all 2 ranks of the world are alive"
    assert [r.route for r in c.state.ranks] == [c.ranks[0].route, c.ranks[1].route]


def test_mid_run_an_unpinned_hello_refills_a_dead_slot_and_its_restart_keeps_its_own():
    c = Cluster(policy="cadence", world_size=3, total=300, batch_size=8, epochs=3, agent_reports_exit=True)
    c.feed(Tick(now=0.0))
    c.hello(0)
    _shell(c, 1, local=0)  # agent-a's process 0 takes slot 1
    c.hello(2)
    c.run_until(lambda: c.state.rounds.version >= 1)
    c.kill(0)
    c.kill(1)  # both dead: slot 0 is the lowest free one, but slot 1 is agent-a's process 0's
    assert c.state.ranks[0].phase is DEAD and c.state.ranks[1].phase is DEAD
    ack = _ack(c.respawn(1, unpinned=True, agent="agent-a", local_rank=0, restart_count=1))
    assert ack.accepted and ack.rank == 1 and ack.run.join_running
    c.run_until(lambda: c.state.ranks[1].phase is ACTIVE)
    ack = _ack(c.respawn(0, unpinned=True, agent="agent-b", local_rank=0))  # a newcomer: the lowest free
    assert ack.accepted and ack.rank == 0
    fin = c.run()
    assert fin.ok, fin.reason
    assert sorted((j["rank"], j["refill"]) for j in fin.summary["elastic"]["joins"]) == [(0, True), (1, True)]
    assert replay(c.config, c.journal) == c.state


def test_the_very_process_that_left_is_refused_again():
    c = Cluster(policy="sync", world_size=3, min_ranks=2, join_timeout_s=0.0, total=300, epochs=3)
    c.feed(Tick(now=0.0))
    c.hello(0)
    _shell(c, 1)
    c.advance(0.1)
    assert c.state.run.phase.__name__ == "TRAINING"
    c.feed(RankExiting(now=c.now, rank=1))
    ack = _ack(_shell(c, 1))  # the same route and incarnation: not a new process
    assert not ack.accepted and "this process already left the run" in ack.reason


def test_deferred_unpinned_hellos_vote_under_distinct_slots_and_evict_a_foreign_holder():
    c = Cluster(policy="sync", world_size=3)
    c.feed(Tick(now=0.0))
    assert _ack(_unpinned(c, (b"foreign",), 1, agent="evil", model_sig=b"evil")).rank == 0
    ack = _ack(_unpinned(c, (b"x",), 2, local=0))
    assert ack.deferred and set(c.state.run.cohort_votes) == {1}
    assert _ack(_unpinned(c, (b"x",), 2, local=0)).deferred and set(c.state.run.cohort_votes) == {1}  # resent
    cmds = _unpinned(c, (b"y",), 3, local=1)  # a second voter (slot 2) outnumbers the one holder
    assert _ack(cmds).accepted and _ack(cmds).rank == 2
    assert c.state.ranks[0].phase is VACANT and 0 in c.state.run.evicted
    assert _ack(_unpinned(c, (b"x",), 2, local=0)).rank == 1  # the slot it voted for
    assert c.state.ranks[1].phase is JOINING and c.state.ranks[0].phase is VACANT


def test_before_forming_a_restart_gets_its_slot_back_unless_another_took_it():
    c = Cluster(policy="sync", world_size=3, form_timeout_s=0.0)
    c.feed(Tick(now=0.0))
    _unpinned(c, (b"a0",), 1, local=0)
    _unpinned(c, (b"a1",), 2, local=1)
    c.feed(RankExiting(now=0.0, rank=1))  # (a JOINING slot reopens)
    assert c.state.ranks[1].phase is VACANT and c.state.unpinned_slot_of("agent-a", 1) == 1
    c.ranks[1].forgotten = False  # (the cluster's shell 1 stands for whoever holds slot 1)
    _unpinned(c, (b"b0",), 3, agent="agent-b")  # takes the lowest free: slot 1
    assert _ack(_unpinned(c, (b"a1'",), 4, local=1, restart_count=1)).rank == 2
    assert c.state.unpinned_slot_of("agent-a", 1) == 2 and c.state.ranks[1].agent == "agent-b"


def test_the_wire_hello_names_no_rank_when_unpinned_and_the_shell_keeps_the_agent_digest():
    from flodl.core import hello_event
    from flodl.wire import pb

    env = pb.Envelope(hello=pb.RankHello(rank=0, world_size=4, unpinned_slot=1, dataset_len=9))
    ev = hello_event(1.0, (b"r",), env, agent="d1")
    assert (ev.rank, ev.local_rank, ev.agent) == (UNPINNED, 1, "d1")
    pinned = hello_event(1.0, (b"r",), pb.Envelope(hello=pb.RankHello(rank=0, world_size=4)), agent="d1")
    assert (pinned.rank, pinned.local_rank, pinned.agent) == (0, -1, "")  # slot 0 named: not placed
