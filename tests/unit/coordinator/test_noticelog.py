"""The operator log's line per decision: a line at any world size, built only if written."""

from __future__ import annotations

import json
import logging

from flodl.core import Notice
from flodl.statustable import FULL_RATES
from flodl_coordinator.noticelog import human_line, log_notice


def _epoch(rates):
    return Notice("epoch", {"epoch": 1, "avg_loss": 0.5, "wall_s": 2.0, "samples_per_s": rates,
                            "coverage": {"trained": 96, "expected": 96, "duplicates": 0, "missing": 0}})  # fmt: skip


def test_an_epoch_line_lists_each_rate_of_a_small_world():
    line = human_line(_epoch([1200.0, 600.0, 300.0]), 3)
    assert line == "epoch 2/3  loss 0.5000  wall 2.0s  r0 1,200/s r1 600/s r2 300/s  coverage 96/96 dup 0 missing 0"


def test_an_epoch_line_of_a_large_world_says_min_median_max_and_who():
    rates = [100.0 + r for r in range(FULL_RATES + 24)]
    rates[7] = 0.0  # (a rank that trained nothing of it)
    line = human_line(_epoch(rates), 3)
    assert f"  {len(rates)} ranks: min r7 0/s median 120/s max r39 139/s  coverage" in line
    assert "r8 " not in line


def test_a_long_value_is_cut_in_the_line_and_whole_in_the_record(caplog):
    counts = list(range(4096))
    note = Notice("callback_slack", {"counts": counts, "epoch": 3})
    assert human_line(note, 5) == "callback_slack: counts=[0, 1, 2, 3, 4, 5, 6, 7, ... (4096 values)] epoch=3"
    with caplog.at_level(logging.DEBUG, logger="flodl"):
        log_notice(note, 5, logging.getLogger("flodl.coordinator"), logging.getLogger("flodl.decisions"))
    record = [r for r in caplog.records if r.name == "flodl.decisions"]
    assert len(record) == 1 and json.loads(record[0].getMessage())["counts"] == counts


class _Counted:
    """A notice value that counts how often it is formatted (a line or a record built)."""

    def __init__(self) -> None:
        self.times = 0

    def __str__(self) -> str:
        self.times += 1
        return "x"

    __format__ = lambda self, spec: str(self)  # noqa: E731


def test_nothing_is_built_for_a_logger_that_would_not_write_it(caplog):
    log, decisions = logging.getLogger("flodl.coordinator"), logging.getLogger("flodl.decisions")
    value = _Counted()
    window = Notice("window", {"v": value})  # a round's line is DEBUG
    with caplog.at_level(logging.INFO, logger="flodl"):
        log_notice(window, 3, log, decisions)
    assert value.times == 0 and not caplog.records
    with caplog.at_level(logging.DEBUG, logger="flodl"):
        log_notice(window, 3, log, decisions)
    assert value.times == 2  # the line and the JSON record
    assert [r.name for r in caplog.records] == ["flodl.decisions", "flodl.coordinator"]
