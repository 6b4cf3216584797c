"""Elastic membership across a network partition (issue 12, test c): a host in its own
network namespace loses its link for longer than the liveness timeout. Its ranks hear
nothing from the coordinator and exit; the coordinator declares them dead; the host's
agent (``--max-restarts``) starts them again, and once the link is back they take their
slots back (seeded with the consensus) and train. The run ends ok, every epoch committed
exactly once, every final digest identical. On the collective plane (test d) the host's
rank comes back into a new gloo generation and is seeded by a member's broadcast."""

import json
import os
import subprocess
import sys
import time

import pytest

import netns
from faults import pid_with_env
from runlocal import ROOT

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(not netns.available(), reason="needs root and iproute2 network namespaces"),
]


def _in(ns, *cmd):
    return ["ip", "netns", "exec", ns, *cmd]


def _wait_for(path, text, deadline_s=240.0):
    t_end = time.monotonic() + deadline_s
    while text not in path.read_text():
        assert time.monotonic() < t_end, f"never saw {text!r}:\n{path.read_text()[-3000:]}"
        time.sleep(0.1)  # polling another process's log


def _wait_until(cond, what, deadline_s=120.0):
    t_end = time.monotonic() + deadline_s
    while not cond():
        assert time.monotonic() < t_end, f"never saw {what}"
        time.sleep(0.05)  # polling another process's start


@pytest.mark.parametrize("plane", ["bus", "collective"])
def test_a_partitioned_hosts_ranks_rejoin_when_the_link_returns(tmp_path, plane):
    summary, log = tmp_path / "summary.json", tmp_path / "coordinator.log"
    py = sys.executable
    tag = 92 if plane == "bus" else 93
    with netns.three_hosts(tag=tag) as (ns, head_ip):
        sfx = os.getpid() % 10000
        link = f"vb{sfx}x"  # host b's end of its veth (netns.three_hosts names it)
        endpoint = f"tcp://{head_ip}:5555"
        coord = subprocess.Popen(
            _in(ns["head"], py, "-m", "flodl_coordinator", "serve", "--bind", endpoint, "--session", "part",
                "--world-size", "3", "--epochs", "8", "--batch-size", "16", "--policy", "cadence",
                "--plane", plane, "--liveness-timeout", "3", "--summary", str(summary)),
            stdout=open(log, "w"), stderr=subprocess.STDOUT, cwd=ROOT,
        )  # fmt: skip
        agents = []
        # Host a's ranks are slow (300 ms a batch), host b's is 15x faster (20 ms): while b
        # is cut off the run crawls (two slow ranks train ~7 batches/s of an epoch's 90), and
        # once b's rank is back it trains most of the rest. b's rank is slow enough that the
        # cut lands with 6+ epochs left: the epoch commits trail it (a slow rank's batch
        # holds the epochs after it open), so the cut waits for an epoch to open, not commit:
        # at 1 ms a batch b's rank ran all 8 epochs' chunks before "epoch 1/8" was committed,
        # and had nothing left to train after the rejoin.
        for i, (key, offset, ranks, slow) in enumerate((("a", 0, 2, "300"), ("b", 2, 1, "20")), start=2):
            # Every namespace shares the machine's hostname: gloo is told each host's own
            # address and interface, as an operator would on a multi-homed host.
            env = {**os.environ, "FLODL_STORE_HOST": f"10.77.{tag}.{i}", "GLOO_SOCKET_IFNAME": f"v{key}{sfx}x"}
            agents.append(subprocess.Popen(
                _in(ns[key], py, "-m", "flodl_worker", "agent", "--coordinator", endpoint, "--session", "part",
                    "--host", f"host-{key}", "--ranks", str(ranks), "--rank-offset", str(offset), "--world-size", "3",
                    "--slowdown", slow, "--base-ms", "1", "--max-restarts", "3", "--",
                    py, "-m", "flodl_worker.examples.digits"),
                stdout=open(tmp_path / f"agent-{key}.log", "w"), stderr=subprocess.STDOUT, cwd=ROOT, env=env,
            ))  # fmt: skip
        try:
            _wait_for(log, "epoch_opened: epoch=1 ")  # training, host b included (it does most)
            subprocess.run(["ip", "-n", ns["b"], "link", "set", link, "down"], check=True)
            _wait_for(log, "rank 2 forgotten: heartbeat stale")  # the coordinator gave it up
            _wait_for(tmp_path / "agent-b.log", "restarting it in")  # and its agent restarts it
            # The partition outlasts the restart: the link comes back only once the new
            # process runs (it cannot have reached the head before).
            _wait_until(lambda: pid_with_env("FLODL_RANK=2", "FLODL_RESTART_COUNT=1", f"GLOO_SOCKET_IFNAME=vb{sfx}x"),
                        "host b's restarted rank process")  # fmt: skip
            subprocess.run(["ip", "-n", ns["b"], "link", "set", link, "up"], check=True)
            rc = coord.wait(timeout=400)
            for a in agents:
                a.wait(timeout=60)
        finally:
            subprocess.run(["ip", "-n", ns["b"], "link", "set", link, "up"], capture_output=True)
            for p in [coord, *agents]:
                if p.poll() is None:
                    p.kill()
        assert rc == 0, log.read_text()[-4000:]
    data = json.loads(summary.read_text())
    assert data["ok"], data["reason"]
    joins = data["elastic"]["joins"]
    assert [j["rank"] for j in joins] == [2] and joins[0]["refill"] and joins[0]["restart_count"] >= 1, joins
    assert data["ranks"][2]["phase"] == "LEFT" and data["ranks"][2]["steps"] > 0
    for c in data["coverage"]:
        assert (c["expected"], c["trained"], c["duplicates"], c["missing"]) == (1437, 1437, 0, 0), c
    assert len({r["param_digest"] for r in data["ranks"]}) == 1
    if plane == "collective":  # it came back into a new gloo generation, seeded by a broadcast
        col = data["collective"]
        assert col["seeds"] >= 1 and col["generation"] >= 3 and col["members"] == [0, 1, 2], col
