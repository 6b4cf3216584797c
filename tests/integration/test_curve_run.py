"""A short real run over CURVE: coordinator, one agent, its relay, two ranks.

``flodl run --local --curve`` makes throwaway keys: the coordinator is a CURVE server
with a one-key allowlist, and the agent's DEALER and the relay's uplink are CURVE
clients (the ranks reach the relay over ipc, without keys).
"""

import pytest

from runlocal import run_local

pytestmark = pytest.mark.integration


def test_a_run_over_curve_completes_with_relay_agent_and_ranks(tmp_path):
    proc, summary, _trace = run_local(
        tmp_path, "--curve", "--ranks", "2", "--task", "synthetic", "--base-ms", "0",
        "--epochs", "1", "--batch-size", "32", "--policy", "sync", "--log-level", "INFO", timeout=120,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert summary["ok"] is True
    assert "CURVE on: 1 allowed client key(s)" in out  # the coordinator's ROUTER is a CURVE server
    assert "(CURVE)" in out  # the relay's uplink is a CURVE client
    assert "supervises ranks [0, 1]" in out  # the agent's own DEALER got through the handshake
    assert "SECURITY" not in out and "refused a client" not in out
    assert sum(r["samples"] for r in summary["ranks"]) == summary["coverage"][0]["expected"]
