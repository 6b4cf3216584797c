"""Dropped-frame warnings: the first of each reason, then one summary per minute."""

import logging

from flodl_coordinator.droplog import DropLog

log = logging.getLogger("flodl.test.droplog")


def test_one_line_per_reason_then_a_summary_per_interval(caplog):
    caplog.set_level(logging.WARNING, logger=log.name)
    d = DropLog(log, interval_s=60.0)
    for i in range(1000):  # a new route per frame: still one line
        d.drop("malformed", f"route-{i}: malformed: no delimiter", now=1.0 + i * 0.01)
    d.drop("wrong_session", "route-x: wrong_session", now=5.0)
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["dropped frame from route-0: malformed: no delimiter", "dropped frame from route-x: wrong_session"]
    d.flush(now=30.0)  # the window is not over: nothing yet
    assert len(caplog.records) == 2
    d.flush(now=61.0)
    assert caplog.records[-1].getMessage() == (
        "999 more frames dropped for malformed in the last 60s (last from route-999: malformed: no delimiter)"
    )
    d.drop("malformed", "route-a: malformed", now=62.0)
    d.close(now=63.0)  # what is left is said on the way out
    assert caplog.records[-1].getMessage() == "1 more frames dropped for malformed in the last 2s (last from route-a: malformed)"
    assert len(caplog.records) == 4
