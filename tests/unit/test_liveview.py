"""The launcher's live view and `flodl status`'s table, over a real StatusBoard on HTTP."""

import contextlib
import io
import socket
import threading
import json

import pytest

from flodl import statustable
from flodl.cli import LaunchError, fetch_status, shown
from flodl.core import CoreConfig, Notice, initial_state
from flodl.liveview import LiveView
from flodl_coordinator.reducer import BusReducer
from flodl_coordinator.status import StatusBoard


def _epoch(e):
    return Notice("epoch", {"epoch": e, "avg_loss": 1.0 / (e + 1), "wall_s": 0.5, "samples_per_s": [100.0, 50.0],
                            "coverage": {"expected": 64, "trained": 64, "duplicates": 0, "missing": 0}})  # fmt: skip


@pytest.fixture
def board():
    b = StatusBoard()
    b.update(initial_state(CoreConfig(world_size=2, num_epochs=3)), {}, BusReducer())
    http = b.serve("127.0.0.1:0")
    yield b
    http.shutdown()


def test_live_view_prints_each_epoch_once_in_order_and_the_rest_from_the_summary(board):
    out = io.StringIO()
    host, port = board.http_address
    view = LiveView(f"{host}:{port}", out=out, tty=False)
    board.notice(_epoch(0))
    board.notice(_epoch(1))  # two epochs between polls: neither is missed
    board.update(initial_state(CoreConfig(world_size=2, num_epochs=3)), {}, BusReducer())
    view._show(view._fetch())
    view._show(view._fetch())  # polled again: nothing printed twice
    view.emit("[agent] a child's warning")
    view.finish({"epochs": [{"epoch": 0}, {"epoch": 1}, {"epoch": 2, "avg_loss": 0.1, "epoch_ms": 400.0,
                                                         "per_rank_throughput": [90.0, 45.0]}]})  # fmt: skip
    lines = out.getvalue().splitlines()
    assert [ln.split()[1] for ln in lines if ln.startswith("epoch ")] == ["1/3", "2/3", "3/3"]
    assert lines[0].startswith("epoch 1/3  loss 1.0000  wall 0.5s  [") and "r0 100/s r1 50/s" in lines[0]
    assert "coverage 64/64 dup 0 missing 0" in lines[0]
    assert lines[-1] == "epoch 3/3  loss 0.1000  wall 0.4s  r0 90/s r1 45/s"
    assert "[agent] a child's warning" in lines


def test_live_view_on_a_terminal_redraws_one_progress_line(board):
    out = io.StringIO()
    host, port = board.http_address
    view = LiveView(f"{host}:{port}", out=out, tty=True)
    view._show(view._fetch())
    view.emit("a line")
    text = out.getvalue()
    assert text.startswith("FORMING   [") and "\r\x1b[Ka line\nFORMING   [" in text


def test_live_view_skips_a_status_it_cannot_read():
    view = LiveView("127.0.0.1:9", out=io.StringIO(), tty=False)  # nothing listens on port 9
    assert view._fetch() is None


def test_log_lines_below_the_level_are_hidden_and_lines_without_a_level_are_shown():
    assert shown("2026-12-01 flodl.coordinator WARNING relay gone", "WARNING")
    assert not shown("[rank 2] INFO flodl.rank[2]: admitted", "WARNING")
    assert shown("[rank 2] INFO flodl.rank[2]: admitted", "INFO")
    assert shown("Traceback (most recent call last):", "ERROR")
    assert not shown("x DEBUG y", "INFO")


def test_status_table_renders_a_live_document_and_refuses_another_version(board):
    doc = json.loads(json.dumps(board.snapshot()))
    text = statustable.render(doc)
    lines = text.splitlines()
    assert lines[0] == "run flodl  FORMING  cadence/bus  world 2"
    assert lines[1].startswith("progress  [------------------------] -  epoch -/3 (0 done)")
    assert lines[-1] == "alerts: none"
    assert [ln.split()[:2] for ln in lines if ln.split()[:1] in (["0"], ["1"])] == [["0", "VACANT"], ["1", "VACANT"]]
    doc["schema_version"] = 2
    with pytest.raises(statustable.StatusSchemaError, match="schema_version 2; this flodl reads version 1"):
        statustable.render(doc)


def test_durations_read_like_a_person_would_say_them():
    assert [statustable.fmt_duration(s) for s in (None, 0.25, 42, 75, 3725)] == ["-", "0.2s", "42s", "1m15s", "1h02m"]


@contextlib.contextmanager
def _one_reply(reply: bytes):
    """A port that answers one HTTP request with ``reply`` as it is, then closes."""
    srv = socket.create_server(("127.0.0.1", 0))

    def answer():
        conn, _ = srv.accept()
        with conn:
            conn.recv(65536)
            conn.sendall(reply)

    t = threading.Thread(target=answer, daemon=True)
    t.start()
    try:
        yield f"127.0.0.1:{srv.getsockname()[1]}"
    finally:
        t.join(timeout=5)
        srv.close()


BROKEN = [
    b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n{\"schema_version\": 1",  # cut off: the coordinator exited mid-reply
    b"garbage\r\n\r\n",  # not HTTP at all
]


@pytest.mark.parametrize("reply", BROKEN)
def test_live_view_skips_a_reply_cut_off_or_garbled(reply):
    """The coordinator can exit while the view reads its /status (the run's end): a
    broken reply is skipped like an absent one, not a traceback from the view's thread."""
    with _one_reply(reply) as hostport:
        assert LiveView(hostport, out=io.StringIO(), tty=False)._fetch() is None


@pytest.mark.parametrize("reply", BROKEN)
def test_flodl_status_names_a_broken_reply(reply):
    with _one_reply(reply) as hostport, pytest.raises(LaunchError, match="cannot read .* a broken reply"):
        fetch_status(hostport, timeout=5)
