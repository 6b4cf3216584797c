"""The rank's protocol cost per batch: what a rank process spends on flodl between steps.

Per batch a real rank (``flodl_worker.rank._Rank.run``) polls its socket for control
frames (``_pump(0)``), checks its heartbeat, asks the machine for the next batch, feeds
``BatchTrained`` and executes what comes back: encoding and sending its batch reports.
This runs exactly that loop with the real parts -- ``flodl.rank.RankMachine``,
``flodl.wire.Endpoint`` framing, a real DEALER socket to a ROUTER that drains it in
another process -- minus the training step, and reports CPU microseconds per batch
(medians of ``--repeats``), for each ``--report-ms`` (the coordinator's
``batch_report_ms``: 0 = a frame per batch, as before coalescing), at each claimed batch
time ``--batch-ms`` (how fast the ranks' steps are: the coalescing depends on it).

The peer in the same run, ``raw_zmq_us``: the same DEALER sending one pre-encoded frame of
the same size per batch and polling, nothing else -- the transport's floor. Prints one
JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import zmq

from flodl.rank import WAIT_PLAN, Admitted, BatchTrained, ControlReceived, IncarnationSeen, RankMachine, SendTiming
from flodl.wire import Endpoint, pb

SINK = r"""
import sys, zmq
ctx = zmq.Context(); s = ctx.socket(zmq.ROUTER); s.setsockopt(zmq.RCVHWM, 0)
s.bind("tcp://127.0.0.1:0"); print(s.getsockopt(zmq.LAST_ENDPOINT).decode(), flush=True)
while True:
    if s.recv_multipart()[-1] == b"stop":
        break
"""


def _machine(report_ms: float, batches: int) -> RankMachine:
    m = RankMachine(0)
    m.handle(IncarnationSeen(incarnation=1, hello_ack=True))
    m.handle(Admitted(spec=pb.RunSpec(total_samples=batches, batch_size=1, gamma=1.0, policy=pb.POLICY_CADENCE,
                                      batch_report_ms=report_ms)))  # fmt: skip
    plan = pb.EpochPlan(epoch=0, partition_offset=0, partition_size=batches)
    m.handle(ControlReceived(control=pb.Control(start_epoch=pb.Control.StartEpoch(plan=plan))))
    return m


def flodl_loop(sock, report_ms: float, batch_ms: float, batches: int) -> tuple[float, int]:
    """CPU us per batch of the rank's protocol loop, and the frames it sent."""
    m, ep = _machine(report_ms, batches), Endpoint("bench", pb.Sender.KIND_RANK, rank=0, incarnation=7)
    sent = 0
    t0 = time.process_time()
    for _ in range(batches):
        sock.poll(0, zmq.POLLIN)  # _pump(0): control frames between steps
        time.monotonic()  # _heartbeat_if_due
        act = m.next_action(time.perf_counter())
        if act is WAIT_PLAN:
            break
        for c in m.handle(BatchTrained(epoch=act.epoch, offset=act.offset, samples=act.count, batch_ms=batch_ms,
                                       data_ms=0.1, loss=0.5, lr=0.01)):  # fmt: skip
            if type(c) is SendTiming:
                sock.send_multipart(ep.frames("timing", pb.Timing(rank=0, **{c.kind: c.body})))
                sent += 1
    return (time.process_time() - t0) / batches * 1e6, sent


def raw_loop(sock, batches: int) -> float:
    ep = Endpoint("bench", pb.Sender.KIND_RANK, rank=0, incarnation=7)
    frame = ep.frames("timing", pb.Timing(rank=0, batch=pb.Timing.Batch(batch_ms=2.0, step_count=1, samples=1)))
    t0 = time.process_time()
    for _ in range(batches):
        sock.poll(0, zmq.POLLIN)
        sock.send_multipart(frame)
    return (time.process_time() - t0) / batches * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--report-ms", default="0,25", help="batch_report_ms values, comma-separated")
    ap.add_argument("--batch-ms", default="2,10,50", help="claimed batch times, comma-separated")
    ap.add_argument("--batches", type=int, default=20000)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    sink = subprocess.Popen([sys.executable, "-c", SINK], stdout=subprocess.PIPE, text=True)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.connect(sink.stdout.readline().strip())
    res: dict = {"bench": "rank_overhead", "batches": args.batches, "repeats": args.repeats, "rows": []}
    try:
        raw = [raw_loop(sock, args.batches) for _ in range(args.repeats)]
        res["raw_zmq_us"] = round(statistics.median(raw), 2)
        for batch_ms in (float(x) for x in args.batch_ms.split(",")):
            for report_ms in (float(x) for x in args.report_ms.split(",")):
                runs = [flodl_loop(sock, report_ms, batch_ms, args.batches) for _ in range(args.repeats)]
                us = statistics.median(r[0] for r in runs)
                res["rows"].append({
                    "batch_ms": batch_ms, "report_ms": report_ms, "us_per_batch": round(us, 2),
                    "frames_per_batch": round(runs[0][1] / args.batches, 3),
                    "share_of_a_batch": round(us / (batch_ms * 1000), 4), "vs_raw": round(us / res["raw_zmq_us"], 2),
                })  # fmt: skip
    finally:
        sock.send_multipart([b"stop"])
        sink.wait(10)
        sock.close(0)
        ctx.term()
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
