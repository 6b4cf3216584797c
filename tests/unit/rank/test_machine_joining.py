"""flodl.rank.RankMachine joining a running world: nothing trains before the seed."""

from __future__ import annotations

from flodl.rank import WAIT_PLAN, Admitted, Drop, IncarnationSeen, RankMachine, SeedApplied, SendTiming, TrainBatch
from flodl.wire import pb

from .test_machine import machine, plan, train


def joiner() -> RankMachine:
    m = RankMachine(2)
    m.handle(IncarnationSeen(incarnation=1, hello_ack=True))
    m.handle(Admitted(spec=pb.RunSpec(total_samples=100, batch_size=8, gamma=1.0, policy=pb.POLICY_CADENCE,
                                      join_running=True)))  # fmt: skip
    return m


def test_a_joiner_trains_nothing_before_it_holds_the_seed_then_confirms_it():
    m = joiner()
    assert m.awaiting_seed and m.accepts_seed()
    m.handle(plan(0, 0, 16))  # (the coordinator sends none before the seed; even so)
    assert m.next_action(0.0) is WAIT_PLAN
    (sent,) = m.handle(SeedApplied(cycle=7))
    assert isinstance(sent, SendTiming) and sent.kind == "seeded" and sent.body.cycle == 7
    assert isinstance(m.next_action(0.0), TrainBatch)


def test_a_repeated_seed_before_training_is_confirmed_again_but_one_after_training_is_dropped():
    m = joiner()
    m.handle(SeedApplied(cycle=3))
    (again,) = m.handle(SeedApplied(cycle=4))  # the coordinator restarted and asked again
    assert isinstance(again, SendTiming) and again.body.cycle == 4
    m.handle(plan(0, 0, 16))
    train(m)
    assert not m.accepts_seed()
    (drop,) = m.handle(SeedApplied(cycle=5))
    assert isinstance(drop, Drop) and drop.reason == "unexpected_seed"


def test_a_rank_of_the_formed_world_refuses_a_seed():
    m = machine()
    assert not m.awaiting_seed and not m.accepts_seed()
    (drop,) = m.handle(SeedApplied(cycle=1))
    assert isinstance(drop, Drop) and drop.reason == "unexpected_seed"
