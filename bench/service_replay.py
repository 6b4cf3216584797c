"""The coordinator service's own CPU per frame, replayed: recorded once, timed without noise.

``control_scale.py`` measures a live coordinator beside its fake ranks on one machine, so
its CPU per frame moves with whatever else runs (and with the cache a woken process finds).
This bench takes the service path alone:

1. **record**: one saturated ``control_scale`` run per N (real fake ranks, real sockets),
   its coordinator recording every message it drains, pass by pass, with the time it
   arrived, and every tick it fed;
2. **replay**: the same messages into a fresh ``CoordinatorService`` of the same settings,
   pass by pass, through a socket stand-in (receives what was recorded, swallows what is
   sent) and a clock that reads each message's recorded arrival: the same input, so the
   same decisions, every time. Timed in CPU time (``time.thread_time``), medians of
   ``--repeats`` replays: ``us_per_frame`` (frames in and out, as ``control_scale``
   counts them) and ``core_share`` (the part of it in ``flodl.core``: ``step`` and the
   Timing -> event translation; from one more replay, timed around those calls).

``sent_digest`` hashes every frame the service sent, ``summary_digest`` the run summary's
outcome and ``timeline_digest`` the dashboard's timeline: ``--peer PATH`` replays the same
recording through another checkout in a subprocess (``/work/wt/base``: the code before),
in turn with ours, and reports its row, ``peer_over_ours`` and ``same_output`` -- a change
that only makes the service cheaper sends the same bytes for the same bytes received.

    python bench/service_replay.py                        # N = 16, 256
    python bench/service_replay.py --peer /work/wt/base   # ... and the code before, side by side
    python bench/service_replay.py --ranks 16 --batches 6000 --repeats 1   # a smoke run

Prints one JSON object. The socket stand-in's own receive costs a little more than
pyzmq's, and the replay has no poll wake-ups: compare replays with replays.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import pickle
import statistics
import subprocess
import sys
import tempfile
import time

from benchproc import peer_env

HERE = os.path.dirname(os.path.abspath(__file__))


# -- record (the coordinator process of one control_scale run) ------------------------


def serve_recording(out: str, argv: list[str]) -> int:
    """``flodl-coordinator`` with ``argv``, writing what it drained and when it ticked to ``out``."""
    from flodl.core import Tick
    from flodl_coordinator import cli
    from flodl_coordinator import service as S

    log: list = []

    class Tap:
        """The ROUTER, seen by one drain: what it receives is written down, whole messages."""

        def __init__(self, sock):
            import zmq

            self._sock, self._parts, self._more = sock, [], int(zmq.RCVMORE)

        def __getattr__(self, name):
            return getattr(self._sock, name)

        def _took(self, part):
            self._parts.append(bytes(part))
            if not self._sock.getsockopt(self._more):  # the message is whole
                log.append(("m", time.monotonic(), self._parts))
                self._parts = []

        def recv(self, *a, **kw):
            part = self._sock.recv(*a, **kw)
            self._took(part)
            return part

        def recv_multipart(self, *a, **kw):
            parts = self._sock.recv_multipart(*a, **kw)
            log.append(("m", time.monotonic(), [bytes(p) for p in parts]))
            return parts

    drain, feed = S.CoordinatorService._drain_socket, S.CoordinatorService._feed

    def tapped_drain(self):
        log.append(("d",))
        sock, self.sock = self.sock, Tap(self.sock)
        try:
            return drain(self)
        finally:
            self.sock = sock

    def tapped_feed(self, ev):
        if type(ev) is Tick and self._outbox is None:
            log.append(("t", ev.now))
        return feed(self, ev)

    S.CoordinatorService._drain_socket, S.CoordinatorService._feed = tapped_drain, tapped_feed
    try:
        return cli.main(argv)
    finally:
        with open(out, "wb") as fh:
            pickle.dump({"argv": argv, "log": log}, fh)


def record(n: int, batches: int, out: str) -> dict:
    sys.path.insert(0, HERE)
    import control_scale as cs

    spawn = cs._spawn_ready

    def recording(cmd, prefix, stderr=None):
        if prefix == "COORDINATOR_READY":  # [python, -m, flodl_coordinator, serve, ...]
            i = cmd.index("-m")
            cmd = [*cmd[:i], os.path.abspath(__file__), "--serve-recording", out, "--", *cmd[i + 2 :]]
        return spawn(cmd, prefix, stderr)

    cs._spawn_ready = recording
    try:
        r = cs.run_flodl(n, [0.0], gens=max(1, (n + 255) // 256), hosts=0, epochs=1, policy="cadence",
                         batches_per_rank=max(20, batches // n), timeout_s=120.0 + n * 0.2)  # fmt: skip
    finally:
        cs._spawn_ready = spawn
    return {"ok": r["ok"], "live_cpu_us_per_frame": round(r["cpu_us_per_frame"], 2)}


# -- replay ------------------------------------------------------------------------------


class _Clock:
    t = 0.0

    def __call__(self) -> float:
        return self.t


class _Socket:
    """Receives the recorded messages of one pass (then ``zmq.Again``); hashes what is sent."""

    def __init__(self, clock: _Clock):
        import zmq

        self._again, self._rcvmore, self._sndmore = zmq.Again, int(zmq.RCVMORE), int(zmq.SNDMORE)
        self.clock, self.queue, self.cur, self.sent = clock, [], [], 0
        self.digest = hashlib.sha256()

    def recv(self, flags=0, copy=True, track=False):
        if not self.cur:
            if not self.queue:
                raise self._again()
            t, parts = self.queue.pop()
            self.clock.t = t
            self.cur = parts[::-1]
        part = self.cur.pop()
        if copy:
            return part
        import zmq

        return zmq.Frame(part)

    def recv_multipart(self, flags=0, copy=True, track=False):
        out = [self.recv(flags, copy)]
        while self.cur:
            out.append(self.recv(flags, copy))
        return out

    def getsockopt(self, opt):
        if opt == self._rcvmore:
            return 1 if self.cur else 0
        raise NotImplementedError(opt)

    get = getsockopt

    def _out(self, part) -> None:
        b = bytes(part)
        self.digest.update(len(b).to_bytes(8, "little"))
        self.digest.update(b)

    def send_multipart(self, frames, flags=0, copy=True, track=False):
        for p in frames:
            self._out(p)
        self.digest.update(b"|")
        self.sent += 1

    def send(self, data, flags=0, copy=True, track=False):
        self._out(data)
        if not flags & self._sndmore:
            self.digest.update(b"|")
            self.sent += 1


def _plan(log: list) -> list:
    """The recording as passes: ("t", now) ticks and ("d", [messages, last first]) drains."""
    plan, i = [], 0
    while i < len(log):
        if log[i][0] == "t":
            plan.append(("t", log[i][1]))
            i += 1
            continue
        msgs, i = [], i + 1
        while i < len(log) and log[i][0] == "m":
            msgs.append((log[i][1], log[i][2]))
            i += 1
        plan.append(("d", msgs[::-1]))
    return plan


def replay_once(rec: dict, time_core: bool = False) -> dict:
    from flodl.core import Tick
    from flodl.wire import Endpoint, pb
    from flodl_coordinator import cli
    from flodl_coordinator import service as S
    from flodl_coordinator.settings import SCHEMA, load_settings

    core_ns = [0]

    def timed(fn):
        def run(*a):
            t = time.thread_time_ns()
            try:
                return fn(*a)
            finally:
                core_ns[0] += time.thread_time_ns() - t

        return run

    step, translate = S.step, S.timing_event
    if time_core:  # (a wrapper's own cost: only in the replay that measures the share)
        S.step, S.timing_event = timed(step), timed(translate)
    tmp = tempfile.mkdtemp(prefix="flodl-replay-")
    try:
        args = cli._parser().parse_args(rec["argv"])
        flags = {k: getattr(args, k) for k in SCHEMA}
        flags["summary"] = os.path.join(tmp, "summary.json")
        settings = load_settings(env={}, flags=flags)
        clock = _Clock()
        svc = S.CoordinatorService(settings, clock=clock)
        svc.sock = _Socket(clock)
        # A fixed incarnation: two replays (two checkouts) send comparable bytes.
        svc.endpoint = Endpoint(settings.session, pb.Sender.KIND_COORDINATOR, host="replay", incarnation=12345)
        plan = _plan(rec["log"])
        received = sum(len(x) for kind, x in plan if kind == "d")
        t0 = time.thread_time()
        for kind, x in plan:
            if svc.finished is not None:
                break
            if kind == "t":
                clock.t = x
                svc._feed(Tick(now=x))
                svc._publish_status()
            else:
                svc.sock.queue = list(x)
                svc._drain_socket()
        cpu = time.thread_time() - t0
        rc = svc._finish()
        try:
            with open(flags["summary"]) as fh:
                summ = json.load(fh)
        except FileNotFoundError:  # (a recording that ends before the run does: no summary)
            summ = {}
    finally:
        S.step, S.timing_event = step, translate
    frames = received + svc.sock.sent
    outcome = {k: summ.get(k) for k in ("ok", "reason", "dropped_frames", "coverage", "bus")}
    return {
        "frames_in": received,
        "frames_out": svc.sock.sent,
        "us_per_frame": 1e6 * cpu / max(1, frames),
        "core_share": core_ns[0] / 1e9 / cpu if time_core and cpu > 0 else None,
        "exit_code": rc,
        "ok": bool(summ.get("ok")),
        "sent_digest": svc.sock.digest.hexdigest()[:16],
        "summary_digest": _digest(outcome),
        "timeline_digest": _digest(svc.timeline.snapshot()),
    }


def _digest(data) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()[:16]


def replay(path: str, repeats: int) -> dict:
    import logging

    logging.disable(logging.WARNING)  # (the recorded run's end: ranks gone, warnings by design)
    with open(path, "rb") as fh:
        rec = pickle.load(fh)
    runs = [replay_once(rec) for _ in range(repeats)]
    out = dict(runs[-1])
    out["us_per_frame"] = round(statistics.median(r["us_per_frame"] for r in runs), 3)
    out["core_share"] = round(replay_once(rec, time_core=True)["core_share"], 3)
    out["same_every_time"] = len({(r["sent_digest"], r["summary_digest"], r["timeline_digest"]) for r in runs}) == 1
    return out


def _peer_replay(peer: str, path: str, repeats: int) -> dict:
    env = peer_env(peer, keep_path=True)
    # This file runs in the peer's interpreter with the peer's code first on the path.
    p = subprocess.run([sys.executable, os.path.abspath(__file__), "--replay", path, "--repeats", str(repeats)],
                       capture_output=True, text=True, env=env, timeout=1800)  # fmt: skip
    if p.returncode != 0:
        return {"failed": p.stderr.strip().splitlines()[-1:] or [f"exit {p.returncode}"]}
    return json.loads(p.stdout)


def main() -> None:
    if "--serve-recording" in sys.argv:  # the coordinator process of a recorded run
        i = sys.argv.index("--serve-recording")
        sys.exit(serve_recording(sys.argv[i + 1], sys.argv[sys.argv.index("--") + 1 :]))
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", default="16,256", help="comma-separated N")
    ap.add_argument("--batches", type=int, default=30000, help="batches of the recorded run, all ranks together")
    ap.add_argument("--repeats", type=int, default=3, help="replays per checkout (medians)")
    ap.add_argument("--peer", default="", help="another checkout to replay the same recordings through")
    ap.add_argument("--keep", default="", help="a folder to keep the recordings in (reused when there)")
    ap.add_argument("--replay", default="", help=argparse.SUPPRESS)  # (one recording, ours: --peer's subprocess)
    args = ap.parse_args()
    if args.replay:
        print(json.dumps(replay(args.replay, args.repeats)))
        return
    folder = args.keep or tempfile.mkdtemp(prefix="flodl-service-replay-")
    os.makedirs(folder, exist_ok=True)
    res: dict = {"bench": "service_replay", "repeats": args.repeats, "loadavg_start": os.getloadavg(), "by_n": {}}
    for n in (int(x) for x in args.ranks.split(",")):
        path = os.path.join(folder, f"saturated-{n}.pkl")
        row: dict = {"recording": path}
        if not os.path.exists(path):
            row["recorded"] = record(n, args.batches, path)
        ours, theirs = [], []
        for _ in range(args.repeats):  # in turn, so that both see the same load
            ours.append(replay(path, 1))
            if args.peer:
                theirs.append(_peer_replay(args.peer, path, 1))
        row["ours"] = _merge(ours)
        if args.peer:
            row["peer"] = _merge(theirs) if all("failed" not in t for t in theirs) else theirs[0]
            if "us_per_frame" in row["peer"]:
                row["peer_over_ours"] = round(row["peer"]["us_per_frame"] / row["ours"]["us_per_frame"], 3)
                row["same_output"] = all(row["ours"][k] == row["peer"][k]
                                         for k in ("sent_digest", "summary_digest", "timeline_digest"))  # fmt: skip
        res["by_n"][str(n)] = row
        print(json.dumps({str(n): row}), file=sys.stderr, flush=True)
    res["loadavg_end"] = os.getloadavg()
    print(json.dumps(res, indent=2))


def _merge(runs: list[dict]) -> dict:
    out = dict(runs[-1])
    for k in ("us_per_frame", "core_share"):
        out[k] = round(statistics.median(r[k] for r in runs), 3)
    out["same_every_time"] = all(r["same_every_time"] for r in runs) and len(
        {(r["sent_digest"], r["summary_digest"], r["timeline_digest"]) for r in runs}) == 1  # fmt: skip
    return out


if __name__ == "__main__":
    main()
