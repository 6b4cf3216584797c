"""Bus data plane: bytes on the coordinator's link and time per averaging round.

The rig, all on loopback in one invocation: 4 ranks on 2 hosts (2 ranks per host), each
host a real relay process (``flodl-worker relay``, ipc frontend, tcp uplink), and a
coordinator whose bus half is the real one (``BusReducer`` + ``FoldPlan`` + the wire
codec) in a minimal loop in this process -- the core's scheduling is not what is
measured here. Ranks are light processes that only speak the round protocol: on
``RequestParams`` they send their (pre-scaled, pre-packed) parameters, on the
consensus they decode it and answer ``sync_ack``. A round is timed from the
coordinator opening it (FoldOpen + RequestParams) to the last ack.

Four configurations: folding on/off x f32/bf16 on the wire; bytes counted on every
frame the coordinator's ROUTER receives (up) and sends (down). With folding the relay
also fans the consensus out (one copy per host, forwarded to its ranks), so both
directions carry one model per host instead of one per rank. The peer in the same
run: ``torch.distributed.all_reduce`` (gloo, 4 processes) of the same tensors, f32.
Also the control-plane cost of the relay being a Python loop instead of libzmq's C
proxy: the round-trip of a small frame through each (and through a relay whose fold
is open and waits for that rank, the case where envelopes are parsed).

Prints one JSON object (medians over ``--rounds`` rounds after one warm-up).
"""

from __future__ import annotations

import argparse
import json
import os
import select
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
import zmq

from flodl.wire import Endpoint, decode, pack_round, pb, split_routing, unpack_round

SESSION = "bench-planes"
RANKS, HOSTS = 4, 2
HERE = os.path.abspath(__file__)


def shapes_for(n: int) -> list[tuple[int, ...]]:
    """A layer-like split of ``n`` parameters: matrices and their biases."""
    out, left, width = [], n, 1024
    while left > 0:
        rows = max(1, min(left // (width + 1), 2048))
        if left < width + 1:
            out.append((left,))
            break
        out += [(rows, width), (rows,)]
        left -= rows * (width + 1)
    return out


# -- a rank (child process) ----------------------------------------------------------------


def rank_main(rank: int, relay: str, n: int, bf16: bool) -> None:
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.IDENTITY, f"rank-{rank}".encode())
    s.setsockopt(zmq.LINGER, 0)
    s.connect(relay)
    me = Endpoint(SESSION, pb.Sender.KIND_RANK, rank=rank, incarnation=rank + 1)
    rng = np.random.default_rng(rank)
    w = 1.0 + rank
    params = [rng.standard_normal(sh).astype(np.float32) * np.float32(w) for sh in shapes_for(n)]
    header, blobs = pack_round(params, cycle=0, weight=w, bf16=bf16)  # packed once: cycle patched per round
    s.send_multipart(me.frames("timing", pb.Timing(rank=rank, heartbeat=pb.Timing.Heartbeat())))
    while True:
        d = decode(split_routing(s.recv_multipart(copy=False))[1], session=SESSION)
        if d.kind == "control":
            c = d.envelope.control
            if c.WhichOneof("cmd") == "shutdown":
                break
            header.cycle = c.request_params.cycle
            s.send_multipart(me.frames("round", header, blobs), copy=False)
        elif d.kind == "round":
            unpack_round(d.envelope.round, d.blobs)  # what a rank must do before applying it
            ack = pb.Timing.SyncAck(cycle=d.envelope.round.cycle)
            s.send_multipart(me.frames("timing", pb.Timing(rank=rank, sync_ack=ack)))
    s.close(0)
    ctx.term()


# -- the rig -------------------------------------------------------------------------------


def _ready(proc, prefix: str, timeout: float = 30.0) -> str:
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    line = proc.stdout.readline().decode() if ready else ""
    if not line.startswith(prefix):
        proc.kill()
        raise SystemExit(f"child did not report {prefix}: {line!r}")
    return line.split()[1]


class Rig:
    def __init__(self, tmp: str, n: int, fold: bool, bf16: bool):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind("tcp://127.0.0.1:0")
        ep = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.me = Endpoint(SESSION, pb.Sender.KIND_COORDINATOR, host="bench")
        self.procs = []
        relays = []
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
        for h in range(HOSTS):
            argv = [sys.executable, "-m", "flodl_worker", "--log-level", "WARNING", "relay", "--coordinator", ep,
                    "--bind", f"ipc://{tmp}/relay{h}-{int(fold)}{int(bf16)}.sock", "--host", f"h{h}"]  # fmt: skip
            p = subprocess.Popen(argv + ([] if fold else ["--no-fold"]), stdout=subprocess.PIPE, env=env)
            self.procs.append(p)
            relays.append(_ready(p, "RELAY_READY"))
        for r in range(RANKS):
            argv = [sys.executable, HERE, "--_rank", str(r), "--_relay", relays[r * HOSTS // RANKS],
                    "--params", str(n)] + (["--bf16"] if bf16 else [])  # fmt: skip
            self.procs.append(subprocess.Popen(argv, env=env))
        from flodl_coordinator.reducer import BusReducer

        self.reducer = BusReducer(bf16_wire=bf16)
        self.routes: dict[int, tuple] = {}
        while len(self.routes) < RANKS:  # each rank's first frame says where it is
            route, d = self._recv(30.0)
            self.routes[d.envelope.sender.rank] = route
        self.cmd = 0

    def _recv(self, timeout: float):
        if not self.sock.poll(int(timeout * 1000)):
            raise SystemExit("bench: the rig went silent")
        frames = self.sock.recv_multipart(copy=False)
        self.bytes_up += sum(len(f) for f in frames)
        route, payload = split_routing(frames)
        return route, decode(payload, session=SESSION)

    def _send(self, frames) -> None:
        self.bytes_down += sum(memoryview(f).nbytes if not isinstance(f, bytes) else len(f) for f in frames)
        self.sock.send_multipart(frames, copy=False)

    bytes_up = bytes_down = 0

    def round(self, cycle: int) -> tuple[float, int, int]:
        self.bytes_up = self.bytes_down = 0
        ranks = list(range(RANKS))
        t0 = time.perf_counter()
        for relay, msg in self.reducer.folds.open(cycle, ranks, self.routes.get):
            self._send(self.me.frames("relay", msg, route=relay))
        self.reducer.open(cycle, ranks)
        for r in ranks:
            self.cmd += 1
            ctl = pb.Control(command_id=self.cmd, request_params=pb.Control.RequestParams(cycle=cycle))
            self._send(self.me.frames("control", ctl, route=self.routes[r]))
        acks = 0
        while acks < RANKS:
            route, d = self._recv(60.0)
            if d.kind == "round":
                if d.envelope.sender.kind == pb.Sender.KIND_RELAY:
                    res = self.reducer.contribute_folded(route, d.envelope.round, d.blobs)
                else:
                    res = self.reducer.contribute(d.envelope.sender.rank, d.envelope.round, d.blobs)
                if res is not None:  # as the service sends it: one copy per folding relay (fan-out)
                    for relay, fanned in res.fanout:
                        self._send(self.me.frames("round", res.relay_header(fanned), res.blobs, route=relay))
                    for r in res.direct:
                        self._send(self.me.frames("round", res.header, res.blobs, route=self.routes[r]))
            elif d.kind == "timing" and d.envelope.timing.WhichOneof("event") == "sync_ack":
                acks += 1
        return time.perf_counter() - t0, self.bytes_up, self.bytes_down

    def close(self) -> None:
        for r in range(RANKS):
            self.cmd += 1
            ctl = pb.Control(command_id=self.cmd, shutdown=pb.Control.Shutdown(reason="bench over"))
            self._send(self.me.frames("control", ctl, route=self.routes[r]))
        for p in self.procs[HOSTS:]:
            p.wait(30)
        for p in self.procs[:HOSTS]:
            p.terminate()
            p.wait(30)
        self.sock.close(0)
        self.ctx.term()


def bus(tmp: str, n: int, rounds: int, fold: bool, bf16: bool) -> dict:
    rig = Rig(tmp, n, fold, bf16)
    try:
        samples = [rig.round(c) for c in range(1, rounds + 2)][1:]  # round 1 warms up
    finally:
        rig.close()
    ms = [s[0] * 1000 for s in samples]
    return {
        "fold": fold,
        "bf16": bf16,
        "round_ms_median": round(statistics.median(ms), 1),
        "round_ms_min": round(min(ms), 1),
        "bytes_up_per_round": int(statistics.median(s[1] for s in samples)),
        "bytes_down_per_round": int(statistics.median(s[2] for s in samples)),
        "folded_frames": rig.reducer.folded_in,
    }


# -- the peer: gloo all_reduce -------------------------------------------------------------


def _gloo_worker(rank: int, port: int, n: int, rounds: int, q) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=RANKS)
    g = torch.Generator().manual_seed(rank)
    ts = [torch.randn(sh, generator=g) for sh in shapes_for(n)]
    out = []
    for _ in range(rounds + 1):
        dist.barrier()
        t0 = time.perf_counter()
        for t in ts:
            dist.all_reduce(t)
        for t in ts:
            t.div_(RANKS)
        out.append(time.perf_counter() - t0)
    if rank == 0:
        q.put(out[1:])
    dist.destroy_process_group()


def gloo(n: int, rounds: int) -> dict:
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mpc = mp.get_context("spawn")
    q = mpc.Queue()
    procs = [mpc.Process(target=_gloo_worker, args=(r, port, n, rounds, q)) for r in range(RANKS)]
    for p in procs:
        p.start()
    times = q.get(timeout=300)
    for p in procs:
        p.join(60)
    ms = [t * 1000 for t in times]
    per_proc = int(2 * (RANKS - 1) / RANKS * n * 4)
    return {
        "round_ms_median": round(statistics.median(ms), 1),
        "round_ms_min": round(min(ms), 1),
        "ring_bytes_sent_per_process": per_proc,  # 2(N-1)/N x size: every link, no single hub
    }


# -- control-plane cost of the Python relay -------------------------------------------------

ECHO = r"""
import sys, zmq
from flodl.wire import Endpoint, pb
ctx = zmq.Context(); s = ctx.socket(zmq.ROUTER); s.bind("tcp://127.0.0.1:0")
me = Endpoint("bench-planes", pb.Sender.KIND_COORDINATOR, host="echo")
print("READY", s.getsockopt(zmq.LAST_ENDPOINT).decode(), flush=True)
while True:
    f = s.recv_multipart()
    if f[-1] == b"stop": break
    if f[-1] == b"fold":  # open a fold awaiting this rank: the relay parses its frames from now on
        fo = pb.RelayMsg.FoldOpen(cycle=1, ranks=[0], identities=[f[1]])
        s.send_multipart(me.frames("relay", pb.RelayMsg(fold_open=fo), route=[f[0]]))
    s.send_multipart(f)
"""
C_PROXY = r"""
import sys, zmq
ctx = zmq.Context(); f = ctx.socket(zmq.ROUTER); b = ctx.socket(zmq.DEALER)
f.bind(sys.argv[2]); b.connect(sys.argv[1])
print("RELAY_READY", f.getsockopt(zmq.LAST_ENDPOINT).decode(), flush=True)
zmq.proxy(f, b)
"""


def control_rtt(tmp: str, n: int) -> dict:
    echo = subprocess.Popen([sys.executable, "-c", ECHO], stdout=subprocess.PIPE)
    ep = _ready(echo, "READY")
    ctx = zmq.Context()
    me = Endpoint(SESSION, pb.Sender.KIND_RANK, rank=0)
    msg = me.frames("timing", pb.Timing(rank=0, batch=pb.Timing.Batch(batch_ms=1.0)))
    out = {}
    try:
        for name, argv in (
            ("c_proxy", [sys.executable, "-c", C_PROXY, ep, f"ipc://{tmp}/cp.sock"]),
            ("python_relay", [sys.executable, "-m", "flodl_worker", "relay", "--coordinator", ep,
                              "--bind", f"ipc://{tmp}/pr.sock", "--host", "rtt"]),
        ):  # fmt: skip
            p = subprocess.Popen(argv, stdout=subprocess.PIPE)
            try:
                d = ctx.socket(zmq.DEALER)
                d.setsockopt(zmq.IDENTITY, b"rank-0")
                d.connect(_ready(p, "RELAY_READY"))
                modes = [("", False)] + ([("_fold_open", True)] if name == "python_relay" else [])
                for suffix, fold_open in modes:
                    if fold_open:  # FoldOpen rides ahead of the echo on the same pipe
                        d.send_multipart([b"", b"fold"])
                        d.recv_multipart()
                    xs = []
                    for i in range(n + 50):
                        t0 = time.perf_counter()
                        d.send_multipart(msg)
                        d.recv_multipart()
                        xs.append((time.perf_counter() - t0) * 1e6)
                    out[name + suffix + "_us"] = round(statistics.median(xs[50:]), 1)
                d.close(0)
            finally:
                p.terminate()
                p.wait(10)
    finally:
        s = ctx.socket(zmq.DEALER)
        s.connect(ep)
        s.send_multipart([b"", b"stop"])
        echo.wait(10)
        s.close(0)
        ctx.term()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--params", type=int, default=10_000_000, help="model parameters (default 10M)")
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds per configuration (default 5)")
    ap.add_argument("--rtt", type=int, default=1000, help="control round trips per relay kind (default 1000)")
    ap.add_argument("--bf16", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--_rank", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--_relay", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._rank is not None:
        return rank_main(args._rank, args._relay, args.params, args.bf16)
    t0, load0 = time.perf_counter(), os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="flodl-bench-") as tmp:
        configs = [bus(tmp, args.params, args.rounds, fold, bf16) for bf16 in (False, True) for fold in (False, True)]
        rtt = control_rtt(tmp, args.rtt)
    peer = gloo(args.params, args.rounds)
    base = next(c for c in configs if not c["fold"] and not c["bf16"])
    for c in configs:
        c["up_bytes_vs_unfolded_f32"] = round(c["bytes_up_per_round"] / base["bytes_up_per_round"], 3)
        c["down_bytes_vs_unfolded_f32"] = round(c["bytes_down_per_round"] / base["bytes_down_per_round"], 3)
        c["time_vs_unfolded_f32"] = round(c["round_ms_median"] / base["round_ms_median"], 2)
        c["time_vs_gloo_allreduce"] = round(c["round_ms_median"] / peer["round_ms_median"], 2)
    res = {
        "bench": "planes",
        "params": args.params,
        "model_bytes_f32": args.params * 4,
        "ranks": RANKS,
        "hosts": HOSTS,
        "rounds": args.rounds,
        "cpus": os.cpu_count(),
        "load_avg_1m": [round(load0, 2), round(os.getloadavg()[0], 2)],  # start, end: noisy box = noisy times
        "bus": configs,
        "gloo_allreduce_peer": peer,
        "relay_control_rtt_us": rtt,
        "wall_s": round(time.perf_counter() - t0, 1),
    }
    if rtt.get("c_proxy_us"):
        res["relay_control_rtt_ratio_python_vs_c"] = round(rtt["python_relay_us"] / rtt["c_proxy_us"], 2)
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
