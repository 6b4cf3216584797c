"""deploy/grafana/flodl.json uses only metrics /metrics exposes, with labels they carry."""

import json
import re
from pathlib import Path

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from flodl.core import CoreConfig, initial_state, status_view
from flodl.wire import pb
from flodl_coordinator.metrics import RunBook, RunCollector, new_registry
from flodl_coordinator.reducer import BusReducer

DASHBOARD = Path(__file__).resolve().parents[3] / "deploy" / "grafana" / "flodl.json"
_SUFFIXES = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_count", "_sum"), "info": ("_info",)}
# PromQL words that look like names but are not metrics.
_NOT_METRICS = {"by", "le", "rate", "sum", "increase", "histogram_quantile", "label_values"}


def _exposed() -> tuple[set[str], dict[str, set[str]]]:
    """Sample names the collector can expose (from each family's type), and the labels seen."""
    st = initial_state(CoreConfig(world_size=2))
    book = RunBook("r", rank_labels=8)
    book.time_account(0, 1, pb.TimeAccount(training_s=1.0, wall_s=1.0))
    book.relay_stats("relay", 1, pb.RelayStats(folds_sent=1))
    book.publish(st, status_view(st), reducer=BusReducer(), dropped={"route_mismatch": 1},
                 journal={"bytes": 1, "records": 1, "fsyncs": 1, "unsynced": 0, "lag_s": 0.0}, events=1)  # fmt: skip
    names = {f.name + sfx for f in RunCollector(book).collect() for sfx in _SUFFIXES[f.type]}
    labels: dict[str, set[str]] = {}
    for fam in text_string_to_metric_families(generate_latest(new_registry(book)).decode()):
        for s in fam.samples:
            labels.setdefault(s.name, set()).update(s.labels)
    return names, labels


def _exprs(dash: dict) -> list[str]:
    out = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    out += [v["query"]["query"] for v in dash["templating"]["list"] if isinstance(v.get("query"), dict)]
    return out


def test_every_metric_the_dashboard_uses_is_exposed_with_the_labels_it_groups_by():
    dash = json.loads(DASHBOARD.read_text())
    names, labels = _exposed()
    exprs = _exprs(dash)
    assert len(exprs) >= 20
    used = set()
    for e in exprs:
        metrics = set(re.findall(r"\bflodl_[a-z0-9_]+", e)) - _NOT_METRICS
        assert metrics, f"a panel without a flodl metric: {e}"
        missing = metrics - names
        assert not missing, f"{e}: not exposed: {sorted(missing)}"
        used |= metrics
        seen = set().union(*(labels.get(m, set()) for m in metrics)) | {"le"}
        for group in re.findall(r"by \(([^)]*)\)", e):
            for lb in (x.strip() for x in group.split(",")):
                assert lb in seen, f"{e}: groups by {lb!r}, which {sorted(metrics)} do not carry"
        assert 'run="$run"' in e or "label_values" in e, f"{e}: not filtered by the run"
    # The dashboard shows the goodput story, the rounds, the relays and the faults.
    for m in ("flodl_rank_goodput_seconds_total", "flodl_rank_badput_seconds_total", "flodl_rank_wall_seconds_total",
              "flodl_averaging_round_seconds_bucket", "flodl_relay_folds_sent_total", "flodl_rank_deaths_total",
              "flodl_eta_seconds", "flodl_journal_lag_seconds"):  # fmt: skip
        assert m in used, m


def test_dashboard_panels_have_unique_ids_and_a_run_variable():
    dash = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    assert "run" in {v["name"] for v in dash["templating"]["list"]}
