"""Protocol 1.1: the round's global step rides in its ``Update``, so a coordinator refuses
a 1.0 rank at its hello -- with the reason -- instead of admitting a rank whose LR
schedule would silently stop following the run. A current rank is admitted, and the
``Update`` that closes a round carries the run's global step and committed samples.
Past the hello, a member's frame of an older minor (the old release's rank met by a
coordinator restarted as a newer one) stops that rank, with the reason, and the run."""

import json
import time

import pytest
import zmq

from flodl.core import VACANT
from flodl.rank import (
    Admitted, ApplyConsensus, BatchTrained, ConsensusReady, ControlReceived, Exit, IncarnationSeen, RankMachine,
    SendMetrics, SendTiming, TakeSnapshot, TrainBatch,
)
from flodl.wire import MIN_RANK_MINOR, PROTOCOL_MAJOR, PROTOCOL_MINOR, Endpoint, decode, pb, split_routing
from flodl_coordinator.settings import load_settings

SESSION = "svc-minor"


def _settings(world_size=1, total_samples=4, **more):
    return load_settings(env={}, flags={
        "world_size": world_size, "bind": "tcp://127.0.0.1:0", "session": SESSION, "epochs": 1, "batch_size": 4,
        "total_samples": total_samples, "policy": "sync", "final_eval": False, "liveness_timeout_s": 30.0, **more,
    })  # fmt: skip


def _dealer(ctx, ep):
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(ep)
    return sock


def _recv(sock, timeout_ms=10_000):
    assert sock.poll(timeout_ms), "nothing came back"
    return decode(split_routing(sock.recv_multipart())[1], session=SESSION)


def _hello(rank=0, world_size=1, dataset_len=4):
    return pb.RankHello(rank=rank, world_size=world_size, dataset_len=dataset_len, host="h", pid=1)


def test_a_rank_of_protocol_1_0_is_refused_at_its_hello_with_the_versions(serve):
    assert 1 <= MIN_RANK_MINOR <= PROTOCOL_MINOR
    svc, ep, ctx = serve(_settings())
    old = pb.Envelope(protocol_major=PROTOCOL_MAJOR, protocol_minor=MIN_RANK_MINOR - 1, session=SESSION, seq=1)
    old.sender.kind, old.sender.rank, old.sender.incarnation = pb.Sender.KIND_RANK, 0, 3
    old.hello.CopyFrom(_hello())
    sock = _dealer(ctx, ep)
    sock.send_multipart([b"", old.SerializeToString()])
    ack = _recv(sock).envelope.hello_ack
    assert ack.accepted is False
    assert f"rank speaks protocol {PROTOCOL_MAJOR}.{MIN_RANK_MINOR - 1}" in ack.reason, ack.reason
    assert f"needs {PROTOCOL_MAJOR}.{MIN_RANK_MINOR} or later" in ack.reason, ack.reason
    assert "same flodl release on every host" in ack.reason  # the fix, not only the cause
    assert svc.dropped["version_mismatch"] == 1
    assert svc.state.ranks[0].phase is VACANT  # nothing admitted

    # The same slot, from a rank of this release: admitted, and its round's Update says
    # the run's progress (no SetGlobalStep after it).
    me = Endpoint(SESSION, pb.Sender.KIND_RANK, rank=0, incarnation=4)
    cur = _dealer(ctx, ep)
    cur.send_multipart(me.frames("hello", _hello()))
    ack = _recv(cur).envelope.hello_ack
    assert ack.accepted, ack.reason
    kinds = []
    while True:
        d = _recv(cur)
        if d.kind != "control":
            continue
        ctl = d.envelope.control
        kind = ctl.WhichOneof("cmd")
        kinds.append(kind)
        if kind == "start_epoch":
            plan = ctl.start_epoch.plan
            batch = pb.Timing.Batch(batch_ms=1.0, step_count=1, samples=plan.partition_size, epoch=plan.epoch,
                                    offset=plan.partition_offset, batch_loss=1.0)  # fmt: skip
            cur.send_multipart(me.frames("timing", pb.Timing(rank=0, batch=batch)))
        elif kind == "request_params":
            cycle = ctl.request_params.cycle
            cur.send_multipart(me.frames("timing", pb.Timing(rank=0, sync_ack=pb.Timing.SyncAck(cycle=cycle, step_count=1))))
        elif kind == "update":
            assert ctl.update.HasField("global_step")
            assert (ctl.update.global_step, ctl.update.samples_committed) == (1, 4)
            break
    assert "set_global_step" not in kinds, kinds


def _train_to_the_end(sock, me, rank, deadline_s=30.0):
    """Play one rank with the real rank machine (no tensors: a consensus keeps the local
    parameters) until it is told to stop; returns the commands it was given, by kind."""
    m, snapshots, kinds, t0 = RankMachine(rank), [], [], time.monotonic()

    def do(cmds):
        for c in cmds:
            t = type(c)
            if t is SendTiming:
                sock.send_multipart(me.frames("timing", pb.Timing(rank=rank, **{c.kind: c.body})))
            elif t is SendMetrics:
                sock.send_multipart(me.frames("metrics", c.metrics))
            elif t is TakeSnapshot:
                snapshots.append(c.cycle)
            elif t is ApplyConsensus:
                ack = pb.Timing.SyncAck(cycle=c.cycle, step_count=c.ack_step)
                sock.send_multipart(me.frames("timing", pb.Timing(rank=rank, sync_ack=ack)))
            elif t is Exit:
                sock.send_multipart(me.frames("timing", pb.Timing(rank=rank, exiting=pb.Timing.Exiting(steps=c.steps))))
                return True
        return False

    while time.monotonic() - t0 < deadline_s:
        while sock.poll(0):
            d = decode(split_routing(sock.recv_multipart())[1], session=SESSION)
            m.handle(IncarnationSeen(incarnation=d.envelope.sender.incarnation, hello_ack=d.kind == "hello_ack"))
            if d.kind == "hello_ack":
                assert d.envelope.hello_ack.accepted, d.envelope.hello_ack.reason
                do(m.handle(Admitted(spec=d.envelope.hello_ack.run)))
            elif d.kind == "control":
                kinds.append(d.envelope.control.WhichOneof("cmd"))
                if do(m.handle(ControlReceived(control=d.envelope.control))):
                    return kinds
        while snapshots:  # the bus round's consensus, at once
            cycle = snapshots.pop(0)
            if do(m.handle(ConsensusReady(cycle=cycle, arrays=(cycle,)))):  # (a marker: it is in the consensus)
                return kinds
        act = m.next_action(time.monotonic()) if m.admitted else None
        if isinstance(act, TrainBatch):
            do(m.handle(BatchTrained(epoch=act.epoch, offset=act.offset, samples=act.count, batch_ms=1.0, loss=0.5)))
        elif isinstance(act, SendMetrics):
            do([act])
        else:
            sock.poll(20)
    raise AssertionError(f"rank {rank} was not told to stop within {deadline_s} s: {[k for k in kinds if k != 'coord_heartbeat']}")


@pytest.mark.parametrize("frame", ["heartbeat", "hello"])  # (a member says hello again after a restart)
def test_a_member_of_an_older_minor_is_told_why_and_stopped_and_the_run_is_not_ok(serve, tmp_path, frame):
    # A coordinator restarted from its journal as a newer release keeps the members it
    # finds: their hellos were checked by the process before. Here rank 0 speaks an older
    # minor mid-run (a frame of the old release): it is told why and stopped, its samples
    # go to rank 1, and the run, complete and exact, says it ran without it.
    out = tmp_path / "summary.json"
    svc, ep, ctx = serve(_settings(world_size=2, total_samples=8, summary=str(out)))
    r0, r1 = Endpoint(SESSION, pb.Sender.KIND_RANK, rank=0, incarnation=5), Endpoint(SESSION, pb.Sender.KIND_RANK, rank=1, incarnation=6)
    s0, s1, forger = _dealer(ctx, ep), _dealer(ctx, ep), _dealer(ctx, ep)
    s0.send_multipart(r0.frames("hello", _hello(0, 2, 8)))
    assert _recv(s0).envelope.hello_ack.accepted
    s1.send_multipart(r1.frames("hello", _hello(1, 2, 8)))
    while _recv(s0).envelope.control.WhichOneof("cmd") != "start_epoch":
        pass  # the world formed: rank 0 is a member with work
    old = pb.Envelope(protocol_major=PROTOCOL_MAJOR, protocol_minor=MIN_RANK_MINOR - 1, session=SESSION, seq=10_000)
    old.sender.kind, old.sender.rank, old.sender.incarnation = pb.Sender.KIND_RANK, 0, 5
    if frame == "hello":
        old.hello.CopyFrom(_hello(0, 2, 8))
    else:
        old.timing.CopyFrom(pb.Timing(rank=0, heartbeat=pb.Timing.Heartbeat(step_count=0)))
    forger.send_multipart([b"", old.SerializeToString()])  # from a route that is not rank 0's: refuses nobody
    s0.send_multipart([b"", old.SerializeToString()])
    while True:
        d = _recv(s0)
        if d.kind == "control" and d.envelope.control.WhichOneof("cmd") == "shutdown":
            reason = d.envelope.control.shutdown.reason
            break
    assert f"needs {PROTOCOL_MAJOR}.{MIN_RANK_MINOR} or later" in reason and "same flodl release on every host" in reason
    _train_to_the_end(s1, r1, 1)
    t0 = time.monotonic()
    while svc.exit_code is None and time.monotonic() - t0 < 15:
        time.sleep(0.05)
    assert svc.exit_code not in (None, 0)
    summary = json.loads(out.read_text())
    assert summary["ok"] is False
    assert summary["reason"].startswith("rank(s) [0] refused mid-run: rank speaks protocol"), summary["reason"]
    # The forgery (a hello: refused as any old hello is), then rank 0's frame.
    forged = {"version_mismatch": 2} if frame == "hello" else {"route_mismatch": 1, "version_mismatch": 1}
    assert summary["dropped_frames"] == forged
    (cov,) = summary["coverage"]
    assert (cov["expected"], cov["missing"], cov["duplicates"]) == (8, 0, 0)  # rank 1 trained rank 0's half too
    by_rank = {r["rank"]: r for r in summary["ranks"]}
    assert by_rank[0]["phase"] == "DEAD" and by_rank[0]["reason"].startswith("refused: rank speaks protocol")
    status = svc.status.snapshot()  # the operator's view says the same
    assert status["run"]["ok"] is False and status["run"]["reason"] == summary["reason"]
    alerts = {a["kind"]: a["message"] for a in status["alerts"]}
    assert alerts["run_failed"] == f"the run failed: {summary['reason']}", alerts
    assert alerts["rank_lost"].startswith("rank 0 lost: refused: rank speaks protocol"), alerts


def test_an_evicted_squatter_hears_why_and_the_rank_that_took_its_slot_does_not(serve):
    # One step evicts the squatter and admits the real rank 0 (its hello tipped the vote):
    # the eviction's Shutdown is a LastWord and must go to the squatter's route, not to
    # the route slot 0 has once the step is done (the real rank would exit).
    svc, ep, ctx = serve(_settings(world_size=3))
    squat, real0, r1 = (_dealer(ctx, ep) for _ in range(3))
    me = {r: Endpoint(SESSION, pb.Sender.KIND_RANK, rank=r, incarnation=10 + r) for r in (0, 1)}
    evil = Endpoint(SESSION, pb.Sender.KIND_RANK, rank=0, incarnation=99)
    hello = _hello(0, 3)
    hello.model_sig = b"\x01" * 32
    squat.send_multipart(evil.frames("hello", hello))
    assert _recv(squat).envelope.hello_ack.accepted
    good = {r: _hello(r, 3) for r in (0, 1)}
    for h in good.values():
        h.model_sig = b"\x02" * 32
    r1.send_multipart(me[1].frames("hello", good[1]))
    assert _recv(r1).envelope.hello_ack.deferred  # 1 voter against 1 holder
    real0.send_multipart(me[0].frames("hello", good[0]))
    assert _recv(real0).envelope.hello_ack.accepted  # 2 voters: evicted, and admitted
    d = _recv(squat)
    assert d.kind == "control" and "evicted before the world formed" in d.envelope.control.shutdown.reason
    t0 = time.monotonic()
    while time.monotonic() - t0 < 1.0:  # whatever reaches the real rank 0 now, it is no Shutdown
        if real0.poll(50):
            d = decode(split_routing(real0.recv_multipart())[1], session=SESSION)
            assert not (d.kind == "control" and d.envelope.control.WhichOneof("cmd") == "shutdown"), d.envelope
