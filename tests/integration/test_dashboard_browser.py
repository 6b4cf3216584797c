"""The dashboard in a real headless browser (Debian's chromium + chromium-driver, selenium),
against a live ``flodl run --local``: one lane per rank, curves that grow while the run
goes, a death mark once a rank is killed; then the same page written at the end, opened
from disk. Screenshots are saved under the test's tmp_path (their paths are printed)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from runlocal import ROOT, free_port

pytestmark = pytest.mark.integration

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")


def _browser_or_skip():
    try:
        import selenium  # noqa: F401
    except ImportError as e:
        pytest.skip(f"selenium is not installed ({e}): pip install -r requirements-dev.txt")
    if not (CHROMIUM and CHROMEDRIVER):
        pytest.skip("no headless browser here: apt-get install chromium chromium-driver (.ci/run does)")


def _driver(tmp_path):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1300,1000",
                f"--user-data-dir={tmp_path / 'chrome-profile'}"):
        opts.add_argument(arg)
    # An explicit driver path: selenium never goes looking for one to download.
    return webdriver.Chrome(options=opts, service=Service(executable_path=CHROMEDRIVER))


def _status(base):
    try:
        with urllib.request.urlopen(base + "/status", timeout=2) as resp:
            return json.loads(resp.read())
    except OSError:
        return None


def _until(pred, what, timeout_s, proc=None):
    deadline = time.monotonic() + timeout_s
    while True:
        got = pred()
        if got:
            return got
        if proc is not None and proc.poll() is not None:
            pytest.fail(f"the run ended (exit {proc.returncode}) before {what}")
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.1)


def _js(driver, script):
    return driver.execute_script(script)


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    """One headless chromium for the module's tests (its start-up is the slow part)."""
    _browser_or_skip()
    driver = _driver(tmp_path_factory.mktemp("chrome"))
    yield driver
    driver.quit()


def test_dashboard_reads_the_versioned_status_and_ignores_what_it_does_not_know(browser, tmp_path):
    from flodl_coordinator import dashboard

    status = {  # the shape of /status schema_version 1 (docs/status.md), plus a field from the future
        "schema_version": 1, "future_field": {"x": 1},
        "run": {"session": "s1", "phase": "TRAINING", "ok": None, "world_size": 3},
        "progress": {"epochs_completed": 2, "num_epochs": 5, "fraction": 0.4, "eta_s": 12.0},
        "membership": [{"rank": 0, "phase": "ACTIVE"}, {"rank": 1, "phase": "ACTIVE"}, {"rank": 2, "phase": "DEAD"}],
        "alerts": [{"level": "warning", "kind": "rank_lost", "message": "rank 2 died: killed by signal 9"}],
        "bus": {"rounds": 17}, "dropped_frames": {},
    }  # fmt: skip
    timeline = {"world_size": 3, "num_epochs": 5, "now": 2.0, "lanes": [
        {"rank": r, "host": "h", "spans": [["train", 0.1, 1.0, {"steps": 3}]], "marks": []} for r in range(3)],
        "marks": [], "curve": [], "epochs": [], "events": [], "truncated": {}}  # fmt: skip
    page = tmp_path / "v1.html"
    page.write_text(dashboard.page({"status": status, "timeline": timeline}))
    browser.get(page.as_uri())
    _until(lambda: _js(browser, "return document.body.dataset.renders"), "the page to render", 20)
    text = lambda i: browser.find_element("id", i).text  # noqa: E731
    assert (text("phase"), text("epoch"), text("alive"), text("rounds")) == ("TRAINING", "2/5", "2/3 active", "17")
    assert text("progress") == "40.0%, ETA 12 s" and text("session") == '"s1"'
    assert "rank_lost: rank 2 died" in text("events")
    assert _js(browser, "return document.querySelectorAll('#lanes g.lane').length") == 3


def test_dashboard_in_a_browser_follows_a_live_run_and_its_final_file(browser, tmp_path):
    driver = browser
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    summary = tmp_path / "run.json"
    cmd = [sys.executable, "-m", "flodl", "run", "--local", "--ranks", "2", "--task", "digits", "--epochs", "200",
           "--base-ms", "1", "--http", f"127.0.0.1:{port}", "--summary", str(summary)]  # fmt: skip
    with open(tmp_path / "run.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
        try:
            _watch_live(driver, base, proc, tmp_path)
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)  # the launcher stops the run; the coordinator writes its files
            proc.wait(timeout=60)
    _open_final(driver, summary.with_name("run.dashboard.html"), tmp_path)


def _watch_live(driver, base, proc, tmp_path):
    _until(lambda: (s := _status(base)) and s["core"]["run"]["phase"] == "TRAINING", "training", 120, proc)
    driver.get(base + "/")
    lanes = _until(lambda: _js(driver, "return document.querySelectorAll('#lanes g.lane').length"), "lanes", 20)
    assert lanes == 2  # one lane per rank
    points = lambda: int(_js(driver, "return +(document.querySelector('#throughput .curve')"  # noqa: E731
                                     "?.getAttribute('data-points') || 0)"))
    first = _until(points, "a throughput point", 30, proc)
    _until(lambda: points() > first, "the curve to grow", 30, proc)
    spans = _js(driver, "return [...document.querySelectorAll('#lanes g.lane')].map(g => +g.dataset.spans)")
    assert all(n > 0 for n in spans), spans  # every rank's windows and rounds are drawn
    assert _js(driver, "return document.querySelectorAll('#lanes rect.span.round').length") > 0
    live = tmp_path / "dashboard-live.png"
    driver.save_screenshot(str(live))
    print(f"\ndashboard screenshot (live): {live}")

    pid = _status(base)["core"]["ranks"][1]["pid"]
    os.kill(pid, signal.SIGKILL)  # a rank dies mid-run: its lane gets a death mark
    _until(lambda: _js(driver, "return document.querySelectorAll("
                               "'#lanes g.lane[data-rank=\"1\"] path.mark.death').length"), "a death mark", 30, proc)
    assert "rank_lost" in driver.find_element("id", "events").text
    killed = tmp_path / "dashboard-rank-killed.png"
    driver.save_screenshot(str(killed))
    print(f"dashboard screenshot (rank 1 killed): {killed}")


def _open_final(driver, page, tmp_path):
    """The same page, written at the end with its data, opened from disk (nothing served)."""
    assert page.exists(), (tmp_path / "run.log").read_text()[-3000:]
    driver.get(page.as_uri())
    _until(lambda: _js(driver, "return document.body.dataset.renders"), "the written page to render", 20)
    assert _js(driver, "return document.querySelectorAll('#lanes g.lane').length") == 2
    assert _js(driver, "return document.querySelectorAll('#lanes path.mark.death').length") >= 1
    assert driver.find_element("id", "mode").text != "live"
    assert not driver.find_element("id", "error").text  # it fetched nothing, and needed nothing
    final = tmp_path / "dashboard-final.png"
    driver.save_screenshot(str(final))
    print(f"dashboard screenshot (written at the end): {final}")
