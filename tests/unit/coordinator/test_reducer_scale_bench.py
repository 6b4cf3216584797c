"""``bench/reducer_scale.py`` runs, with its peer path (another checkout -- here this one).
No timing is asserted (speed lives in the bench's own output)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
BENCH = ROOT / "bench" / "reducer_scale.py"


@pytest.mark.timeout(120)  # a hang guard, not a speed assertion
def test_reducer_bench_gives_a_curve_and_the_peers_beside_it():
    done = subprocess.run([sys.executable, str(BENCH), "--sizes", "16,64", "--repeats", "1", "--peer", str(ROOT)],
                          capture_output=True, text=True, timeout=100, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout)
    for side in (out["ours"], out["peer"]):
        assert set(side["by_n"]) == {"16", "64"} and side["growth"] > 0, side
        assert all(row["us_per_contribution"] > 0 and row["finish_ms"] >= 0 for row in side["by_n"].values()), side
    assert set(out["peer_over_ours"]) == {"16", "64"}
