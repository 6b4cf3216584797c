"""bench/service_replay.py replays a recorded input through the service: the same bytes
out every time, and what it says it received is what was recorded."""

from __future__ import annotations

import pathlib
import pickle
import sys

from flodl.wire import Endpoint, pb

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[3] / "bench"))
import service_replay  # noqa: E402

ARGV = ["serve", "--bind", "tcp://127.0.0.1:0", "--session", "rp", "--world-size", "2", "--batch-size", "1",
        "--epochs", "1", "--total-samples", "8", "--log-level", "WARNING", "--no-final-eval"]  # fmt: skip


def _hello(rank: int) -> list[bytes]:
    ep = Endpoint("rp", pb.Sender.KIND_RANK, rank=rank, incarnation=10 + rank)
    body = pb.RankHello(rank=rank, world_size=2, model_sig=b"m" * 32, dataset_len=8)
    return [b"id-%d" % rank, *ep.frames("hello", body)]


def test_a_recording_replays_to_the_same_bytes_every_time(tmp_path):
    log = [("d",), ("m", 1.0, _hello(0)), ("m", 1.1, [b"id-9", b"no delimiter"]), ("t", 1.2),
           ("d",), ("m", 1.3, _hello(1)), ("t", 1.4)]  # fmt: skip
    path = tmp_path / "rec.pkl"
    path.write_bytes(pickle.dumps({"argv": ARGV, "log": log}))
    out = service_replay.replay(str(path), 2)
    assert out["frames_in"] == 3 and out["same_every_time"]
    assert out["frames_out"] >= 2  # each hello is answered (then the world forms: its plans)
    assert 0 < out["core_share"] < 1


def test_the_plan_keeps_passes_and_ticks_in_order():
    log = [("d",), ("m", 1.0, [b"a"]), ("m", 2.0, [b"b"]), ("t", 3.0), ("d",), ("d",), ("m", 4.0, [b"c"])]
    plan = service_replay._plan(log)
    # Each drain's messages are popped from the end: last first.
    assert plan == [("d", [(2.0, [b"b"]), (1.0, [b"a"])]), ("t", 3.0), ("d", []), ("d", [(4.0, [b"c"])])]
