"""flodl.rank.TimeAccount: one hand running at a time, so the causes add up to the wall time."""

import pytest

from flodl.rank import CAUSES, GOODPUT_CAUSES, TimeAccount


def test_time_account_charges_each_span_to_the_cause_that_was_running():
    a = TimeAccount(100.0)  # start-up until told otherwise
    a.enter("training", 102.0)
    a.during("averaging", 103.5)  # nested: an apply between two steps
    a.leave(104.0)  # back to training
    a.enter("barrier", 105.0)
    t = a.totals(106.0)
    assert t == {**dict.fromkeys(CAUSES, 0.0), "startup": 2.0, "training": 2.5, "averaging": 0.5, "barrier": 1.0}
    assert sum(t.values()) == pytest.approx(6.0)


def test_time_account_message_adds_up_to_its_wall_time():
    a = TimeAccount(0.0)
    for i, cause in enumerate(["training", "eval", "training", "checkpoint", "recovery", "calibration"]):
        a.enter(cause, 1.0 + i * 0.37)
    m = a.to_pb(7.25)
    assert m.wall_s == 7.25
    assert sum(getattr(m, f"{c}_s") for c in CAUSES) == pytest.approx(m.wall_s)


def test_time_account_nested_causes_unwind_in_order():
    a = TimeAccount(0.0, "barrier")
    a.during("averaging", 1.0)
    a.during("checkpoint", 2.0)  # a checkpoint armed by the consensus being applied
    a.leave(3.0)
    assert a.cause == "averaging"
    a.leave(4.0)
    assert a.cause == "barrier"
    assert a.totals(4.0) == {**dict.fromkeys(CAUSES, 0.0), "barrier": 1.0, "averaging": 2.0, "checkpoint": 1.0}


def test_time_account_a_clock_that_steps_back_charges_nothing():
    a = TimeAccount(10.0)
    a.enter("training", 9.0)
    assert a.totals(9.5) == dict.fromkeys(CAUSES, 0.0)


def test_time_account_refuses_an_unknown_cause():
    with pytest.raises(ValueError, match="unknown time cause 'idle'"):
        TimeAccount(0.0).enter("idle", 1.0)


def test_goodput_causes_are_training_and_calibration():
    assert GOODPUT_CAUSES == {"training", "calibration"} and GOODPUT_CAUSES <= set(CAUSES)
