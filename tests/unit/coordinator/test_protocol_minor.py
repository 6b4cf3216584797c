"""Protocol 1.1: the round's global step rides in its ``Update``, so a coordinator refuses
a 1.0 rank at its hello -- with the reason -- instead of admitting a rank whose LR
schedule would silently stop following the run. A current rank is admitted, and the
``Update`` that closes a round carries the run's global step and committed samples."""

import zmq

from flodl.core import VACANT
from flodl.wire import MIN_RANK_MINOR, PROTOCOL_MAJOR, PROTOCOL_MINOR, Endpoint, decode, pb, split_routing
from flodl_coordinator.settings import load_settings

SESSION = "svc-minor"


def _settings(world_size=1):
    return load_settings(env={}, flags={
        "world_size": world_size, "bind": "tcp://127.0.0.1:0", "session": SESSION, "epochs": 1, "batch_size": 4,
        "total_samples": 4, "policy": "sync", "final_eval": False, "liveness_timeout_s": 30.0,
    })  # fmt: skip


def _dealer(ctx, ep):
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(ep)
    return sock


def _recv(sock, timeout_ms=10_000):
    assert sock.poll(timeout_ms), "nothing came back"
    return decode(split_routing(sock.recv_multipart())[1], session=SESSION)


def _hello(rank=0, world_size=1):
    return pb.RankHello(rank=rank, world_size=world_size, dataset_len=4, host="h", pid=1)


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
