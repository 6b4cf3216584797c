"""Summaries and /status are strict JSON: a diverged (NaN) loss is reported, not written as bare NaN."""

import json
import math

import pytest

from flodl import strictjson
from flodl.core import RunFinished
from flodl_coordinator.service import CoordinatorService
from flodl_coordinator.settings import load_settings


def _strict_load(text: str):
    def refuse(name):
        raise ValueError(f"not JSON: {name}")

    return json.loads(text, parse_constant=refuse)


def test_non_finite_values_become_null_and_are_listed():
    doc = {"epochs": [{"avg_loss": float("nan")}, {"avg_loss": 0.5}], "peak": float("inf"), "n": 3}
    out = _strict_load(strictjson.dumps(doc, sort_keys=True))
    assert out["epochs"][0]["avg_loss"] is None and out["epochs"][1]["avg_loss"] == 0.5
    assert out["peak"] is None and out["n"] == 3
    assert out["non_finite"] == ["$.epochs[0].avg_loss = nan", "$.peak = inf"]
    assert math.isnan(doc["epochs"][0]["avg_loss"])  # the input is not mutated


def test_finite_documents_are_unchanged():
    doc = {"a": [1, 2.5, None, "x"], "b": {"c": True}}
    assert _strict_load(strictjson.dumps(doc)) == doc


def test_service_summary_with_a_nan_loss_is_valid_json(tmp_path):
    path = tmp_path / "summary.json"
    # final_eval off: no rank runs here to write the output model the summary would ask for
    s = load_settings(env={}, flags={"world_size": 1, "bind": "tcp://127.0.0.1:0", "summary": str(path), "final_eval": False})
    svc = CoordinatorService(s, ready=lambda ep: None)
    svc.finished = RunFinished(True, "completed", {"epochs": [{"epoch": 0, "avg_loss": float("nan")}]})
    assert svc._finish() == 0
    out = _strict_load(path.read_text())
    assert out["epochs"][0]["avg_loss"] is None
    assert out["non_finite"] == ["$.epochs[0].avg_loss = nan"]


@pytest.mark.parametrize("value", [float("nan"), float("-inf")])
def test_status_over_http_is_strict_json_with_a_non_finite_epoch_loss(value):
    import urllib.request

    from flodl.core import CoreConfig, Notice, initial_state
    from flodl_coordinator.status import StatusBoard

    class _Reducer:
        rounds_completed = bytes_in = bytes_out = 0

    board = StatusBoard()
    board.notice(Notice("epoch", {"epoch": 0, "avg_loss": value}))
    board.update(initial_state(CoreConfig(world_size=1)), {}, _Reducer())
    http = board.serve("127.0.0.1:0")
    try:
        port = http.server_address[1]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/status", timeout=10) as r:
            out = _strict_load(r.read().decode())
    finally:
        http.shutdown()
    assert out["last_epoch"]["avg_loss"] is None
    # the last epoch appears twice in the document: as last_epoch and as the newest recent_epochs entry
    assert out["recent_epochs"][0]["avg_loss"] is None
    assert sorted(out["non_finite"]) == [f"$.last_epoch.avg_loss = {value!r}", f"$.recent_epochs[0].avg_loss = {value!r}"]
