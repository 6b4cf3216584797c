"""``bench/core_scale.py --quick`` runs: a curve per policy, and the peer path (the same
journal replayed through another checkout -- here this one). No timing is asserted
(speed lives in the bench's own output)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench" / "core_scale.py"


def _bench(*args: str) -> dict:
    done = subprocess.run([sys.executable, str(BENCH), "--quick", *args], capture_output=True, text=True,
                          env=dict(os.environ), timeout=120, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)


@pytest.mark.timeout(150)  # a hang guard, not a speed assertion
def test_quick_bench_gives_a_curve_per_policy():
    out = _bench("--no-memory")
    assert out["ok"] is True and set(out["policies"]) == {"sync", "cadence", "async"}
    for name, pol in out["policies"].items():
        assert [row["n"] for row in pol["curve"]] == [16, 64] and pol["skipped"] == [], name
        for row in pol["curve"]:
            assert row["finished_ok"] and row["replays_ok"] and row["events"] > 4 * row["n"], row
            assert row["us_per_event"] > 0 and row["formation_ms"] is not None and row["epoch_dispatch_ms"] is not None


@pytest.mark.timeout(150)
def test_quick_bench_replays_the_same_journal_through_a_peer():
    out = _bench("--policies", "sync", "--peer", str(ROOT))
    for row in out["policies"]["sync"]["curve"]:
        peer = row["peer"]
        assert peer["events"] == row["events"] and peer["replays_ok"], peer
        assert row["peer_over_ours"] > 0 and row["peak_mib"] > 0 and peer["peak_mib"] > 0
