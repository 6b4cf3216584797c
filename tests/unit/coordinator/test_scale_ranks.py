"""bench/control_scale.py's fake ranks speak the real protocol: a short run completes.

The load generator is only worth its numbers if its ranks do what real ones do: here
six of them (the real rank machine on real DEALER sockets) train a cadence run against
the real service to the end, every sample once, nothing dropped; the round-trigger
latency is computed from the right frames; and the raw floor beside it (a bare ROUTER's
broadcast) counts every DEALER's arrival of every round.
"""

from __future__ import annotations

import pathlib
import sys
import time

import pytest

from flodl_coordinator.settings import load_settings

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[3] / "bench"))
import control_scale  # noqa: E402
import scale_ranks  # noqa: E402


def test_fake_ranks_train_a_cadence_run_to_the_end(serve):
    n, total = 6, 240
    svc, ep, _ctx = serve(load_settings(env={}, flags={
        "world_size": n, "bind": "tcp://127.0.0.1:0", "session": "scale", "epochs": 2, "batch_size": 1,
        "policy": "cadence", "total_samples": total, "final_eval": False,
    }))  # fmt: skip
    out = scale_ranks.serve_ranks({"ranks": list(range(n)), "ms": [1.0, 2.0, 4.0] * 2, "world": n, "session": "scale",
                                   "dataset_len": total, "timeout_s": 60, "connect": [ep]})  # fmt: skip
    assert out["finished"] == n and out["exit_reasons"] == ["shutdown"], out["exit_reasons"]
    assert out["batches"] == 2 * total  # batch size 1: every sample of both epochs, once
    assert out["drops"] == {}
    # The service thread records RunFinished after it sent the Shutdowns the ranks just
    # acted on: wait for it (bounded) rather than race it.
    deadline = time.monotonic() + 15
    while svc.finished is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert svc.finished is not None and svc.finished.ok, svc.finished
    assert dict(svc.dropped) == {}
    # The end of the run is on the summary's timeline, in order (runmarks.py).
    t = svc.marks.timeline()
    marks = ["first_batch", "committed_99pct", "last_batch", "epochs_done", "shutdown"]
    assert [k for k in t if k in marks] == marks, t
    assert t["first_batch"] <= min(t["committed_99pct"], t["last_batch"]), t
    assert max(t["committed_99pct"], t["last_batch"]) <= t["epochs_done"] <= t["shutdown"], t
    # A request arrived after the rank's last frame, and was handled once it had arrived.
    assert out["requests"] and all(handled >= arrival >= sent > 0 for _c, arrival, sent, handled in out["requests"])
    assert out["handling_lag_s"] >= 0.0
    assert out["latency_us"] and min(out["latency_us"]) >= 0.0  # a wait never ends before what it waited on
    assert 0.0 <= out["idle_s"] and out["train_s"] > 0


def test_round_trigger_is_the_latest_frame_before_the_first_request_arrived():
    # cycle 1: ranks sent at t=1.0 and 1.5; the first RequestParams arrived at 2.0, the
    # other at 2.5 -> latencies 0.5 s and 1.0 s from the 1.5 s frame. Cycle 2: one rank
    # was still sending after the round opened (3.2 > 3.1): not a candidate trigger.
    reqs = [(1, 2.0, 1.0), (1, 2.5, 1.5), (2, 3.1, 3.0), (2, 3.3, 3.2)]
    lat = sorted(control_scale.decision_latencies(reqs))
    assert lat == pytest.approx([0.1e6, 0.3e6, 0.5e6, 1.0e6])


def test_the_raw_broadcast_floor_counts_every_arrival_of_every_round():
    # 10 DEALERs in 2 generator processes, 3 rounds: 30 arrivals, each after its trigger.
    got = control_scale.run_raw_broadcast(10, 2, 3)
    assert got["ok"] and got["arrivals"] == got["expected"] == 30, got
    assert 0 < got["latency_min_us"] <= got["first_command_p50_us"] <= got["latency_p50_us"] <= got["latency_p99_us"], got


def test_a_peer_takes_turns_with_ours_within_each_repeat(monkeypatch, capsys):
    """``--peer-reports-per-s``: the peer's runs alternate with ours run by run (a machine
    that slows mid-sitting slows both alike), each reaches the coordinator as its
    ``batch_reports_per_s``, and each side's rows are the medians of its own runs."""
    import json

    calls = []

    def fake_run(n, ms, *, hosts, epochs, batches_per_rank, gens, policy, timeout_s, report_ms=None,
                 reports_per_s=None, log_level="WARNING"):  # fmt: skip
        calls.append(("saturated" if ms == [0.0] else "paced", reports_per_s))
        idle = 0.1 if reports_per_s is None else 0.2
        return {"ok": True, "idle_share": idle + 0.01 * len(calls), "cpu_us_per_frame": 10.0, "cpu_us_per_batch": 5.0,
                "latency_p99_us": 1.0, "cpu_pct": 1.0}  # fmt: skip

    monkeypatch.setattr(control_scale, "run_flodl", fake_run)
    monkeypatch.setattr(sys, "argv", ["control_scale", "--ranks", "256", "--repeats", "2", "--skip", "raw,relayed",
                                      "--peer-reports-per-s", "0"])  # fmt: skip
    control_scale.main()
    assert calls == [("saturated", None), ("paced", None), ("saturated", 0.0), ("paced", 0.0)] * 2
    row = json.loads(capsys.readouterr().out)["by_n"]["256"]
    assert [k for k in row if "@" in k or k in ("saturated", "paced")] == ["saturated", "paced", "saturated@0/s", "paced@0/s"]
    assert row["paced"]["runs"] == row["paced@0/s"]["runs"] == 2
    assert row["paced"]["idle_share"] == pytest.approx((0.12 + 0.16) / 2)  # ours: runs 2 and 6
    assert row["paced@0/s"]["idle_share"] == pytest.approx((0.24 + 0.28) / 2)  # the peer's: runs 4 and 8
