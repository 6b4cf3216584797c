"""``/status`` and ``/metrics`` over real HTTP, with the service in a thread and ranks
played by DEALER sockets (as in test_service.py); and the StatusBoard on its own."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families

from flodl.core import CoreConfig, initial_state
from flodl.wire import Endpoint, decode, pb, split_routing
from flodl_coordinator.reducer import BusReducer
from flodl_coordinator.settings import load_settings
from flodl_coordinator.status import StatusBoard

SESSION = "status-test"
TOTAL = 64


@pytest.fixture
def service(serve):
    svc, ep, ctx = serve(load_settings(env={}, flags={
        "world_size": 2, "bind": "tcp://127.0.0.1:0", "session": SESSION, "epochs": 2,
        "batch_size": 4, "liveness_timeout_s": 30.0, "http": "127.0.0.1:0",
    }))  # fmt: skip
    host, port = svc.status.http_address
    return svc, ep, ctx, f"http://{host}:{port}"


class Peer:
    def __init__(self, ctx, ep, rank, inc):
        self.rank = rank
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(ep)
        self.me = Endpoint(SESSION, pb.Sender.KIND_RANK, rank=rank, incarnation=inc)

    def send(self, body, msg):
        self.sock.send_multipart(self.me.frames(body, msg))

    def recv(self, timeout_ms=5000):
        assert self.sock.poll(timeout_ms), "nothing came back"
        return decode(split_routing(self.sock.recv_multipart())[1], session=SESSION)

    def hello(self, host):
        self.send("hello", pb.RankHello(rank=self.rank, world_size=2, model_sig=b"a" * 32, dataset_len=TOTAL,
                                        host=host, pid=4000 + self.rank))
        while True:
            m = self.recv()
            if m.kind == "hello_ack":
                assert m.envelope.hello_ack.accepted, m.envelope.hello_ack.reason
                return

    def start_epoch(self):
        """The plan of the first StartEpoch that reaches this rank."""
        while True:
            m = self.recv()
            if m.kind == "control" and m.envelope.control.WhichOneof("cmd") == "start_epoch":
                return m.envelope.control.start_epoch.plan


def get(url):
    with urllib.request.urlopen(url, timeout=5) as resp:
        return resp.headers.get("Content-Type"), resp.read().decode()


def status_when(base, pred, timeout_s=10.0):
    """GET /status until ``pred(doc)`` holds (the board is republished after each event)."""
    deadline = time.monotonic() + timeout_s
    while True:
        doc = json.loads(get(base + "/status")[1])
        if pred(doc):
            return doc
        assert time.monotonic() < deadline, f"/status never matched: {json.dumps(doc, indent=1)}"
        time.sleep(0.02)


def test_status_core_block_follows_admission_forming_and_training(service):
    svc, ep, ctx, base = service
    r0 = Peer(ctx, ep, 0, 1)
    r0.hello("host-a")
    doc = status_when(base, lambda d: d["core"]["ranks"][0]["phase"] == "JOINING")
    core = doc["core"]
    assert doc["schema_version"] == 1
    assert doc["run"]["phase"] == core["run"]["phase"] == "FORMING"
    assert core["world_size"] == 2
    assert core["ranks"][0] | {"last_seen": None} == {
        "rank": 0, "phase": "JOINING", "host": "host-a", "pid": 4000, "incarnation": 1, "epoch": None,
        "samples": 0, "batches": 0, "last_step": 0, "folded_step": 0, "last_seen": None, "reason": "",
        "window": 1,
    }  # fmt: skip
    assert core["ranks"][0]["last_seen"] > 0
    assert core["ranks"][1]["phase"] == "VACANT"
    assert core["epoch"] == {"num_epochs": 2, "dispatched": None, "aggregated": None}
    assert core["round"]["open"] is False and core["round"]["waiting_for"] == []
    assert core["progress"]["samples_committed"] == 0

    r1 = Peer(ctx, ep, 1, 2)
    r1.hello("host-b")
    plan = r0.start_epoch()
    doc = status_when(base, lambda d: d["core"]["run"]["phase"] == "TRAINING")
    core = doc["core"]
    assert [(r["phase"], r["host"]) for r in core["ranks"]] == [("ACTIVE", "host-a"), ("ACTIVE", "host-b")]
    assert core["epoch"]["dispatched"] == 0 and core["epoch"]["aggregated"] is None
    assert core["progress"] == {"samples_committed": 0, "samples_total": 2 * TOTAL, "fraction": 0.0,
                                "samples_discarded": 0}  # fmt: skip
    assert isinstance(core["reasons"], dict)
    # The operator's view of the same facts: membership, and why the epoch is not done.
    assert [(m["rank"], m["phase"], m["host"]) for m in doc["membership"]] == [(0, "ACTIVE", "host-a"), (1, "ACTIVE", "host-b")]
    assert doc["waiting"]["epoch"] == "epoch 0 not complete"
    # (these peers never heartbeat: on a slow machine they may already count as silent)
    assert all(a["kind"] == "rank_silent" for a in doc["alerts"]), doc["alerts"]

    # One trained batch shows in rank 0's counters (trained, not yet committed).
    r0.send("timing", pb.Timing(rank=0, batch=pb.Timing.Batch(
        batch_ms=5.0, step_count=1, batch_loss=1.0, samples=4, epoch=plan.epoch, offset=plan.partition_offset)))  # fmt: skip
    doc = status_when(base, lambda d: d["core"]["ranks"][0]["batches"] == 1)
    assert doc["core"]["ranks"][0]["samples"] == 4 and doc["core"]["ranks"][0]["last_step"] == 1
    assert doc["core"]["progress"]["samples_committed"] == 0


def test_metrics_over_http_counts_events_and_dropped_frames_by_reason(service):
    svc, ep, ctx, base = service
    r0 = Peer(ctx, ep, 0, 1)
    r0.hello("host-a")
    # A frame whose body claims another rank than its route owns: dropped, counted.
    r0.send("timing", pb.Timing(rank=1, heartbeat=pb.Timing.Heartbeat(step_count=1)))
    doc = status_when(base, lambda d: d.get("dropped_frames", {}).get("route_mismatch") == 1)
    assert {"level": "warning", "kind": "dropped_frames", "message": "1 frame(s) dropped: route_mismatch"} in doc["alerts"]
    ctype, text = get(base + "/metrics")
    assert ctype.startswith("text/plain")
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    assert fams["flodl_events"].type == "counter"
    (events,) = fams["flodl_events"].samples
    assert events.labels == {"run": SESSION} and events.value >= 1
    dropped = {s.labels["reason"]: s.value for s in fams["flodl_dropped_frames"].samples}
    assert dropped == {"route_mismatch": 1}
    bus = {s.labels["direction"]: s.value for s in fams["flodl_bus_bytes"].samples}
    assert bus == {"in": 0, "out": 0}


def test_unknown_path_is_404(service):
    _, _, _, base = service
    with pytest.raises(urllib.error.HTTPError) as e:
        get(base + "/nope")
    assert e.value.code == 404


def test_board_update_fills_the_core_block():
    # The probe of core-redesign §6: this used to give core == {}.
    board = StatusBoard()
    board.update(initial_state(CoreConfig(world_size=2)), {}, BusReducer())
    snap = board.snapshot()
    assert snap["run"]["phase"] == "FORMING"
    assert snap["core"]["run"]["phase"] == "FORMING"
    assert [r["phase"] for r in snap["core"]["ranks"]] == ["VACANT", "VACANT"]
    json.dumps(snap, allow_nan=False)  # JSON-safe as it stands


def test_alerts_say_what_an_operator_should_look_at_worst_first():
    from flodl.core import DEAD, FINISHED

    st = initial_state(CoreConfig(world_size=2))
    st.ranks[1].phase, st.ranks[1].reason = DEAD, "killed by signal 9"
    st.run.phase, st.run.ok, st.run.reason = FINISHED, False, "all ranks lost"
    board = StatusBoard()
    board.update(st, {"route_mismatch": 2, "hello_deferred": 1}, BusReducer(), checkpoints={"missing": [3]},
                 journal={"lag_s": 9.0})  # fmt: skip
    alerts = [(a["level"], a["kind"], a["message"]) for a in board.snapshot()["alerts"]]
    assert alerts == [
        ("error", "run_failed", "the run failed: all ranks lost"),
        ("error", "checkpoint_missing", "checkpoints asked and not made: [3]"),
        ("warning", "rank_lost", "rank 1 lost: killed by signal 9"),
        ("warning", "dropped_frames", "2 frame(s) dropped: route_mismatch"),
        ("warning", "journal_lag", "journal not durable for 9.0s"),
        ("info", "dropped_frames", "1 frame(s) dropped: hello_deferred"),
    ]
