"""Control-plane round trip: a Batch in -> the coordinator's decision out.

Runs, in the same invocation, a real ``flodl-coordinator serve`` process (world of 1,
Sync policy: every Batch makes the coordinator fire an averaging round, so its answer
to a Batch is ``RequestParams``) and a raw pyzmq ROUTER echo process as the peer
baseline. A DEALER in this process plays the rank. We time only the Batch ->
RequestParams leg (decode, sequence/route checks, journal off, ``step``, encode,
send), then complete the round untimed so the next Batch starts from the same state.

Prints one JSON object: medians and p99 in microseconds, and their ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np
import zmq

from flodl.wire import Endpoint, decode, pack_round, pb, split_routing

SESSION = "bench"


def _spawn(cmd):
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    line = p.stdout.readline().split()
    if len(line) < 2:
        p.kill()
        raise SystemExit(f"{cmd[2]} did not start")
    return p, line[1]


ECHO = r"""
import sys, zmq
ctx = zmq.Context(); s = ctx.socket(zmq.ROUTER); s.bind("tcp://127.0.0.1:0")
print("READY", s.getsockopt(zmq.LAST_ENDPOINT).decode(), flush=True)
while True:
    f = s.recv_multipart()
    if f[-1] == b"stop": break
    s.send_multipart(f)
"""


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def bench_raw(n: int) -> list[float]:
    p, ep = _spawn([sys.executable, "-c", ECHO])
    ctx = zmq.Context.instance()
    d = ctx.socket(zmq.DEALER)
    d.connect(ep)
    msg = Endpoint(SESSION, pb.Sender.KIND_RANK, rank=0).frames("timing", pb.Timing(rank=0, batch=pb.Timing.Batch()))
    out = []
    for _ in range(n):
        t = time.perf_counter()
        d.send_multipart(msg)
        d.recv_multipart()
        out.append((time.perf_counter() - t) * 1e6)
    d.send_multipart([b"", b"stop"])
    p.wait(timeout=10)
    d.close(0)
    return out


def bench_flodl(n: int) -> list[float]:
    cmd = [
        sys.executable, "-m", "flodl_coordinator", "serve", "--bind", "tcp://127.0.0.1:0",
        "--session", SESSION, "--world-size", "1", "--batch-size", "1", "--epochs", "1",
        "--policy", "sync", "--total-samples", str(n + 10), "--log-level", "WARNING", "--liveness-timeout-s", "1",
    ]  # fmt: skip
    p, ep = _spawn(cmd)
    ctx = zmq.Context.instance()
    d = ctx.socket(zmq.DEALER)
    d.connect(ep)
    me = Endpoint(SESSION, pb.Sender.KIND_RANK, rank=0, incarnation=int.from_bytes(os.urandom(4), "little"))

    def recv():
        route, payload = split_routing(d.recv_multipart())
        return decode(payload, session=SESSION)

    def recv_until(kind, cmd=None):
        while True:
            m = recv()
            if m.kind == kind and (cmd is None or m.envelope.control.WhichOneof("cmd") == cmd):
                return m

    d.send_multipart(me.frames("hello", pb.RankHello(rank=0, world_size=1, model_sig=b"m" * 32, dataset_len=n + 10)))
    ack = recv_until("hello_ack").envelope.hello_ack
    assert ack.accepted, ack.reason
    plan = recv_until("control", "start_epoch").envelope.control.start_epoch.plan
    params = [np.ones(16, np.float32)]
    out = []
    for i in range(n):
        b = pb.Timing(rank=0, batch=pb.Timing.Batch(batch_ms=1.0, step_count=i + 1, samples=1,
                                                    epoch=plan.epoch, offset=plan.partition_offset + i))
        frames = me.frames("timing", b)
        t = time.perf_counter()
        d.send_multipart(frames)
        rp = recv_until("control", "request_params").envelope.control.request_params
        out.append((time.perf_counter() - t) * 1e6)
        h, blobs = pack_round(params, cycle=rp.cycle, weight=1.0)
        d.send_multipart(me.frames("round", h, blobs))
        recv_until("round")
        d.send_multipart(me.frames("timing", pb.Timing(rank=0, sync_ack=pb.Timing.SyncAck(cycle=rp.cycle, step_count=i + 1))))
        recv_until("control", "update")
    p.terminate()
    p.wait(timeout=20)
    d.close(0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-n", type=int, default=2000, help="round trips per side")
    args = ap.parse_args()
    raw = bench_raw(args.n)
    fl = bench_flodl(args.n)
    res = {
        "bench": "control_rtt",
        "n": args.n,
        "raw_pyzmq_us": {"median": round(statistics.median(raw), 1), "p99": round(pct(raw, 0.99), 1)},
        "flodl_batch_to_decision_us": {"median": round(statistics.median(fl), 1), "p99": round(pct(fl, 0.99), 1)},
    }
    res["ratio_median"] = round(res["flodl_batch_to_decision_us"]["median"] / res["raw_pyzmq_us"]["median"], 2)
    res["ratio_p99"] = round(res["flodl_batch_to_decision_us"]["p99"] / res["raw_pyzmq_us"]["p99"], 2)
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
