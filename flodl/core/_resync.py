"""Coordinator restart: the ranks resynchronise with a coordinator rebuilt from its journal.

Theory of operation
-------------------
The service journals every event before stepping it, so a coordinator killed at any
point and restarted on its journal replays to the exact state it had: every command it
ever sent is derived from that state. What the crash loses are *frames*, both ways: the
ranks' frames the dead process had not journaled yet (batch reports, metrics, acks,
round contributions), and the commands and consensus frames it had not delivered yet
(plans, an ``Update``, ``RequestParams``, the final ``ExecuteEval``...). Two events close
the gap; both are journaled and pure, so a journal holding a restart replays too.

``CoordinatorRestarted`` (fed by the restarted service right after the replay):

* every addressable rank gets a fresh liveness grace: its last frame is from before the
  crash, and it needs time to reconnect;
* an open averaging round is *abandoned* (``PENDING --abandon--> IDLE``): its
  contributions lived only in the dead process's reducer. Acks it already got stay
  folded (their batches are committed: those ranks applied a consensus holding them);
  the rest of the window is folded by the next round, which the gate opens normally;
* the beacon timer is reset, so every rank hears the new incarnation at the next tick;
* collective plane: the process group is re-formed as a new generation among the alive
  ranks (``_collective.on_restarted``; the step's ``reform_group`` rule announces it before any
  ``RequestParams``), so no all-reduce pending in the old group is ever paired with a
  new round's;
* every ACTIVE rank is *awaiting* resync; a JOINING rank gets its ``hello_ack`` again
  (a lost ack would otherwise leave it waiting; the rank drops a duplicate).

The run goes on while ranks are awaiting (the gate may open a round at once, epochs may
be dispatched): nothing the core decides after the restart depends on what it lost,
only on what it knows, and what it learns late is reconciled below. While a rank is
awaiting, ``note_sent`` records the commands this incarnation sends it that its report
may not reflect yet (plans, evals, shutdowns), with their ``command_id``.

``RankResynced`` (the rank's ``Timing.Resync``, sent once when it first hears the new
incarnation, before handling that frame): the rank's own account of what the
coordinator may have lost. First, a report *ahead of the journal* -- a
``last_command_id`` beyond the last command the replayed journal issued
(``ResyncState.journal_end``) -- means the journal lost its tail (a host crash before
its data reached the disk; the service fsyncs before any frame leaves, README
"Faults"): the run fails at once, naming rank, command and journal end, rather than
reconcile against a state older than what the ranks acted on. Otherwise, in this order:

1. its ``folded_step`` beyond the core's is an ack the crash swallowed: the rank applied
   a consensus holding its batches up to that step, so they are committed;
2. the positions the core believes are the rank's and not committed, minus the batches
   it knows or the rank reports as trained, minus what the rank still holds, minus the
   plans sent after its ``last_command_id`` (still in flight to it) were *lost* with a
   plan frame: they are re-sent to the same rank as ``ExtendPartition`` (the ledgers of
   every dispatcher already say the rank owns them; only the message was lost);
3. the reported batches the core never heard of are ingested in step order as if their
   ``BatchDone`` had arrived (a batch outside the rank's assignment is skipped and
   counted, never raised: the event as a whole is legal);
4. finished chunks whose ``Metrics`` the core lacks become ``ChunkDone``s;
5. a throttled rank no open round will release gets an ``Update`` (no plan) -- its
   round died with the old process, or the ``Update`` that ended it was lost;
6. an unanswered eval or a ``Shutdown`` it should have received is sent again (unless
   this incarnation already sent it one the report does not reflect yet).

The lost set is computed before anything is ingested, so a chunk the dispatcher hands
out while ingesting (the rank finished its chunk) is never mistaken for a lost one.
Frames queued by the ranks during the outage are delivered after reconnect; frames of
the old incarnation reach a rank before any of the new one (one connection after the
other), so ``last_command_id`` splits the commands cleanly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

from flodl.wire import pb

from . import _coverage
from ._commands import FINAL_SCHEDULE_ID, Command, Notice, Reply, Send
from ._events import BatchDone, ChunkDone, CoordinatorRestarted, RankResynced
from ._phases import ACTIVE, FINAL_EVAL, JOINING, PENDING, SHUTTING_DOWN, STOPPING
from ._state import CoordinatorState

__all__ = [
    "begin_restart",
    "await_reports",
    "awaited",
    "journal_behind",
    "fold_swallowed_ack",
    "unknown_batches",
    "resend_lost",
    "unknown_chunks",
    "conclude",
    "note_sent",
    "lost_positions",
    "summary",
]

# Batch tuple: (step_count, epoch, offset, samples, batch_ms, data_ms, loss, lr)
# Chunk tuple: (epoch, chunk_seq, batches, samples, avg_loss, epoch_ms,
#               share_complete_ms, compute_only_ms, data_starve_ms)
_PLAN_KINDS = ("start_epoch", "update", "extend_partition", "request_params")  # (the last: a carried window)
_RESEND_KINDS = ("execute_eval", "shutdown", "shutdown_with_save")


# -- range arithmetic ----------------------------------------------------------------------


def _subtract(ranges: list[tuple[int, int]], cuts: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The parts of ``ranges`` (in order) outside every cut."""
    spans = sorted((o, o + n) for o, n in cuts if n > 0)
    out: list[tuple[int, int]] = []
    for off, size in ranges:
        pos, end = off, off + size
        for a, b in spans:
            if b <= pos or a >= end:
                continue
            if a > pos:
                out.append((pos, a - pos))
            pos = max(pos, b)
            if pos >= end:
                break
        if pos < end:
            out.append((pos, end - pos))
    return out


def lost_positions(st: CoordinatorState, ev: RankResynced) -> list[tuple[int, int, int]]:
    """``(epoch, offset, size)`` the core believes are the rank's to train, that are not
    committed, not trained (known or reported), not held, and not in flight to it."""
    cov, d = st.coverage, st.dispatch
    cuts: dict[int, list[tuple[int, int]]] = {}
    for epoch, off, n, _s in cov.pending.get(ev.rank, ()):
        cuts.setdefault(epoch, []).append((off, n))
    for b in ev.batches:
        cuts.setdefault(int(b[1]), []).append((int(b[2]), int(b[3])))
    for epoch, off, n in ev.held:
        cuts.setdefault(int(epoch), []).append((int(off), int(n)))
    for cid, kind, epoch, off, n in st.resync.sent.get(ev.rank, ()):
        if cid > ev.last_command_id and kind in _PLAN_KINDS:
            cuts.setdefault(epoch, []).append((off, n))
    lost: list[tuple[int, int, int]] = []
    for epoch in sorted(d.assigned):
        ec = cov.epochs.get(epoch)
        mine = d.assigned[epoch].get(ev.rank)
        if ec is None or ec.frozen or not mine:
            continue
        rest = _subtract(_coverage.uncommitted(cov, epoch, list(mine)), cuts.get(epoch, []))
        lost.extend((epoch, o, n) for o, n in rest)
    return lost


# -- CoordinatorRestarted ------------------------------------------------------------------
# The step composes the restart: ``begin_restart``, a liveness grace for every addressable
# rank (``_membership.touch``), the open round abandoned (``_averaging.abandon``), the
# collective group due for re-formation (``_collective.on_restarted``), then
# ``await_reports``.


def begin_restart(st: CoordinatorState) -> None:
    rs = st.resync
    rs.restarts += 1
    rs.journal_end = st.next_command_id - 1  # every command the replayed journal issued


def await_reports(
    st: CoordinatorState, ev: CoordinatorRestarted, out: list[Command], abandoned: Optional[int],
    spec: Optional[pb.RunSpec],
) -> None:
    """Every ACTIVE rank is awaiting resync; a JOINING rank gets its ``hello_ack`` again
    (``spec``: the run spec, given when some slot is JOINING)."""
    rs = st.resync
    st.last_beacon = None
    st.sent_since_beacon = set()  # (every rank hears the new incarnation's first beacon)
    alive = st.alive_ranks()
    rs.awaiting = {r: ev.now for r in alive}
    rs.sent = {}
    for rec in st.ranks:
        if rec.phase is JOINING:
            run = spec
            if spec is not None and rec.joined_at is not None:  # admitted into the running world
                run = pb.RunSpec()
                run.CopyFrom(spec)
                run.join_running = True
            out.append(Reply(rec.route, pb.HelloAck(accepted=True, run=run)))
    row = {
        "restart": rs.restarts,
        "cause": ev.cause,
        "at": ev.now,
        "abandoned_cycle": abandoned,
        "awaiting": list(alive),
        "resynced": [],
        "recovered_batches": 0,
        "recovered_chunks": 0,
        "resent_samples": 0,
        "released": [],
    }
    rs.log.append(row)
    out.append(Notice("coordinator_restarted", {k: row[k] for k in ("restart", "abandoned_cycle", "awaiting")}))


# -- RankResynced --------------------------------------------------------------------------
# The step composes the numbered phases of the module doc: ``awaited``, ``journal_behind``
# (0), ``fold_swallowed_ack`` (1), ``lost_positions`` (2, before ingesting),
# ``unknown_batches`` (3, each ingested through the ``BatchDone`` path), ``resend_lost``
# (2), ``unknown_chunks`` (4, each through the ``ChunkDone`` path), ``conclude`` (5, 6).


def _sent_after(st: CoordinatorState, ev: RankResynced, kinds: tuple[str, ...]) -> bool:
    return any(cid > ev.last_command_id and k in kinds for cid, k, *_ in st.resync.sent.get(ev.rank, ()))


def awaited(st: CoordinatorState, ev: RankResynced) -> bool:
    """The report is awaited (else counted, ignored)."""
    if st.ranks[ev.rank].phase is not ACTIVE or ev.rank not in st.resync.awaiting:
        st.count_ignored("Resync not awaited")
        return False
    return True


def journal_behind(st: CoordinatorState, ev: RankResynced, out: list[Command]) -> str:
    """0. The rank heard commands this journal never issued: it lost its tail (a host
    crash before the data reached the disk). Its state is older than what the ranks acted
    on -- whatever it decides now could train samples twice or skip some. Nothing is
    reconciled: returns why the run fails ("" when the journal is not behind)."""
    rs = st.resync
    if rs.journal_end is None or ev.last_command_id <= rs.journal_end:
        return ""
    out.append(Notice("journal_behind", {"rank": ev.rank, "last_command_id": ev.last_command_id,
                                         "journal_end": rs.journal_end}))  # fmt: skip
    return (
        f"rank {ev.rank} reports command {ev.last_command_id} but the journal ends at command "
        f"{rs.journal_end}: the journal lost its tail (was it on a disk without fsync?)"
    )


def fold_swallowed_ack(st: CoordinatorState, ev: RankResynced) -> None:
    """1. An ack the crash swallowed."""
    rec = st.ranks[ev.rank]
    if ev.folded_step > rec.folded_step:
        rec.folded_step = ev.folded_step
        _coverage.commit(st.coverage, ev.rank, ev.folded_step)


def unknown_batches(st: CoordinatorState, ev: RankResynced) -> Iterator[BatchDone]:
    """3. Batch reports the core never got, in step order. A prefix of the outage's frames
    died with the old process while the rest was delivered after the reconnect, so an
    unknown batch may precede known ones: "known" is a step the core holds pending or has
    folded. (A generator: each is ingested before the next is looked at.)"""
    rank, rec = ev.rank, st.ranks[ev.rank]
    known = {s for _e, _o, _n, s in st.coverage.pending.get(rank, ())}
    for b in sorted(ev.batches, key=lambda b: b[0]):
        step_count, epoch, offset, samples, batch_ms, data_ms, loss, lr = b
        if step_count <= rec.folded_step or step_count in known:
            continue
        known.add(step_count)
        yield BatchDone(
            now=ev.now, rank=rank, batch_ms=batch_ms, data_ms=data_ms, step_count=int(step_count),
            loss=loss, samples=int(samples), epoch=int(epoch), offset=int(offset), lr=lr,
        )  # fmt: skip


def resend_lost(st: CoordinatorState, rank: int, lost: list[tuple[int, int, int]], out: list[Command]) -> int:
    """2. What was lost with a plan frame goes again, as ``ExtendPartition``; returns the samples."""
    resent = 0
    for epoch, off, n in lost:
        if st.ranks[rank].phase is not ACTIVE:
            break
        ext = pb.Control.ExtendPartition(epoch=epoch, partition_offset=off, partition_size=n)
        st.send(out, rank, extend_partition=ext)
        resent += n
    return resent


def unknown_chunks(st: CoordinatorState, ev: RankResynced) -> Iterator[ChunkDone]:
    """4. Metrics the core never got (a generator: each is ingested before the next)."""
    rank = ev.rank
    for c in ev.chunks:
        epoch, seq = int(c[0]), int(c[1])
        last = st.metrics.last_aggregated
        if last is not None and epoch <= last:
            continue
        if seq in st.metrics.chunks.get(epoch, {}).get(rank, ()):
            continue
        yield ChunkDone(
            now=ev.now, rank=rank, epoch=epoch, chunk_seq=seq, batches=int(c[2]), samples=int(c[3]),
            avg_loss=c[4], epoch_ms=c[5], share_complete_ms=c[6], compute_only_ms=c[7], data_starve_ms=c[8],
        )  # fmt: skip


def conclude(st: CoordinatorState, ev: RankResynced, out: list[Command], recovered: int, chunks: int,
             resent: int, release_throttle: Callable[[CoordinatorState, int], None]) -> None:  # fmt: skip
    """5. A throttle nothing will lift any more (``release_throttle``: the policy's record
    of it); 6. an eval or a shutdown it should have had; then the rank is resynced (its
    row of the restart log, a notice)."""
    rank, rs = ev.rank, st.resync
    released = False
    if st.ranks[rank].phase is ACTIVE:
        rounds = st.rounds
        if ev.throttled and not (rounds.phase is PENDING and rank in rounds.ranks):
            st.send(out, rank, update=pb.Control.Update(version=rounds.version, cycle=rounds.cycle))
            release_throttle(st, rank)
            released = True
        _resend_owed(st, ev, out)
    del rs.awaiting[rank]
    rs.sent.pop(rank, None)
    if rs.log:
        row = rs.log[-1]
        row["resynced"].append(rank)
        row["recovered_batches"] += recovered
        row["recovered_chunks"] += chunks
        row["resent_samples"] += resent
        if released:
            row["released"].append(rank)
    out.append(
        Notice(
            "rank_resynced",
            {
                "rank": rank,
                "recovered_batches": recovered,
                "recovered_chunks": chunks,
                "resent_samples": resent,
                "released": released,
                "held_samples": sum(int(h[2]) for h in ev.held),
            },
        )
    )


def _resend_owed(st: CoordinatorState, ev: RankResynced, out: list[Command]) -> None:
    rank = ev.rank
    if _sent_after(st, ev, _RESEND_KINDS):
        return  # this incarnation already sent it one, still on its way
    phase = st.run.phase
    if phase is SHUTTING_DOWN or phase is STOPPING:
        why = "completed" if phase is SHUTTING_DOWN else f"stopped: {st.run.stop_reason}"
        st.send(out, rank, shutdown=pb.Control.Shutdown(reason=why))
        return
    fe = st.run.final_eval
    if phase is FINAL_EVAL and fe is not None and not fe.answered and fe.target == rank:
        x = pb.Control.ExecuteEval(
            schedule_id=FINAL_SCHEDULE_ID, epoch=st.config.num_epochs, target_rank=rank, final=True
        )
        st.send(out, rank, execute_eval=x)
    for sid, (epoch, target) in sorted(st.roles.pending_evals.items()):
        if target == rank:
            x = pb.Control.ExecuteEval(schedule_id=sid, epoch=epoch, target_rank=rank)
            st.send(out, rank, execute_eval=x)


# -- bookkeeping after every step ----------------------------------------------------------


def note_sent(st: CoordinatorState, out: list[Command]) -> None:
    """Record what this incarnation sends ranks still awaiting resync (their reports may
    not reflect it yet); forget ranks that left or died meanwhile."""
    rs = st.resync
    if not rs.awaiting:
        return
    for r in [r for r in rs.awaiting if st.ranks[r].phase is not ACTIVE]:
        del rs.awaiting[r]
        rs.sent.pop(r, None)
    for c in out:
        if not isinstance(c, Send) or c.rank not in rs.awaiting:
            continue
        kind, ctl = c.kind, c.control
        if kind == "start_epoch":
            p = ctl.start_epoch.plan
        elif kind == "update" and ctl.update.HasField("next_plan"):
            p = ctl.update.next_plan
        elif kind == "extend_partition":
            p = ctl.extend_partition
        elif kind == "request_params" and ctl.request_params.HasField("next_plan"):  # protocol 1.2
            p = ctl.request_params.next_plan
        elif kind == "request_params" and ctl.request_params.HasField("extend"):
            p = ctl.request_params.extend
        elif kind in _RESEND_KINDS:
            p = None
        else:
            continue
        rng = (p.epoch, p.partition_offset, p.partition_size) if p is not None else (0, 0, 0)
        rs.sent.setdefault(c.rank, []).append((ctl.command_id, kind, *rng))


def summary(st: CoordinatorState) -> list[dict[str, Any]]:
    """One row per restart: when, the round abandoned, who resynced, what was recovered."""
    return [
        dict(row, awaiting=list(row["awaiting"]), resynced=list(row["resynced"]), released=list(row["released"]))
        for row in st.resync.log
    ]

