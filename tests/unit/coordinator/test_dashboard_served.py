"""The dashboard over real HTTP (``/``, ``/timeline``), the run's final status and page
written beside the summary and still served after the run, and systemd readiness."""

from __future__ import annotations

import json
import re
import socket
import time
import urllib.error
import urllib.request

import zmq

from flodl.sdnotify import notify
from flodl.wire import Endpoint, decode, pb, split_routing
from flodl_coordinator import dashboard
from flodl_coordinator.settings import load_settings

SESSION = "dash-test"
DATA_RE = re.compile(r'<script type="application/json" id="flodl-data">(.*?)</script>', re.S)


def get(url):
    with urllib.request.urlopen(url, timeout=5) as resp:
        return resp.headers.get("Content-Type"), resp.read().decode()


def until(pred, what, timeout_s=15.0):
    deadline = time.monotonic() + timeout_s
    while not (got := pred()):
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.05)
    return got


def closed(base) -> bool:
    try:
        get(base + "/status")
    except OSError:
        return True
    return False


def hello(ctx, ep, rank, host):
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(ep)
    me = Endpoint(SESSION, pb.Sender.KIND_RANK, rank=rank, incarnation=rank + 1)
    s.send_multipart(me.frames("hello", pb.RankHello(rank=rank, world_size=2, model_sig=b"a" * 32, dataset_len=64,
                                                      host=host, pid=1)))  # fmt: skip
    assert s.poll(5000)
    assert decode(split_routing(s.recv_multipart())[1], session=SESSION).envelope.hello_ack.accepted
    return s


def test_dashboard_served_live_then_final_files_and_a_lingering_status(serve, tmp_path):
    summary = tmp_path / "run.json"
    # The world never forms (one rank of two): the run fails on its own, no stop signal,
    # so the final status is written and stays served for the linger.
    svc, ep, ctx = serve(load_settings(env={}, flags={
        "world_size": 2, "bind": "tcp://127.0.0.1:0", "session": SESSION, "http": "127.0.0.1:0",
        "form_timeout_s": 1.0, "summary": str(summary), "status_linger_s": 60.0,
    }))  # fmt: skip
    host, port = svc.status.http_address
    base = f"http://{host}:{port}"
    ctype, page = get(base + "/")
    assert ctype.startswith("text/html") and DATA_RE.search(page).group(1) == "null"  # live: it polls
    r0 = hello(ctx, ep, 0, "host-a")
    tl = until(lambda: (d := json.loads(get(base + "/timeline")[1]))["lanes"][0]["marks"] and d, "rank 0's join mark")
    assert [lane["rank"] for lane in tl["lanes"]] == [0, 1]
    assert json.loads(get(base + "/timeline?max_spans=0")[1])["truncated"]["spans_not_sent"] == 0
    try:
        get(base + "/timeline?max_spans=lots")
    except urllib.error.HTTPError as e:
        assert e.code == 400
    else:
        raise AssertionError("a bad max_spans was accepted")
    assert tl["lanes"][0]["marks"][0]["kind"] == "join" and tl["lanes"][0]["host"] == "host-a"

    until(summary.exists, "the run's end (its summary)")
    status_file, page_file = tmp_path / "run.status.json", tmp_path / "run.dashboard.html"
    assert status_file.exists() and page_file.exists()
    loop = json.loads(summary.read_text())["coordinator_loop"]  # the coordinator's own load, for the record
    assert loop["frames"] >= 1 and 0.0 < loop["frame_p50_le_ms"] <= loop["frame_p99_le_ms"] <= 1000.0
    assert 0.0 < loop["busy_share"] < 1.0
    assert loop["frame_max_event"] == "RankHello"  # its only frame that stepped the core
    final = json.loads(status_file.read_text())
    assert final["core"]["run"]["phase"] == "FINISHED" and final["core"]["run"]["ok"] is False
    # The process lingers: the same final status is still served after the run.
    assert json.loads(get(base + "/status")[1]) == final
    embedded = json.loads(DATA_RE.search(page_file.read_text()).group(1))
    assert embedded["status"] == final
    assert embedded["timeline"]["lanes"][0]["marks"][0]["kind"] == "join"
    assert any(e["kind"] == "formation_failed" and e["level"] == "warning" for e in embedded["timeline"]["events"])
    svc.request_stop()  # ends the linger (60 s otherwise); then the listener closes
    until(lambda: closed(base), "the listener closing: the stop did not end the linger", timeout_s=20)
    r0.close()


def test_page_embeds_data_that_cannot_close_its_script_element():
    data = {"status": {"phase": "x</script><script>alert(1)</script>"}, "timeline": {"lanes": [], "note": "a & b <!--"}}
    html = dashboard.page(data)
    assert json.loads(DATA_RE.search(html).group(1)) == data
    assert html.count("</script>") == dashboard.page().count("</script>")


def test_page_loads_nothing_from_outside():
    html = dashboard.page()
    urls = set(re.findall(r"https?://[^\s\"'`)]+", html))
    assert urls == {"http://www.w3.org/2000/svg"}  # the SVG namespace name, never fetched
    assert not re.search(r"<(script|link|img|iframe)[^>]*\s(src|href)=\"(?!data:)", html)  # inline data: only
    assert "@import" not in html and "url(" not in html


def test_final_paths_beside_the_summary_unless_set():
    s = load_settings(env={}, flags={"world_size": 1, "summary": "/x/run.json"})
    assert dashboard.final_paths(s) == ("/x/run.status.json", "/x/run.dashboard.html")
    s = load_settings(env={}, flags={"world_size": 1, "summary": "/x/run.json", "dashboard_out": "/y/d.html"})
    assert dashboard.final_paths(s) == ("/x/run.status.json", "/y/d.html")
    assert dashboard.final_paths(load_settings(env={}, flags={"world_size": 1})) == ("", "")


def test_readiness_is_notified_to_systemd(serve, tmp_path, monkeypatch):
    path = str(tmp_path / "notify.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sd:
        sd.bind(path)
        sd.settimeout(10)
        monkeypatch.setenv("NOTIFY_SOCKET", path)
        svc, ep, ctx = serve(load_settings(env={}, flags={"world_size": 1, "bind": "tcp://127.0.0.1:0"}))
        lines = sd.recv(4096).decode().split("\n")
        assert lines == ["READY=1", f"STATUS=serving {ep}"]
        svc.request_stop()
        got = []
        while "STOPPING=1" not in got:
            got += sd.recv(4096).decode().split("\n")
        assert any(line.startswith("STATUS=run finished: ok=False") for line in got)


def test_notify_without_systemd_is_a_no_op(tmp_path):
    assert notify("READY=1", env={}) is False
    assert notify("READY=1", env={"NOTIFY_SOCKET": str(tmp_path / "nobody-listens")}) is False


def test_to_json_is_strict_json_either_way():
    assert json.loads(dashboard.to_json({"a": [1.5, (2, None)]})) == {"a": [1.5, [2, None]]}
    doc = json.loads(dashboard.to_json({"loss": float("nan")}))  # never a bare NaN
    assert doc["loss"] is None and doc["non_finite"] == ["$.loss = nan"]


def test_a_negative_linger_is_refused_by_name():
    import pytest

    from flodl_coordinator.settings import SettingsError

    with pytest.raises(SettingsError, match="status_linger_s must be a finite number >= 0"):
        load_settings(env={}, flags={"world_size": 1, "status_linger_s": -1.0})
