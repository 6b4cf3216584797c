"""Metrics: per-epoch aggregation of ``ChunkDone`` reports (§11.1-11.2).

Theory of operation
-------------------
Each ``ChunkDone`` is folded into its rank's running sums for its epoch, and its
``chunk_seq`` kept under the epoch and rank (a repeated ``chunk_seq`` is a duplicate and
ignored; one for an epoch already aggregated is late and counted).

An epoch is *ready* when every ACTIVE rank that was assigned work in it (a plan or an
extension) has reported at least one ``ChunkDone`` for it, and its coverage is
complete (every position committed). Epochs aggregate in order; a ready epoch is
aggregated exactly once: ``EpochAggregated{metrics}`` to every ACTIVE rank -- the whole
metrics to the epoch-callback role the ranks were last told of (the one rank that hands
them to ``epoch_fn``), the cohort's values without the per-rank arrays to the others
(a rank reads only the epoch from it: N ranks times N-long arrays was O(N^2) per epoch,
115 kB to each of 4,096 ranks) -- a ``Notice("epoch", ...)`` for the operator log, its coverage bitmap is released, and
a row is kept for the run summary. The notice carries the epoch, its loss, per-rank
samples/s, wall time since dispatch, coverage and each rank's latest divergence.

The math (``aggregate``, scenario 51), per rank summed over its chunks, then cohort:

* ``avg_loss`` = Σ loss·batches / Σ batches (0 when no batch);
* ``epoch_ms`` = max over ranks of the rank's summed ``epoch_ms``;
* ``per_rank_throughput`` = samples / (share_complete_ms if > 0 else epoch_ms) · 1000,
  in samples per second (0 when the denominator is 0);
* ``per_rank[r][k]`` = sum/count of scalar ``k`` (0 when count is 0); ``scalars[k]`` =
  the batch-weighted mean of the per-rank means over ranks with count > 0;
* ``per_rank_batch_share`` = batches / Σ batches (equal shares when Σ is 0);
* ``per_rank_loss`` = the rank's batch-weighted loss, None when it trained nothing
  (0.0 on the wire, where the field is a plain float).
"""

from __future__ import annotations

from bisect import bisect_left
from typing import Any

from flodl.wire import pb

from . import _coverage
from ._commands import Command, Notice
from ._errors import RankViolation
from ._events import ChunkDone
from ._phases import ACTIVE
from ._state import CoordinatorState, EpochSums

__all__ = ["check_chunk", "on_chunk", "aggregate", "aggregate_sums", "to_pb", "is_ready", "next_ready", "aggregate_next"]


def check_chunk(st: CoordinatorState, ev: ChunkDone) -> None:
    if ev.epoch not in st.dispatch.assigned:
        raise RankViolation(f"rank {ev.rank}: ChunkDone for epoch {ev.epoch}, which was never dispatched")
    if ev.batches < 0 or ev.samples < 0:
        raise RankViolation(f"rank {ev.rank}: ChunkDone with negative counts")


def on_chunk(st: CoordinatorState, ev: ChunkDone) -> None:
    last = st.metrics.last_aggregated
    if last is not None and ev.epoch <= last:
        st.metrics.late_chunks += 1
        st.count_ignored("ChunkDone for an aggregated epoch")
        return
    mine = st.metrics.chunks.setdefault(ev.epoch, {}).setdefault(ev.rank, [])
    if ev.chunk_seq in mine:
        st.count_ignored("duplicate ChunkDone")
        return
    mine.append(ev.chunk_seq)
    sums = st.metrics.sums.get(ev.epoch)
    if sums is None:
        sums = st.metrics.sums[ev.epoch] = EpochSums()
    _add(sums, ev)


def _add(sums: EpochSums, c: ChunkDone) -> None:
    """Fold one chunk into its rank's sums -- the same float operations, in arrival order,
    whether run as the chunk arrives (``on_chunk``) or over a list (``aggregate``)."""
    r = c.rank
    if r >= len(sums.batches):
        _grow(sums, r + 1)
    sums.batches[r] += c.batches
    sums.samples[r] += c.samples
    sums.loss_b[r] += c.avg_loss * c.batches
    sums.epoch_ms[r] += c.epoch_ms
    sums.share_ms[r] += c.share_complete_ms
    if c.scalars:
        mine = sums.scalars.setdefault(r, {})
        for name, v, k in c.scalars:
            s = mine.setdefault(name, [0.0, 0])
            s[0] += v
            s[1] += k


def _grow(sums: EpochSums, n: int) -> None:
    """Columns at least ``n`` long (a rank beyond them reported; the aggregation wants
    one entry per rank of the world)."""
    more = n - len(sums.batches)
    if more > 0:
        sums.batches += [0] * more
        sums.samples += [0] * more
        sums.loss_b += [0.0] * more
        sums.epoch_ms += [0.0] * more
        sums.share_ms += [0.0] * more


def _sums(chunks: dict[int, list[ChunkDone]]) -> EpochSums:
    out = EpochSums()
    for mine in chunks.values():
        for c in mine:
            _add(out, c)
    return out


def aggregate(epoch: int, chunks: dict[int, list[ChunkDone]], world_size: int) -> dict[str, Any]:
    """The epoch's metrics as a JSON-safe dict (see the module docstring)."""
    return aggregate_sums(epoch, _sums(chunks), world_size)


def aggregate_sums(epoch: int, sums: EpochSums, world_size: int) -> dict[str, Any]:
    """``aggregate`` from the ranks' running sums (``_add``): column by column, the same
    float operations in the same order as one record per rank made, at a fraction of
    the cost at thousands of ranks (it runs inside the epoch-boundary step). The result
    holds ``sums``' columns, grown to ``world_size`` (the caller popped them: no copy).
    A rank is below ``world_size`` (the step checked its frame)."""
    _grow(sums, world_size)
    batches, samples, loss_b, epoch_ms, share_ms = sums.batches, sums.samples, sums.loss_b, sums.epoch_ms, sums.share_ms
    scal = {r: per for r, per in sums.scalars.items() if per}
    names = sorted({k for per in scal.values() for k in per})
    zeros = dict.fromkeys(names, 0.0)
    # A rank without scalars shares one map of zeros: read only (``to_pb``), and not a
    # dict per rank of a world of thousands.
    per_rank = [zeros] * world_size
    for r, per in scal.items():
        per_rank[r] = {k: (per[k][0] / per[k][1] if per.get(k, [0, 0])[1] else 0.0) for k in names}
    scalars = {}
    for k in names:
        have = sorted(r for r, per in scal.items() if per.get(k, [0, 0])[1] > 0)
        w = sum(batches[r] for r in have)
        if w > 0:
            scalars[k] = sum(batches[r] * per_rank[r][k] for r in have) / w
        elif have:
            scalars[k] = sum(per_rank[r][k] for r in have) / len(have)
        # else: named by ranks with no reading of it (count 0): no mean to give, and a
        # rank's odd frame must not divide by zero inside the epoch's step.
    # (A rank that never reported has zeros: 0 samples/s, as its own record said.)
    thr = [
        n / d * 1000.0 if (d := sh if sh > 0 else em) > 0 else 0.0
        for n, sh, em in zip(samples, share_ms, epoch_ms)
    ]
    all_b = sum(batches)
    return {
        "epoch": epoch,
        "avg_loss": sum(loss_b) / all_b if all_b else 0.0,
        "epoch_ms": max(epoch_ms, default=0.0),
        "per_rank_throughput": thr,
        "per_rank_batch_share": [(b / all_b) for b in batches] if all_b else [1.0 / world_size] * world_size,
        "per_rank_loss": [(lb / b if b else None) for lb, b in zip(loss_b, batches)],
        "per_rank_samples": samples,
        "per_rank_batches": batches,
        "scalars": scalars,
        "per_rank": per_rank,
    }


def to_pb(m: dict[str, Any]) -> pb.EpochMetrics:
    out = pb.EpochMetrics(
        epoch=m["epoch"],
        scalars=m["scalars"],
        avg_loss=m["avg_loss"],
        epoch_ms=m["epoch_ms"],
        per_rank_throughput=m["per_rank_throughput"],
        per_rank_batch_share=m["per_rank_batch_share"],
        per_rank_loss=[x if x is not None else 0.0 for x in m["per_rank_loss"]],
        per_rank_samples=m["per_rank_samples"],
        per_rank_batches=m["per_rank_batches"],
    )
    out.MergeFromString(_per_rank_wire(m["per_rank"]))
    return out


def _per_rank_wire(per_rank: list[dict[str, float]]) -> bytes:
    """``per_rank`` as ``EpochMetrics``' wire bytes: each distinct map serialised once
    (the ranks without scalars share one, ``aggregate_sums``), the entries in order --
    a ``ScalarMap`` object per rank was 4 us each, most of a 4,096-rank epoch's message."""
    done: dict[int, bytes] = {}  # id(map) -> its entry (the maps live in per_rank meanwhile)
    parts = []
    for v in per_rank:
        entry = done.get(id(v))
        if entry is None:
            entry = done[id(v)] = pb.EpochMetrics(per_rank=[pb.ScalarMap(values=v)]).SerializeToString()
        parts.append(entry)
    return b"".join(parts)


def _epoch_aggregated(ctl: pb.Control, metrics: pb.EpochMetrics) -> None:
    ctl.epoch_aggregated.metrics.CopyFrom(metrics)


def _whole_metrics(ctl: pb.Control, m: dict[str, Any]) -> None:
    ctl.epoch_aggregated.metrics.CopyFrom(to_pb(m))


def is_ready(st: CoordinatorState, epoch: int) -> bool:
    assigned = st.dispatch.assigned.get(epoch)
    if assigned is None or not _coverage.is_complete(st.coverage, epoch):
        return False
    got = st.metrics.chunks.get(epoch, {})
    # Asked on every pass of the step once the epoch is complete: when every assigned rank
    # has metrics, two C-level passes say so; else the walk stops at the first without.
    if got.keys() >= assigned.keys() and all(got.values()):
        return True
    for r, ranges in assigned.items():
        if st.ranks[r].phase is ACTIVE and ranges and not got.get(r):
            return False
    return True


def _next_epoch(st: CoordinatorState) -> int:
    last = st.metrics.last_aggregated
    return 0 if last is None else last + 1


def next_ready(st: CoordinatorState) -> tuple[bool, str]:
    """Whether the next epoch can be aggregated, and why (the step's ``aggregate`` rule)."""
    epoch = _next_epoch(st)
    if is_ready(st, epoch):
        return True, f"epoch {epoch} complete"
    return False, f"epoch {epoch} not complete"


def aggregate_next(st: CoordinatorState, out: list[Command]) -> int:
    """Aggregate the next epoch (``next_ready`` said it is ready); returns it. The step
    then asks for its checkpoint and serves an eval intent (before the next dispatch)."""
    epoch = _next_epoch(st)
    st.metrics.chunks.pop(epoch, None)
    m = aggregate_sums(epoch, st.metrics.sums.pop(epoch, EpochSums()), st.config.world_size)
    cohort = pb.EpochMetrics(epoch=m["epoch"], scalars=m["scalars"], avg_loss=m["avg_loss"], epoch_ms=m["epoch_ms"])
    role = st.dispatch.announced_role  # what the ranks believe: who runs epoch_fn with these
    # Built when sent (``CoordinatorState.send_built``); the role's whole metrics (N-long
    # arrays, N per-rank maps) from a copy of the throughput list, which the history
    # row and the notice below share.
    whole = (dict(m, per_rank_throughput=list(m["per_rank_throughput"])),)
    alive = st.index.alive()
    if role is None or role not in st.index.phases[ACTIVE]:
        st.send_built_each(out, alive, "epoch_aggregated", _epoch_aggregated, (cohort,))
    else:
        at = bisect_left(alive, role)
        st.send_built_each(out, alive[:at], "epoch_aggregated", _epoch_aggregated, (cohort,))
        st.send_built(out, role, "epoch_aggregated", _whole_metrics, whole)
        st.send_built_each(out, alive[at + 1:], "epoch_aggregated", _epoch_aggregated, (cohort,))
    _coverage.freeze(st.coverage, epoch)
    st.metrics.last_aggregated = epoch
    row = {k: m[k] for k in ("epoch", "avg_loss", "epoch_ms", "per_rank_throughput")}
    if not any(m["per_rank_batches"]):
        # No batch of it was reported in this run: a resumed checkpoint's weights held
        # all of it. Its loss is unknown here, not 0.
        row["avg_loss"] = None
    st.metrics.history.append(row)
    wall = st.now - st.dispatch.dispatched_at.get(epoch, st.now)
    out.append(
        Notice(
            "epoch",
            {
                "epoch": epoch,
                "avg_loss": m["avg_loss"],
                "samples_per_s": m["per_rank_throughput"],
                "wall_s": wall,
                "coverage": _coverage.epoch_summary(st.coverage.epochs[epoch]),
                "divergence": [rec.divergence for rec in st.ranks],
            },
        )
    )
    return epoch
