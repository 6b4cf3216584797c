"""flodl_coordinator.metrics: the book the loop feeds and the collector a scrape reads,
checked through prometheus_client's own exposition and parser."""

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from flodl import rank as rank_machine
from flodl.core import CoreConfig, initial_state, status_view
from flodl.wire import pb
from flodl_coordinator import metrics
from flodl_coordinator.metrics import RunBook, death_class, new_registry
from flodl_coordinator.reducer import BusReducer


def _scrape(book):
    text = generate_latest(new_registry(book)).decode()
    return {f.name: f for f in text_string_to_metric_families(text)}


def _values(fams, family, **labels):
    return {tuple(sorted((k, v) for k, v in s.labels.items() if k not in ("run", *labels))): s.value
            for s in fams[family].samples if all(s.labels.get(k) == v for k, v in labels.items())}  # fmt: skip


def _publish(book, st):
    return book.publish(st, status_view(st), reducer=BusReducer(), dropped={}, journal={}, events=0)


def test_causes_agree_with_the_rank_machine():
    assert metrics.CAUSES == rank_machine.CAUSES
    assert set(metrics.GOODPUT_CAUSES) == rank_machine.GOODPUT_CAUSES


def test_death_class_names_a_bounded_class_for_the_cores_reasons():
    assert death_class("killed by signal 9") == "killed_by_signal"
    assert death_class("exited with code 1") == "exited_with_error"
    assert death_class("exited without Shutdown (code 0)") == "exited_without_shutdown"
    assert death_class("heartbeat stale (>10s)") == "heartbeat_stale"
    assert death_class("unroutable (send of update failed)") == "unroutable"
    assert death_class("something new") == "other"


def test_ranks_beyond_the_label_bound_are_summed_as_other():
    st = initial_state(CoreConfig(world_size=3))
    book = RunBook("r1", rank_labels=1)
    acct = lambda train, wall: pb.TimeAccount(training_s=train, startup_s=wall - train, wall_s=wall)  # noqa: E731
    book.time_account(0, 11, acct(1.0, 3.0))
    book.time_account(1, 12, acct(2.0, 5.0))
    book.time_account(2, 13, acct(4.0, 6.0))
    book.time_account(2, 13, acct(5.0, 7.0))  # cumulative: the latest of an incarnation replaces it
    book.time_account(2, 99, acct(0.5, 1.0))  # a restarted rank 2: its first life still counts
    _publish(book, st)
    fams = _scrape(book)
    wall = {s.labels["rank"]: s.value for s in fams["flodl_rank_wall_seconds"].samples}
    assert wall == {"0": 3.0, "other": 13.0}
    good = {(s.labels["rank"], s.labels["cause"]): s.value for s in fams["flodl_rank_goodput_seconds"].samples}
    assert good[("0", "training")] == 1.0 and good[("other", "training")] == 7.5
    bad = {(s.labels["rank"], s.labels["cause"]): s.value for s in fams["flodl_rank_badput_seconds"].samples}
    for rank in ("0", "other"):  # the causes add up to the wall time
        total = sum(v for (r, _), v in good.items() if r == rank) + sum(v for (r, _), v in bad.items() if r == rank)
        assert total == wall[rank]
    assert {s.labels["rank"] for s in fams["flodl_rank_samples"].samples} == {"0", "other"}
    assert {s.labels["run"] for f in fams.values() for s in f.samples} == {"r1"}


def test_joins_restarts_and_deaths_by_reason():
    st = initial_state(CoreConfig(world_size=3))
    book = RunBook("r", rank_labels=8)
    _publish(book, st)
    for r, inc in enumerate((5, 6, 7)):
        st.ranks[r].incarnation = inc
    _publish(book, st)  # the hellos that formed the world
    st.run.formed_at = 1.0
    _publish(book, st)
    book.noticed("rank_lost", {"rank": 1, "reason": "killed by signal 9", "discarded_samples": 0})
    book.noticed("rank_left", {"rank": 0, "reason": "exited cleanly", "discarded_samples": 0})
    st.ranks[1].incarnation = 8  # rank 1 comes back
    _publish(book, st)
    fams = _scrape(book)
    assert _values(fams, "flodl_rank_joins", reason="formation") == {(): 3.0}
    assert _values(fams, "flodl_rank_joins", reason="late") == {(): 0.0}
    assert _values(fams, "flodl_rank_restarts", reason="killed_by_signal") == {(): 1.0}
    assert _values(fams, "flodl_rank_deaths", reason="killed_by_signal") == {(): 1.0}
    assert sum(s.value for s in fams["flodl_rank_deaths"].samples) == 1.0
    assert fams["flodl_rank_leaves"].samples[0].value == 1.0


def test_a_finished_round_is_timed_into_the_histogram():
    st = initial_state(CoreConfig(world_size=2))
    book = RunBook("r", rank_labels=8)
    book.stepped(st)
    st.rounds.opened_at, st.now, st.rounds.version = 10.0, 10.03, 1  # a 30 ms round finished
    book.stepped(st)
    st.rounds.opened_at, st.now, st.rounds.version = 20.0, 22.0, 2  # a 2 s one
    book.stepped(st)
    _publish(book, st)
    fams = _scrape(book)
    h = {(s.name, s.labels.get("le")): s.value for s in fams["flodl_averaging_round_seconds"].samples}
    assert h[("flodl_averaging_round_seconds_bucket", "0.025")] == 0
    assert h[("flodl_averaging_round_seconds_bucket", "0.05")] == 1
    assert h[("flodl_averaging_round_seconds_bucket", "2.5")] == 2
    assert h[("flodl_averaging_round_seconds_count", None)] == 2
    assert abs(h[("flodl_averaging_round_seconds_sum", None)] - 2.03) < 1e-9
    assert fams["flodl_averaging_rounds"].samples[0].value == 2


def test_relay_counters_are_summed_over_relays_latest_per_relay_process():
    book = RunBook("r", rank_labels=8)
    book.relay_stats("relay-a", 1, pb.RelayStats(folds_sent=3, ranks_folded=6, fanouts=2, fanout_copies=4))
    book.relay_stats("relay-a", 1, pb.RelayStats(folds_sent=4, ranks_folded=8, fanouts=3, fanout_copies=6))
    book.relay_stats("relay-b", 9, pb.RelayStats(folds_sent=1, ranks_folded=2))
    _publish(book, initial_state(CoreConfig(world_size=2)))
    fams = _scrape(book)
    assert fams["flodl_relay_folds_sent"].samples[0].value == 5
    assert fams["flodl_relay_ranks_folded"].samples[0].value == 10
    assert fams["flodl_relay_fanout_copies"].samples[0].value == 6
    assert fams["flodl_relays_reporting"].samples[0].value == 2


def test_a_recovered_coordinator_does_not_count_the_members_it_rebuilt_as_joins():
    st = initial_state(CoreConfig(world_size=2))
    for r in range(2):
        st.ranks[r].incarnation = 10 + r
    st.run.formed_at = 1.0
    book = RunBook("r", rank_labels=8, coordinator_restarts=1)
    book.members_known(st)
    _publish(book, st)
    st.ranks[1].incarnation = 20  # rank 1 restarted after the coordinator did
    _publish(book, st)
    fams = _scrape(book)
    assert sum(s.value for s in fams["flodl_rank_joins"].samples) == 0
    assert _values(fams, "flodl_rank_restarts", reason="other") == {(): 1.0}  # (its death predates this process)
    assert fams["flodl_coordinator_restarts"].samples[0].value == 1
