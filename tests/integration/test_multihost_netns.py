"""Multi-host without Docker: coordinator and two host agents in separate network namespaces.

This is the README's "Running on several hosts by hand", executed: the coordinator binds
a non-loopback address in its namespace; each host's agent starts its own relay and two
ranks, which reach the coordinator only through that relay and the veth link.
"""

import json
import subprocess
import sys

import pytest

import netns
from runlocal import ROOT

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(not netns.available(), reason="needs root and iproute2 network namespaces"),
]


def _in(ns, *cmd):
    return ["ip", "netns", "exec", ns, *cmd]


def test_two_hosts_two_relays_four_ranks(tmp_path):
    summary = tmp_path / "summary.json"
    py = sys.executable
    with netns.three_hosts(tag=91) as (ns, head_ip):
        coord = subprocess.Popen(
            _in(ns["head"], py, "-m", "flodl_coordinator", "serve", "--bind", f"tcp://{head_ip}:5555",
                "--session", "rig", "--world-size", "4", "--epochs", "2", "--batch-size", "16",
                "--summary", str(summary)),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
        )  # fmt: skip
        assert coord.stdout.readline().startswith("COORDINATOR_READY")
        agents = []
        for key, offset, slow in (("a", 0, "1,2"), ("b", 2, "2,4")):
            agents.append(subprocess.Popen(
                _in(ns[key], py, "-m", "flodl_worker", "agent", "--coordinator", f"tcp://{head_ip}:5555",
                    "--session", "rig", "--host", f"host-{key}", "--ranks", "2", "--rank-offset", str(offset),
                    "--world-size", "4", "--slowdown", slow, "--base-ms", "2", "--",
                    py, "-m", "flodl_worker.examples.digits"),
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
            ))  # fmt: skip
        try:
            rc = coord.wait(timeout=240)
            logs = [a.communicate(timeout=60)[0] for a in agents]
        finally:
            for p in [coord, *agents]:
                if p.poll() is None:
                    p.kill()
        err = coord.stderr.read()
        assert rc == 0, err[-3000:]
        assert "SECURITY" in err  # non-loopback bind without keys warns loudly
        assert all(a.returncode == 0 for a in agents), logs
    data = json.loads(summary.read_text())
    assert data["ok"] and data["world_size"] == 4
    assert {r["host"] for r in data["ranks"]} == {"host-a", "host-b"}
    for c in data["coverage"]:
        assert (c["expected"], c["trained"], c["duplicates"], c["missing"]) == (1437, 1437, 0, 0), c
    assert len({r["param_digest"] for r in data["ranks"]}) == 1
