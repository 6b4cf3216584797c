"""flodl.core._max_failure and its escalation (reference §9.4, scenario 68)."""

from __future__ import annotations

from fractions import Fraction

import pytest

from flodl.core import CoreConfig, RunFinished, Send
from flodl.core._max_failure import max_failure_limit, percent_limit
from flodl.wire import pb

from .cluster import Cluster


def test_scenario_68_percent_thresholds():
    p = Fraction("0.2")
    assert [percent_limit(p, ws) for ws in (10, 11, 5, 3)] == [2, 3, 1, 1]
    assert percent_limit(0, 10) == 0
    assert percent_limit(1, 10) == 10
    assert percent_limit(2.5, 10) == 10
    assert percent_limit(-0.3, 10) == 0
    assert percent_limit(p, 0) == 0


def test_scenario_68_absolute_is_the_same_for_any_world():
    assert {max_failure_limit("3", ws) for ws in (1, 4, 100)} == {3}


def test_the_string_forms():
    assert max_failure_limit("", 8) is None
    assert max_failure_limit("  ", 8) is None
    assert max_failure_limit("20%", 10) == 2
    assert max_failure_limit("20%", 11) == 3
    assert max_failure_limit("250%", 10) == 10
    assert max_failure_limit("-30%", 10) == 0
    assert max_failure_limit("12.5%", 8) == 1  # exact: no float rounding up to 2
    for bad in ("x", "2.5", "%", "-1", "1e3%x"):
        with pytest.raises(ValueError, match="max_failure"):
            max_failure_limit(bad, 4)


def test_config_validates_it():
    assert CoreConfig(world_size=4, max_failure="50%").max_failure == "50%"
    with pytest.raises(ValueError, match="max_failure"):
        CoreConfig(world_size=4, max_failure="half")


def _with_limit(spec: str, world_size: int = 4) -> Cluster:
    c = Cluster(world_size=world_size, total=96, batch_size=4, epochs=3, policy="sync", max_failure=spec)
    c.join_all()
    c.run_until(lambda: c.state.rounds.version >= 2)
    return c


def test_reaching_the_limit_ends_the_run_with_max_failure_exceeded():
    c = _with_limit("2")
    c.kill(3)
    assert c.finished is None  # one death: below the limit, the run goes on
    cmds = c.kill(2)
    saves = [x for x in cmds if isinstance(x, Send) and x.kind == "shutdown_with_save"]
    assert sorted(x.rank for x in saves) == [0, 1]  # the survivors
    assert {x.control.shutdown_with_save.reason for x in saves} == {pb.SAVE_REASON_MAX_FAILURE_EXCEEDED}
    fin = [x for x in cmds if isinstance(x, RunFinished)]
    assert len(fin) == 1 and not fin[0].ok and "max_failure" in fin[0].reason


def test_a_percent_limit_scales_with_the_world():
    c = _with_limit("50%")  # ceil(0.5 * 4) = 2
    c.kill(1)
    assert c.finished is None
    c.kill(3)
    assert c.finished is not None and "max_failure" in c.finished.reason


def test_clean_exits_do_not_count():
    c = Cluster(world_size=2, total=64, batch_size=8, epochs=2, policy="sync", max_failure="1")
    c.join_all()
    fin = c.run()  # every rank LEFT at the end: no failure
    assert fin.ok and fin.reason == "completed"


def test_without_a_limit_a_death_is_survived():
    c = _with_limit("")
    c.kill(3)
    c.kill(2)
    assert c.run().ok
