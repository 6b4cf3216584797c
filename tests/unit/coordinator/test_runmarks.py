"""The summary's timeline_s: the run's marks, in order, with the gaps between them."""

from types import SimpleNamespace

from flodl_coordinator.runmarks import MARKS, RunMarks


def _state(committed: list[int], total: int = 100, epochs: int = 2):
    return SimpleNamespace(total_samples=total, config=SimpleNamespace(num_epochs=epochs),
                           coverage=SimpleNamespace(epochs={e: SimpleNamespace(unique=u) for e, u in enumerate(committed)}))  # fmt: skip


def test_runmarks_timeline_names_the_end_of_run_phases_in_order():
    m = RunMarks(born=1000.0)
    m.watch_commits(_state([]), 1001.0)  # nothing committed yet
    m.batch(1002.0)
    m.batch(1003.0)
    m.watch_commits(_state([100, 98]), 1008.0)  # 198 of 200: 99 %
    m.watch_commits(_state([100, 100]), 1009.0)  # reached once: not moved
    m.batch(1120.0)  # a tail: the last 1 % trained until here
    m.mark("epochs_done", 1121.0)
    m.mark("shutdown", 1121.5)
    m.mark("shutdown", 1130.0)
    m.mark("run_finished", 1122.0)
    t = m.timeline()
    assert list(t) == list(MARKS)
    assert t == {"first_batch": 2.0, "committed_99pct": 8.0, "last_batch": 120.0, "epochs_done": 121.0,
                 "shutdown": 121.5, "run_finished": 122.0}  # fmt: skip
    line = m.describe()
    assert "committed_99pct 8.00s" in line and "last_batch 120.00s (+112.00)" in line


def test_runmarks_leave_out_what_never_happened():
    m = RunMarks(born=0.0)
    m.mark("run_finished", 5.0)
    assert m.timeline() == {"run_finished": 5.0}
    assert RunMarks(born=0.0).describe() == "timeline: no batch"
