"""The operator's view of a live run: ``/metrics`` parsed with prometheus_client's parser,
``/status`` validated against docs/status.schema.json, and ``flodl status`` as a table --
all read from one real process tree (coordinator, agent, relay, three unequal ranks)
while it trains. One run for every check keeps the suite's time down."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import jsonschema
import pytest
from prometheus_client.parser import text_string_to_metric_families

from runlocal import ROOT, alarming, free_port

pytestmark = pytest.mark.integration

SCHEMA = json.loads((ROOT / "docs" / "status.schema.json").read_text())
RANKS = 3
EPOCHS = 10  # long enough (seconds of training) to read the run three ways while it trains
LABELLED = 2  # --metrics-rank-labels: rank 2 is summed under rank="other"
CAUSES = ("training", "calibration", "barrier", "averaging", "recovery", "checkpoint", "eval", "startup")


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as r:
        return r.read().decode()


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    """A run in progress: /status mid-training, /metrics and ``flodl status`` right after, then the end."""
    tmp: Path = tmp_path_factory.mktemp("operator")
    port = free_port()
    cmd = [
        sys.executable, "-m", "flodl", "run", "--local", "--ranks", str(RANKS), "--task", "digits",
        "--slowdown", "1,2,4", "--base-ms", "20", "--epochs", str(EPOCHS), "--http", f"127.0.0.1:{port}",
        "--metrics-rank-labels", str(LABELLED), "--summary", str(tmp / "summary.json"),
    ]  # fmt: skip
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    doc = None
    try:
        deadline = t0 + 150
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                d = json.loads(_get(base + "/status"))
            except OSError:
                time.sleep(0.2)  # not bound yet
                continue
            p = d.get("progress", {})
            # Mid-training, with a measured rate (so an ETA) and an epoch behind it.
            # (and each rank's time account reported since it began training: heartbeats, 1 s apart).
            trained = all(m["goodput_s"] > 0 for m in d.get("membership", [{"goodput_s": 0}]))
            if d["run"]["phase"] == "TRAINING" and p.get("epochs_completed", 0) >= 1 and p.get("eta_s") and trained:
                doc = d
                break
            time.sleep(0.1)
        assert doc is not None, f"never saw a training run with an ETA; output:\n{_drain(proc)[-4000:]}"
        metrics = _get(base + "/metrics")
        table = subprocess.run([sys.executable, "-m", "flodl", "status", "--http", f"127.0.0.1:{port}"],
                               cwd=ROOT, capture_output=True, text=True, timeout=60)  # fmt: skip
        raw = subprocess.run([sys.executable, "-m", "flodl", "status", "--http", f"127.0.0.1:{port}", "--json"],
                             cwd=ROOT, capture_output=True, text=True, timeout=60)  # fmt: skip
        out, _ = proc.communicate(timeout=180)
        yield {"status": doc, "metrics": metrics, "table": table, "raw": raw, "rc": proc.returncode, "out": out,
               "elapsed": time.monotonic() - t0}  # fmt: skip
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _drain(proc) -> str:
    proc.kill()
    return proc.communicate()[0] or ""


def _nulls(x, path=""):
    """Paths of the null values in a JSON document."""
    if x is None:
        return [path]
    if isinstance(x, dict):
        return [p for k, v in x.items() for p in _nulls(v, f"{path}.{k}" if path else k)]
    if isinstance(x, list):
        return [p for i, v in enumerate(x) for p in _nulls(v, f"{path}[{i}]")]
    return []


def test_status_document_validates_and_every_field_is_filled_mid_training(live):
    doc = live["status"]
    jsonschema.validate(doc, SCHEMA)
    # Null only where the run itself has no value yet: not finished (ok), no checkpoint
    # (none configured), and a round that is not open has no age; "waiting" entries are
    # null when nothing waits.
    allowed = {"run.ok", "checkpoints.latest"} | ({"round.open_s"} if not doc["round"]["open"] else set())
    nulls = [p for p in _nulls({k: v for k, v in doc.items() if k != "core"})
             if p not in allowed and not p.startswith("waiting.")]  # fmt: skip
    assert nulls == [], nulls
    p = doc["progress"]
    assert 0 < p["fraction"] < 1 and p["samples_per_s"] > 0 and p["eta_s"] > 0
    assert p["samples_total"] == EPOCHS * 1437 and p["epochs_completed"] >= 1
    assert doc["last_epoch"]["epoch"] == p["epochs_completed"] - 1
    assert doc["last_epoch"]["coverage"]["missing"] == 0
    assert len(doc["membership"]) == RANKS
    for m in doc["membership"]:
        assert m["phase"] == "ACTIVE" and m["host"] and m["pid"] > 0 and m["epoch"] is not None
        assert m["rate"] is not None and 0 < m["share"] < 1 and m["window"] >= 1
        assert m["last_seen_s"] is not None and m["goodput_s"] > 0 and m["time_s"]["wall"] > 0
    assert abs(sum(m["share"] for m in doc["membership"]) - 1) < 1e-9
    # Each rank's own wall clock against the coordinator's: every rank lived through the
    # whole time since the world formed (less its last report's age, a heartbeat, and slack).
    since_formed = doc["core"]["now"] - doc["run"]["formed_at"]
    for m in doc["membership"]:
        assert m["time_s"]["wall"] >= since_formed - 2.5, (m["rank"], m["time_s"], since_formed)
        assert sum(v for k, v in m["time_s"].items() if k != "wall") == pytest.approx(m["time_s"]["wall"], rel=0.01)
    # Why nothing happened yet: the epoch in flight is not complete (or a round is gated).
    assert doc["waiting"]["epoch"] or doc["waiting"]["round"]
    assert doc["alerts"] == []  # a healthy run
    assert doc["run"]["session"].startswith("local-") and doc["run"]["policy"] == "cadence"


def test_metrics_parse_with_names_types_and_bounded_rank_labels(live):
    fams = {f.name: f for f in text_string_to_metric_families(live["metrics"])}
    expected = {
        "flodl_run_info": "gauge", "flodl_run_phase": "gauge", "flodl_epoch": "gauge", "flodl_progress_ratio": "gauge",
        "flodl_eta_seconds": "gauge", "flodl_committed_samples": "counter", "flodl_rank_samples": "counter",
        "flodl_rank_samples_per_second": "gauge", "flodl_rank_window_batches": "gauge",
        "flodl_averaging_rounds": "counter", "flodl_averaging_round_seconds": "histogram",
        "flodl_bus_bytes": "counter", "flodl_bus_bytes_per_round": "gauge", "flodl_relay_folds_sent": "counter",
        "flodl_relay_fanout_copies": "counter", "flodl_rank_deaths": "counter", "flodl_rank_joins": "counter",
        "flodl_rank_restarts": "counter", "flodl_dropped_frames": "counter",
        "flodl_coordinator_restarts": "counter", "flodl_rank_goodput_seconds": "counter",
        "flodl_rank_badput_seconds": "counter", "flodl_rank_wall_seconds": "counter",
    }  # fmt: skip
    for name, typ in expected.items():
        assert name in fams, name
        assert fams[name].type == typ, (name, fams[name].type)
    run = live["status"]["run"]["session"]
    for f in fams.values():
        assert f.name.startswith("flodl_")
        for s in f.samples:
            assert s.labels.get("run") == run, (f.name, s.labels)
    # Per-rank families: ranks below the bound by number, the rest summed as "other".
    ranks = {s.labels["rank"] for s in fams["flodl_rank_samples"].samples}
    assert ranks == {"0", "1", "other"}
    def value(sample: str, **lb) -> float:
        return sum(s.value for f in fams.values() for s in f.samples
                   if s.name == sample and all(s.labels.get(k) == v for k, v in lb.items()))  # fmt: skip

    assert value("flodl_run_phase", phase="TRAINING") == 1
    assert value("flodl_rank_joins_total", reason="formation") == RANKS
    assert value("flodl_averaging_round_seconds_count") >= 1
    assert value("flodl_averaging_rounds_total") >= value("flodl_averaging_round_seconds_count")
    assert value("flodl_bus_bytes_total", direction="in") > 0
    # The relay folds the three ranks' rounds and says so on each folded round.
    assert value("flodl_relay_folds_sent_total") >= 1
    assert value("flodl_relay_ranks_folded_total") >= value("flodl_relay_folds_sent_total")
    assert value("flodl_rank_deaths_total") == 0 and value("flodl_dropped_frames_total") == 0


def test_goodput_and_badput_add_up_to_each_ranks_wall_time(live):
    fams = {f.name: f for f in text_string_to_metric_families(live["metrics"])}
    per: dict[str, dict[str, float]] = {}
    for fam in ("flodl_rank_goodput_seconds", "flodl_rank_badput_seconds"):
        for s in fams[fam].samples:
            per.setdefault(s.labels["rank"], {})[s.labels["cause"]] = s.value
    wall = {s.labels["rank"]: s.value for s in fams["flodl_rank_wall_seconds"].samples}
    assert set(per) == set(wall) == {"0", "1", "other"}
    for rank, causes in per.items():
        assert set(causes) == set(CAUSES)
        assert wall[rank] > 0
        assert abs(sum(causes.values()) - wall[rank]) <= 0.01 * wall[rank], (rank, causes, wall[rank])
        assert causes["startup"] > 0 and causes["training"] + causes["calibration"] > 0
        # A rank's wall time is its own clock, which cannot exceed the test's.
        assert wall[rank] <= live["elapsed"] + 1.0


def test_flodl_status_prints_the_live_run_as_a_table(live):
    t = live["table"]
    assert t.returncode == 0, t.stderr
    lines = t.stdout.splitlines()
    assert lines[0].startswith("run local-") and lines[0].split()[2] in ("TRAINING", "FINAL_EVAL", "SHUTTING_DOWN")
    assert lines[1].startswith("progress  [") and "eta " in lines[1]
    header = next(i for i, ln in enumerate(lines) if ln.split()[:2] == ["rank", "phase"])
    rows = [ln.split() for ln in lines[header + 1 : header + 1 + RANKS]]
    assert [r[0] for r in rows] == ["0", "1", "2"] and all(r[1] in ("ACTIVE", "LEFT") for r in rows)
    raw = json.loads(live["raw"].stdout)
    assert raw["schema_version"] == 1 and len(raw["membership"]) == RANKS


def test_the_launcher_shows_one_line_per_epoch_and_nothing_at_warning_level(live):
    assert live["rc"] == 0, live["out"][-4000:]
    lines = live["out"].splitlines()
    bad = alarming(live["out"], ("WARNING", "ERROR", "Traceback"))
    assert not bad, bad
    epochs = [ln.split()[1] for ln in lines if ln.startswith("epoch ")]
    assert epochs == [f"{e}/{EPOCHS}" for e in range(1, EPOCHS + 1)], lines[:40]
    # Below WARNING nothing of the children's logs shows (--log-level INFO brings it back).
    assert not [ln for ln in lines if " INFO " in ln or ln.startswith("[")], lines[:40]
    assert "=== flodl run summary ===" in lines


def test_flodl_status_without_a_coordinator_says_why():
    port = free_port()
    r = subprocess.run([sys.executable, "-m", "flodl", "status", "--http", f"127.0.0.1:{port}"],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert r.returncode == 2
    assert f"cannot read http://127.0.0.1:{port}/status" in r.stderr and "--http" in r.stderr
