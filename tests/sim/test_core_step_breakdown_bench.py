"""``bench/core_step_breakdown.py --quick`` runs: both big steps found and taken apart,
the timed replay returning the same commands as the plain one. No timing is asserted
(speed lives in the bench's own output)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench" / "core_step_breakdown.py"


@pytest.mark.timeout(150)  # a hang guard, not a speed assertion
def test_quick_breakdown_takes_both_big_steps_apart():
    done = subprocess.run([sys.executable, str(BENCH), "--quick", "--top", "500"], capture_output=True, text=True,
                          env=dict(os.environ), timeout=120, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout)
    assert out["ok"] is True and out["n"] == 64
    formation, boundary = out["formation"], out["boundary"]
    assert {"_membership.form_all", "_dispatcher.CadenceDispatcher.dispatch_epoch"} <= set(formation["phases_ms"])
    assert "_averaging.finish" in boundary["phases_ms"]
    assert 0 < formation["index"] < boundary["index"] < out["events"]
    for part, must in ((formation, "_membership.form_all"), (boundary, "_averaging.finish")):
        assert part["same_commands"] and part["commands"] >= 64, part["commands"]
        names = {row["function"]: row for row in part["functions"]}
        assert must in names and names[must]["calls"] == 1, sorted(names)[:20]
        assert all(0 < ms <= part["step_ms"] for ms in part["phases_ms"].values()), part  # (each inside the step)
        # inclusive times: none above the whole (timed) step, listed costliest first
        assert all(0 <= row["ms"] <= part["wrapped_step_ms"] for row in part["functions"])
        assert [row["ms"] for row in part["functions"]] == sorted((row["ms"] for row in part["functions"]), reverse=True)
