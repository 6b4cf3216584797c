"""Fake ranks for ``bench/control_scale.py``: real DEALER sockets speaking the real protocol.

Each ``FakeRank`` is the real rank machine (``flodl.rank.RankMachine``) with a socket and
a pretend device: a ``TrainBatch`` "trains" for ``ms`` of wall time (nothing is computed),
a ``TakeSnapshot`` sends a real weighted ``round`` (one 16-float tensor, ``pack_round``),
an ``ApplyConsensus`` answers ``sync_ack``, and every ``SendTiming``/``SendMetrics`` goes
out as the frame a torch rank would send (``flodl_worker.rank`` + ``flodl_worker.shell``
do the same with torch). Heartbeats follow the RunSpec, as the real rank's do: a timing frame
sent once one is due is the heartbeat.

``serve_ranks`` runs many of them in one thread: one ``zmq.Poller`` over every socket, a
heap of timers (batch ends, heartbeats). Run as a process (``python bench/scale_ranks.py
SPEC_JSON``) it prints one JSON object with what its ranks measured:

* ``train_s`` / ``idle_s``: per rank, from the start of its first batch to the end of its
  last, the time it trained and the time it was blocked waiting for the coordinator
  (no plan yet, or throttled). Idle share = idle / (train + idle).
* ``lag_s``: how late this process noticed batch ends (a loaded generator, not the
  coordinator): counted as training, reported so that it can be judged.
* ``latency_us``: for each command that unblocked a waiting rank, the time from the last
  frame that rank sent (the Batch, or the chunk's metrics, that left it waiting) to that
  command's arrival: the wait, whatever it waited on.
* Arrival: a message is taken to have arrived when the poll that found its socket ready
  returned (the first of each socket per poll; a later one, when it was received), and
  its rank acts on it from then -- as a rank with a process of its own would -- not once
  this one thread has got round to it after every other socket ready in that poll. What
  that turn cost is ``handling_lag_s`` (per unblocking command: from arrival until its
  rank was handled), and the arrival as handled is kept beside it in ``requests``, so
  ``control_scale.py`` reports the measures both ways.
* ``idle_plan_by``: the plan waits by what ended them: ``trigger`` (a round opened: its
  ``RequestParams`` came with the next window), ``update`` (a round finished with the
  next window in its ``Update``), ``chunk`` (a plan alone: a window streamed in
  chunks, a run-ahead chunk, the next epoch's first).
* ``requests``: (cycle, arrival, the rank's last frame sent before it, when this
  thread handled it) of every ``RequestParams``: ``control_scale.py`` finds each round's
  trigger from them.
* ``sent`` / ``received``: frames to and from the coordinator.
* ``first_exit`` / ``last_exit``: when its ranks heard their Shutdown; ``batch_end_hist``:
  batch ends per 50 ms (``control_scale.py`` finds the run's tail from them).
"""

from __future__ import annotations

import heapq
import json
import os
import secrets
import sys
import time

import numpy as np
import zmq

from flodl.rank import (
    WAIT_PLAN,
    WAIT_THROTTLE,
    AbandonRounds,
    Admitted,
    ApplyConsensus,
    BatchTrained,
    ConsensusReady,
    ControlReceived,
    Exit,
    HeartbeatDue,
    IncarnationSeen,
    RankMachine,
    RunEval,
    SendMetrics,
    SendTiming,
    TakeSnapshot,
    TrainBatch,
)
from flodl.wire import Endpoint, WireError, decode, pack_round, pb, split_routing

MODEL_SIG = b"\x5a" * 32  # every fake rank has "the same model"
PARAMS = [np.ones(16, dtype=np.float32)]
BATCH, BEAT = 0, 1  # timer kinds
# A rank with no pace trains instantly but reports this batch time (ms): cadence plans
# windows from reported times, and a 0 ms rank would get degenerate one-batch windows.
SATURATED_MS = 1.0
END_BUCKET_S = 0.05  # batch ends are counted per 50 ms (``batch_end_hist``: where the run's tail is)


class FakeRank:
    def __init__(self, ctx: zmq.Context, rank: int, world: int, ms: float, connect: str, session: str, dataset_len: int):
        self.rank, self.world, self.ms, self.session, self.dataset_len = rank, world, ms, session, dataset_len
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, b"rank-%d-%s" % (rank, secrets.token_hex(4).encode()))
        self.sock.setsockopt(zmq.LINGER, 2000)
        self.sock.setsockopt(zmq.SNDHWM, 10_000)
        self.sock.setsockopt(zmq.RCVHWM, 10_000)
        self.sock.connect(connect)
        self.ep = Endpoint(session, pb.Sender.KIND_RANK, rank=rank, host="fake", incarnation=secrets.randbits(63))
        self.m = RankMachine(rank)
        self.heartbeat_s = 1.0
        self.next_beat = 0.0  # when a heartbeat is due (a timing frame sent by then is it)
        self.sent_mark: float | None = None  # last_sent before the messages being handled (serve_ranks)
        self.born = time.monotonic()
        self.in_hand: TrainBatch | None = None
        self.busy_until = 0.0
        self.busy_since = 0.0
        self.blocked_since: float | None = None
        self.blocked_on = ""  # "plan" | "throttle"
        self.idle_by: dict[str, float] = {"plan": 0.0, "throttle": 0.0}
        self.plan_wait_by: dict[str, float] = {"trigger": 0.0, "update": 0.0, "chunk": 0.0}
        self.seen_blocked: set[str] = set()  # control kinds received since it blocked
        self.first_batch: float | None = None
        self.last_batch_end = 0.0
        self.train_s = self.idle_s = self.lag_s = self.handling_lag_s = 0.0
        self.last_sent = 0.0
        self.requests: list[tuple[int, float, float, float]] = []  # (cycle, arrival, our last frame before it, handled)
        self.latency_us: list[float] = []
        self.sent = self.received = 0
        self.sent_by: dict[str, int] = {}  # frames sent, by kind (a timing frame by its body)
        self.received_by: dict[str, int] = {}  # frames received, by kind (a control by its command)
        self.done = False
        self.exit_reason = ""
        self.exited_at: float | None = None  # when its Shutdown came
        self.ends: list[float] = []  # when each batch ended
        self.drops: dict[str, int] = {}

    # -- frames ---------------------------------------------------------------------

    def send(self, body_field: str, body, blobs=(), *, beat: bool = False) -> None:
        now = time.monotonic()
        report = body_field == "timing" or (body_field == "metrics" and len(body.batches) > 0)  # (protocol 1.3)
        if report and self.m.admitted and now >= self.next_beat:
            # As flodl_worker.rank does: once a heartbeat is due, a timing frame is it,
            # with the time account on it (the real rank's totals; here its train time).
            body.time_account.wall_s, body.time_account.training_s = now - self.born, self.train_s
            self.next_beat = now + self.heartbeat_s
        self.sock.send_multipart(self.ep.frames(body_field, body, blobs), copy=not blobs)
        self.sent += 1
        what = body.WhichOneof("event") if body_field == "timing" else body_field
        self.sent_by[what] = self.sent_by.get(what, 0) + 1
        if not beat:  # a heartbeat sent while waiting is not what the rank waits on
            self.last_sent = now

    def hello(self) -> None:
        self.send("hello", pb.RankHello(rank=self.rank, world_size=self.world, model_sig=MODEL_SIG,
                                        dataset_len=self.dataset_len, host="fake", pid=os.getpid(), task="scale"))

    def on_frames(self, frames, now: float) -> None:
        self.received += 1
        try:
            _route, payload = split_routing(frames)
            d = decode(payload, session=self.session)
        except WireError as e:
            self.drops[e.reason] = self.drops.get(e.reason, 0) + 1
            return
        env, kind = d.envelope, d.kind
        what = env.control.WhichOneof("cmd") if kind == "control" else kind
        self.received_by[what] = self.received_by.get(what, 0) + 1
        self.execute(self.m.handle(IncarnationSeen(incarnation=env.sender.incarnation, hello_ack=kind == "hello_ack")))
        if kind == "hello_ack":
            if not env.hello_ack.accepted:
                if not env.hello_ack.deferred:
                    raise SystemExit(f"rank {self.rank} refused: {env.hello_ack.reason}")
                return
            spec = env.hello_ack.run
            self.heartbeat_s = spec.heartbeat_interval_s or 1.0
            self.execute(self.m.handle(Admitted(spec=spec)))
        elif kind == "control":
            if self.blocked_since is not None:
                self.seen_blocked.add(env.control.WhichOneof("cmd"))
            if env.control.WhichOneof("cmd") == "request_params":
                self.requests.append((env.control.request_params.cycle, now, self.last_sent, time.monotonic()))
            self.execute(self.m.handle(ControlReceived(control=env.control)))
        elif kind == "round":
            h = env.round
            included = h.weight > 0 and (not h.contributing_ranks or self.rank in h.contributing_ranks)
            self.execute(self.m.handle(ConsensusReady(cycle=h.cycle, arrays=PARAMS if included else None)))

    def execute(self, cmds) -> None:
        for c in cmds:
            t = type(c)
            if t is SendTiming:
                self.send("timing", pb.Timing(rank=self.rank, **{c.kind: c.body}), beat=c.kind == "heartbeat")
            elif t is SendMetrics:
                self.send("metrics", c.metrics)
            elif t is TakeSnapshot:
                scaled = [a * np.float32(c.weight) for a in PARAMS]
                header, blobs = pack_round(scaled, cycle=c.cycle, weight=c.weight)
                self.send("round", header, blobs)
            elif t is ApplyConsensus:
                self.send("timing", pb.Timing(rank=self.rank, sync_ack=pb.Timing.SyncAck(cycle=c.cycle, step_count=c.ack_step)))
            elif t is RunEval:
                res = pb.Timing.EvalResult(schedule_id=c.command.schedule_id, epoch=c.command.epoch, metric=0.0,
                                           final=c.command.final)
                self.send("timing", pb.Timing(rank=self.rank, eval_result=res))
            elif t is Exit:
                self.send("timing", pb.Timing(rank=self.rank, exiting=pb.Timing.Exiting(steps=self.m.local_step)))
                self.done, self.exit_reason, self.exited_at = True, c.reason, time.monotonic()
            elif t is AbandonRounds:
                pass
            # Drop / Warn / RunEpochFn / FormGroup / SaveCheckpoint: nothing to do for a fake rank.

    # -- the pretend device -------------------------------------------------------------

    def advance(self, now: float) -> float | None:
        """Finish a batch that is due, start the next one; the next batch end, if any."""
        if self.in_hand is not None:
            if now < self.busy_until:
                return self.busy_until
            b, self.in_hand = self.in_hand, None
            self.lag_s += now - self.busy_until
            self.ends.append(now)
            self.train_s += now - self.busy_since
            self.last_batch_end = now
            self.execute(self.m.handle(BatchTrained(epoch=b.epoch, offset=b.offset, samples=b.count,
                                                    batch_ms=self.ms or SATURATED_MS, data_ms=0.0, loss=1.0, lr=0.1)))
        while not self.done:
            act = self.m.next_action(now)
            if type(act) is SendMetrics:
                self.execute([act])
                continue
            if act is WAIT_PLAN or act is WAIT_THROTTLE:
                if self.blocked_since is None and self.first_batch is not None:
                    self.blocked_since, self.blocked_on = now, "plan" if act is WAIT_PLAN else "throttle"
                return None
            if self.blocked_since is not None:  # a command unblocked it
                self.idle_s += now - self.blocked_since
                self.idle_by[self.blocked_on] += now - self.blocked_since
                if self.blocked_on == "plan":
                    seen = self.seen_blocked
                    why = "trigger" if "request_params" in seen else "update" if "update" in seen else "chunk"
                    self.plan_wait_by[why] += now - self.blocked_since
                self.seen_blocked = set()
                # From its last frame before this pass's messages (those it sent handling them
                # came after the arrival this counts from).
                sent = self.last_sent if self.sent_mark is None else self.sent_mark
                self.latency_us.append((now - sent) * 1e6)
                self.blocked_since = None
            if self.first_batch is None:
                self.first_batch = now
            self.in_hand, self.busy_since, self.busy_until = act, now, now + self.ms / 1e3
            return self.busy_until
        return None


def _end_hist(ranks: list[FakeRank]) -> dict[str, int]:
    """Batch ends per ``END_BUCKET_S`` of CLOCK_MONOTONIC (system-wide: the generators'
    histograms add up): ``{bucket index: batches}``."""
    hist: dict[str, int] = {}
    for rk in ranks:
        for t in rk.ends:
            k = str(int(t / END_BUCKET_S))
            hist[k] = hist.get(k, 0) + 1
    return hist


def _sum_counts(counts) -> dict[str, int]:
    out: dict[str, int] = {}
    for c in counts:
        for k, v in c.items():
            out[k] = out.get(k, 0) + v
    return out


def serve_ranks(spec: dict) -> dict:
    ctx = zmq.Context()
    connects = spec["connect"]  # one endpoint per "host": the coordinator, or that host's relay
    ranks = [FakeRank(ctx, r, spec["world"], ms, connects[i % len(connects)], spec["session"], spec["dataset_len"])
             for i, (r, ms) in enumerate(zip(spec["ranks"], spec["ms"]))]  # fmt: skip
    index = {rk.sock: i for i, rk in enumerate(ranks)}
    armed = [False] * len(ranks)  # a batch-end timer is queued for this rank
    poller = zmq.Poller()
    for rk in ranks:
        poller.register(rk.sock, zmq.POLLIN)
        rk.hello()
    start = time.monotonic()
    timers: list[tuple[float, int, int]] = [(start + 1.0, i, BEAT) for i in range(len(ranks))]
    heapq.heapify(timers)
    deadline = start + spec["timeout_s"]
    alive = len(ranks)

    def advance(i: int, now: float) -> None:
        nonlocal alive
        rk = ranks[i]
        if rk.done:  # (its Shutdown came in a frame just handled)
            poller.unregister(rk.sock)
            alive -= 1
            return
        due = rk.advance(now)
        if due is not None and not armed[i]:
            armed[i] = True
            heapq.heappush(timers, (due, i, BATCH))
        if rk.done:
            poller.unregister(rk.sock)
            alive -= 1

    while alive and time.monotonic() < deadline:
        now = time.monotonic()
        timeout = min(100.0, max(0.0, (timers[0][0] - now) * 1e3)) if timers else 100.0
        ready = poller.poll(timeout)
        polled = time.monotonic()  # every ready socket's first message was there by now
        for sock, _ in ready:
            i = index[sock]
            rk, arrival = ranks[i], polled
            rk.sent_mark = rk.last_sent  # what it waited on was sent before these came (``advance``)
            for k in range(64):  # bounded per socket per pass: fairness
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                if k:
                    arrival = time.monotonic()  # (it may have come while this thread was busy)
                rk.on_frames(frames, arrival)
            blocked = rk.blocked_since is not None
            advance(i, arrival)  # the rank acts on it from its arrival (the module doc)
            if blocked and rk.blocked_since is None:
                rk.handling_lag_s += time.monotonic() - arrival
            rk.sent_mark = None
        now = time.monotonic()
        while timers and timers[0][0] <= now:
            _, i, what = heapq.heappop(timers)
            rk = ranks[i]
            if rk.done:
                continue
            if what == BEAT:
                if rk.in_hand is not None and now < rk.busy_until:
                    # Mid-batch: looked at once the batch is done and reported, as the real
                    # rank does between steps (flodl_worker.rank): its report is the beat.
                    # (Looked at here, a rank of 100-400 ms batches sent a heartbeat frame
                    # of its own every second: a seventh of a paced 1,024-rank run's frames.)
                    heapq.heappush(timers, (rk.busy_until, i, BEAT))
                    continue
                if rk.m.admitted and now >= rk.next_beat:  # no timing frame went out since one was due
                    rk.execute(rk.m.handle(HeartbeatDue()))  # its unreported batches, or a heartbeat
                # (not admitted yet: look again an interval on, as before, not every ms)
                due = max(now + 0.001, rk.next_beat) if rk.m.admitted else now + rk.heartbeat_s
                heapq.heappush(timers, (due, i, BEAT))
            else:
                armed[i] = False
                advance(i, now)
    for rk in ranks:
        rk.sock.close()
    ctx.term()
    return {
        "ranks": len(ranks),
        "finished": sum(rk.done for rk in ranks),
        "exit_reasons": sorted({rk.exit_reason for rk in ranks}),
        "train_s": sum(rk.train_s for rk in ranks),
        "idle_s": sum(rk.idle_s for rk in ranks),
        "idle_plan_s": sum(rk.idle_by["plan"] for rk in ranks),
        "idle_throttle_s": sum(rk.idle_by["throttle"] for rk in ranks),
        "idle_plan_by": {k: sum(rk.plan_wait_by[k] for rk in ranks) for k in ("trigger", "update", "chunk")},
        "lag_s": sum(rk.lag_s for rk in ranks),
        "handling_lag_s": sum(rk.handling_lag_s for rk in ranks),
        "first_batch": min((rk.first_batch for rk in ranks if rk.first_batch is not None), default=None),
        "last_batch": max(rk.last_batch_end for rk in ranks),
        "first_exit": min((rk.exited_at for rk in ranks if rk.exited_at is not None), default=None),
        "last_exit": max((rk.exited_at for rk in ranks if rk.exited_at is not None), default=None),
        "latency_us": [x for rk in ranks for x in rk.latency_us],
        "requests": [r for rk in ranks for r in rk.requests],
        "batches": sum(rk.m.local_step for rk in ranks),
        "sent": sum(rk.sent for rk in ranks),
        "received": sum(rk.received for rk in ranks),
        "sent_by": _sum_counts(rk.sent_by for rk in ranks),
        "received_by": _sum_counts(rk.received_by for rk in ranks),
        "batch_end_hist": _end_hist(ranks),
        "drops": {k: sum(rk.drops.get(k, 0) for rk in ranks) for k in {k for rk in ranks for k in rk.drops}},
    }


if __name__ == "__main__":
    print(json.dumps(serve_ranks(json.loads(sys.argv[1]))), flush=True)
