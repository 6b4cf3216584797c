"""A live run keeps serving its ranks while a rogue peer throws bad frames at it."""

import json
import os
import subprocess
import sys

import pytest
import zmq

from flodl.wire import PROTOCOL_MAJOR, Endpoint, pb, split_routing
from runlocal import ROOT, free_port

pytestmark = pytest.mark.integration


def _rogue_frames(session_guess: str) -> list[list[bytes]]:
    bogus = Endpoint("not-this-run", pb.Sender.KIND_RANK, rank=1, incarnation=5)
    liar = Endpoint(session_guess, pb.Sender.KIND_RANK, rank=1, incarnation=6)
    batch = pb.Timing(rank=1, batch=pb.Timing.Batch(batch_ms=1, step_count=99, samples=4))
    return [
        [os.urandom(40)],  # no delimiter at all
        [b"", b"\xff\x00garbage"],  # an envelope that does not parse
        bogus.frames("timing", batch),  # another session
        [b"", b"\x08\x01"],  # protocol major 1 but no body, no sender
        liar.frames("timing", batch),  # a rank the rogue's route does not own
    ]


def test_rogue_frames_are_dropped_and_counted_while_the_run_completes(tmp_path):
    port = free_port()
    summary = tmp_path / "summary.json"
    cmd = [
        sys.executable, "-m", "flodl", "run", "--local", "--ranks", "2", "--task", "digits",
        "--slowdown", "1,2", "--base-ms", "3", "--epochs", "2", "--port", str(port),
        "--summary", str(summary),
    ]  # fmt: skip
    run = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    ctx = zmq.Context()
    rogue = ctx.socket(zmq.DEALER)
    rogue.setsockopt(zmq.LINGER, 0)
    rogue.connect(f"tcp://127.0.0.1:{port}")
    # The session is random per local run; a rogue cannot know it, so all of its
    # well-formed frames are "wrong session". Send a wrong-version hello too: it gets
    # a refusal naming the version before being dropped.
    old = pb.Envelope(protocol_major=PROTOCOL_MAJOR + 1, session="x", seq=1)
    old.sender.kind = pb.Sender.KIND_RANK
    old.hello.CopyFrom(pb.RankHello(rank=0, world_size=2))
    try:
        rogue.send_multipart([b"", old.SerializeToString()])
        assert rogue.poll(60_000), "no answer to a wrong-version hello"
        route, payload = split_routing(rogue.recv_multipart())
        env = pb.Envelope()
        env.ParseFromString(payload[0])
        assert env.hello_ack.accepted is False
        assert "protocol version mismatch" in env.hello_ack.reason
        for frames in _rogue_frames("x") * 20:
            rogue.send_multipart(frames)
        out, _ = run.communicate(timeout=240)
    finally:
        rogue.close(0)
        ctx.term()
        if run.poll() is None:
            run.kill()
    assert run.returncode == 0, out[-3000:]
    data = json.loads(summary.read_text())
    for c in data["coverage"]:
        assert (c["duplicates"], c["missing"]) == (0, 0)
    dropped = data["dropped_frames"]
    assert dropped.get("malformed", 0) >= 40, dropped
    assert dropped.get("wrong_session", 0) >= 40, dropped
    assert dropped.get("version_mismatch", 0) == 1, dropped
