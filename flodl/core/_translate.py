"""Decoded wire bodies -> core events. The one place that knows both vocabularies.

Here, not in the service, so that every driver of the core -- the coordinator's shell,
the simulator, the core's test cluster -- turns a rank's frame into the same event."""

from __future__ import annotations

from ._events import (
    BatchDone,
    BatchesDone,
    CheckpointDone,
    ChunkDone,
    CollectiveFailed,
    EpochFnElapsed,
    EvalDone,
    HeartbeatSeen,
    IntentRaised,
    JoinerSeeded,
    PartitionTrimmed,
    RankExiting,
    RankHello,
    RankResynced,
    StoreReady,
    SyncAcked,
    BATCH_DONE_SETTERS,
    UNPINNED,
)
from flodl.wire import pb

__all__ = ["hello_event", "hello_oversized", "timing_event", "metrics_event", "chunk_events", "MAX_SIG_BYTES", "MAX_HOST_CHARS",
           "MAX_TASK_CHARS"]

# What a hello may carry into the journal. A model signature is a sha256 (32 bytes);
# a host name is at most 253 characters (DNS). A hello over either is refused by name,
# never journaled (anyone who knows the session can send one).
MAX_SIG_BYTES = 64
MAX_HOST_CHARS = 255
MAX_TASK_CHARS = 255


def _opt(msg, name):
    return getattr(msg, name) if msg.HasField(name) else None


def hello_oversized(h: pb.RankHello) -> str:
    """Why this hello is too big to keep (journal, status), or ''."""
    if len(h.model_sig) > MAX_SIG_BYTES:
        return f"hello refused: model_sig of {len(h.model_sig)} bytes exceeds {MAX_SIG_BYTES}"
    if len(h.host) > MAX_HOST_CHARS:
        return f"hello refused: host name of {len(h.host)} characters exceeds {MAX_HOST_CHARS}"
    if len(h.task) > MAX_TASK_CHARS:
        return f"hello refused: task of {len(h.task)} characters exceeds {MAX_TASK_CHARS}"
    return ""


def hello_event(now: float, route: tuple[bytes, ...], env: pb.Envelope, agent: str = "") -> RankHello:
    """``agent``: the digest of the hello's agent token (the shell's), kept for an unpinned
    hello (``RankHello.unpinned_slot`` set): the core places it by agent and local rank."""
    h = env.hello
    unpinned = h.HasField("unpinned_slot")
    return RankHello(
        now=now,
        route=route,
        rank=UNPINNED if unpinned else h.rank,
        local_rank=h.unpinned_slot if unpinned else -1,
        agent=agent if unpinned else "",
        world_size=h.world_size,
        model_sig=bytes(h.model_sig),
        dataset_len=h.dataset_len,
        host=h.host,
        pid=h.pid,
        incarnation=env.sender.incarnation,
        restart_count=h.restart_count,
    )


_INF = float("inf")


_new = object.__new__
(_set_now, _set_rank, _set_batch_ms, _set_data_ms, _set_step_count, _set_loss, _set_samples, _set_epoch, _set_offset,
 _set_lr, _set_sync_divergence, _set_wait_ms) = (
    BATCH_DONE_SETTERS[name] for name in ("now", "rank", "batch_ms", "data_ms", "step_count", "loss", "samples",
                                          "epoch", "offset", "lr", "sync_divergence", "wait_ms"))  # fmt: skip
assert len(BATCH_DONE_SETTERS) == 12, "a new BatchDone field must be set in _batch"


def _batch(now: float, rank: int, b: pb.Timing.Batch) -> BatchDone:
    """The ``BatchDone`` a ``Timing.Batch`` says, its slots set one by one (every batch
    of a run comes through here: ``BATCH_DONE_SETTERS``)."""
    ev = _new(BatchDone)
    _set_now(ev, now)
    _set_rank(ev, rank)
    _set_batch_ms(ev, b.batch_ms)
    _set_data_ms(ev, b.data_ms)
    _set_step_count(ev, b.step_count)
    _set_loss(ev, b.batch_loss)
    _set_samples(ev, b.samples)
    _set_epoch(ev, b.epoch)
    _set_offset(ev, b.offset)
    _set_lr(ev, b.lr)
    _set_sync_divergence(ev, b.sync_divergence if b.HasField("sync_divergence") else None)
    w = b.wait_ms
    _set_wait_ms(ev, w if 0.0 < w < _INF else 0.0)  # a hostile NaN / inf / negative: none
    return ev


def timing_event(now: float, t: pb.Timing):
    """Return the core event for a Timing body (liveness-only kinds become HeartbeatSeen)."""
    kind = t.WhichOneof("event")
    r = t.rank
    if kind == "batch":
        return _batch(now, r, t.batch)
    if kind == "batches":
        return _batch_run(now, r, t.batches.batch)
    if kind == "sync_ack":
        a = t.sync_ack
        return SyncAcked(
            now=now,
            rank=r,
            cycle=a.cycle,
            step_count=a.step_count,
            divergence=_opt(a, "divergence"),
            pre_norm=_opt(a, "pre_norm"),
            post_norm=_opt(a, "post_norm"),
        )
    if kind == "exiting":
        return RankExiting(now=now, rank=r, param_digest=t.exiting.param_digest.hex(), steps=t.exiting.steps)
    if kind == "eval_result":
        e = t.eval_result
        return EvalDone(
            now=now,
            rank=r,
            schedule_id=e.schedule_id,
            epoch=e.epoch,
            metric=e.metric,
            elapsed_ms=e.elapsed_ms,
            error=_opt(e, "error"),
            final=e.final,
        )
    if kind == "checkpoint_result":
        c = t.checkpoint_result
        return CheckpointDone(now=now, rank=r, version=c.version, elapsed_ms=c.elapsed_ms, error=_opt(c, "error"))
    if kind == "epoch_fn_elapsed":
        f = t.epoch_fn_elapsed
        return EpochFnElapsed(now=now, rank=r, epoch=f.epoch, elapsed_ms=f.elapsed_ms)
    if kind == "resync":
        return resync_event(now, r, t.resync)
    if kind == "intent":
        k = {pb.INTENT_KIND_EVAL_NOW: "eval", pb.INTENT_KIND_CHECKPOINT_NOW: "checkpoint"}.get(t.intent.kind)
        if k is not None:
            return IntentRaised(now=now, rank=r, kind=k)
    if kind == "seeded":
        return JoinerSeeded(now=now, rank=r, cycle=t.seeded.cycle)
    if kind == "partition_trimmed":
        p = t.partition_trimmed
        released = tuple((s.offset, s.size) for s in p.released)
        return PartitionTrimmed(now=now, rank=r, command_id=p.command_id, epoch=p.epoch, kept=p.kept, released=released)
    if kind == "store_ready":
        return StoreReady(now=now, rank=r, generation=t.store_ready.generation, addr=t.store_ready.addr)
    if kind == "collective_failed":
        cf = t.collective_failed
        return CollectiveFailed(
            now=now, rank=r, generation=cf.generation, cycle=cf.cycle, reason=cf.reason, seeding=cf.seeding
        )
    step = t.heartbeat.step_count if kind == "heartbeat" else 0
    return HeartbeatSeen(now=now, rank=r, step_count=step)


def chunk_events(now: float, m: pb.Metrics) -> list:
    """A chunk's Metrics frame as core events: the batches it carries (protocol 1.3:
    ``Metrics.batches``), as the ``timing`` frame that used to come just before it would
    have been, then its ``ChunkDone``. The core steps the same events either way."""
    done = metrics_event(now, m)
    carried = m.batches
    if not carried:
        return [done]
    r = m.rank  # (as the rank framed it: one batch alone, several as a run)
    return [_batch(now, r, carried[0]) if len(carried) == 1 else _batch_run(now, r, carried), done]


def _batch_run(now: float, rank: int, batches) -> BatchesDone:
    return BatchesDone(now=now, rank=rank, batches=tuple([_batch(now, rank, b) for b in batches]))


def metrics_event(now: float, m: pb.Metrics) -> ChunkDone:
    return ChunkDone(
        now=now,
        rank=m.rank,
        epoch=m.epoch,
        chunk_seq=m.chunk_seq,
        batches=m.batches_processed,
        samples=m.samples_processed,
        avg_loss=m.avg_loss,
        epoch_ms=m.epoch_ms,
        share_complete_ms=m.share_complete_ms,
        compute_only_ms=m.compute_only_ms,
        data_starve_ms=m.data_starve_ms,
        scalars=tuple((k, v.sum, v.count) for k, v in sorted(m.scalars.items())),
    )


def resync_event(now: float, rank: int, m: pb.Timing.Resync) -> RankResynced:
    """A rank's report after a coordinator restart (``flodl.core._resync``)."""
    return RankResynced(
        now=now,
        rank=rank,
        last_command_id=m.last_command_id,
        local_step=m.local_step,
        folded_step=m.folded_step,
        throttled=m.throttled,
        idle=m.idle,
        batches=tuple(
            (b.step_count, b.epoch, b.offset, b.samples, b.batch_ms, b.data_ms, b.batch_loss, b.lr) for b in m.batches
        ),
        held=tuple((p.epoch, p.partition_offset, p.partition_size) for p in m.held),
        chunks=tuple(
            (c.epoch, c.chunk_seq, c.batches_processed, c.samples_processed, c.avg_loss, c.epoch_ms,
             c.share_complete_ms, c.compute_only_ms, c.data_starve_ms)
            for c in m.chunks
        ),  # fmt: skip
    )
