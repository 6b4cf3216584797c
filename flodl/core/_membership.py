"""Membership and liveness: who is in the run, and who is still alive.

Theory of operation
-------------------
Each rank slot has a phase. The moves are a table (``_phases.MEMBERSHIP``); ``transition``
refuses any move not in it with a ``LocalViolation`` naming the phase and trigger::

    VACANT  --admit-->  JOINING  --form-->  ACTIVE
    JOINING --lost/leave--> VACANT          (before the world forms the slot reopens)
    ACTIVE  --lost-->   DEAD                (silence, crash, unroutable)
    ACTIVE  --leave-->  LEFT                (clean exit)

A DEAD or LEFT slot is never addressed again (``CoordinatorState.send`` refuses), and
the shell is told once with ``ForgetRank``.

Elastic membership (issue 12). While TRAINING (bus plane), a hello for a VACANT slot
(capacity the world formed without) or a DEAD / LEFT one (a restarted rank, or another
host taking the slot) is admitted: JOINING, ``joined_at`` set, and its ``RunSpec`` says
``join_running``. A joiner gets no work and is in no round. At the next averaging
boundary (no round open, a consensus exists: ``seed_due``) the step asks the shell to
send it the latest consensus (``SeedJoiner``); the rank overwrites its parameters (its
optimizer state is fresh: it was just built) and confirms (``JoinerSeeded``), and only
then is it ACTIVE (``on_seeded``): the dispatcher's ``on_join`` hands it work, and the
next round counts it. On the collective plane the coordinator holds no consensus: the
joiner is seeded by a broadcast from a member of a new generation that includes it
(``flodl.core._collective``), asked for at the same boundary. A live rank id (JOINING or ACTIVE under another route or
incarnation) is still refused, and so is the very process that left.

Unpinned hellos (issue 12). An agent started without ``--rank-offset`` pins no rank: its
processes say hello with ``rank`` UNPINNED, naming their agent (its token digest) and
their index among its processes (``local_rank``). ``unpinned_slot`` gives such a hello a
slot -- its own again on a retransmit, else the lowest free one (VACANT before the world
forms; VACANT, DEAD or LEFT while training, a refill as above), preferring the slot its
agent's same process held before (a restart keeps its slot) -- and the hello then goes
through admission as if it had named that rank: a live rank is never taken, the very
process that left is refused, a cohort conflict is deferred (its vote under the slot it
would take). The ack names the slot (``HelloAck.rank``). The choice is a function of the
journaled hellos, so a replay gives every process the same slot.

Admission (``refusal``) checks, in this order, each refusal naming its cause:
rank range, world size, rank already admitted (another route or incarnation while the
rank is alive) or already gone, model signature (the first admitted rank's), dataset
length (the cohort's, or ``config.total_samples`` when > 0), dataset length >= 1.
A hello from the same route and incarnation as the admitted rank is a retransmit and
is answered ``accepted`` again (idempotent).

Liveness: every frame from a rank refreshes ``last_seen`` (monotone: a replayed old
frame cannot move it back). On ``Tick``, an addressable rank silent for *strictly* more
than ``liveness_timeout_s`` is lost with reason ``"heartbeat stale (>Ts)"``. The
coordinator's own beacon (``CoordHeartbeat``) goes to every addressable rank at most
once per ``heartbeat_interval_s``; JOINING ranks get it too, so a rank waiting for a
slow world does not time the coordinator out.

An agent's exit report: a signal or a non-zero code is a loss naming it; code 0 is a
loss ("exited without Shutdown") unless Shutdown was already sent (SHUTTING_DOWN or
STOPPING), when it is a clean leave -- the agent's report travels on another socket and
can overtake the rank's own ``RankExiting``.

This module decides *that* a rank is gone; ``_step.forget_rank`` applies the
consequences everywhere (coverage, dispatch, averaging).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Optional

from flodl.wire import pb

from . import _coverage, _formation
from ._commands import Command, ForgetRank, Notice, Reply, SeedJoiner
from ._events import UNPINNED, RankHello
from ._phases import (
    ACTIVE,
    DEAD,
    FORMING,
    IDLE,
    JOINING,
    LEFT,
    MEMBERSHIP,
    SHUTTING_DOWN,
    STOPPING,
    TRAINING,
    VACANT,
    next_phase,
)
from ._state import CoordinatorState, RankRecord

__all__ = [
    "transition",
    "refusal",
    "on_hello",
    "touch",
    "stale_ranks",
    "beacon",
    "exit_reason",
    "run_spec",
    "cohort_conflict",
    "on_slot_reopened",
    "refuse_deferred",
    "elastic_summary",
    "seed_due",
    "ask_seeds",
    "on_seeded",
    "reseed_after_restart",
    "stale_exit_report",
    "unpinned_slot",
]

_POLICY = {"sync": pb.POLICY_SYNC, "cadence": pb.POLICY_CADENCE, "async": pb.POLICY_ASYNC}
_PLANE = {"bus": pb.PLANE_BUS, "collective": pb.PLANE_COLLECTIVE}


def transition(rec: RankRecord, trigger: str) -> None:
    new = MEMBERSHIP.get((rec.phase, trigger))  # (a world forms N of these: no name unless it fails)
    rec.phase = new if new is not None else next_phase(MEMBERSHIP, rec.phase, trigger, f"rank {rec.rank}")


def form_all(st: CoordinatorState) -> None:
    """The world forms: every JOINING slot moves on "form" (ACTIVE), all at once -- the
    records written quietly and the rank index told once (``RankIndex.moved``), the
    same views as N ``transition`` calls at a fraction of their cost."""
    joining = sorted(st.index.phases[JOINING])
    if not joining:
        return
    new = next_phase(MEMBERSHIP, JOINING, "form", "the forming world")
    recs = [st.ranks[r] for r in joining]
    for rec in recs:
        rec.set_quietly("phase", new)
    st.index.moved(recs, JOINING)


def _sig(b: bytes) -> str:
    return b.hex()[:12] or "<empty>"


def refusal(st: CoordinatorState, ev: RankHello) -> Optional[str]:
    """Why this hello must be refused, or None to admit it (or re-ack a retransmit)."""
    cfg = st.config
    if st.run.phase is not FORMING and st.run.phase is not TRAINING:
        return f"run is not admitting ranks ({st.run.phase!r})"
    if not 0 <= ev.rank < cfg.world_size:
        return f"rank {ev.rank} out of range [0, {cfg.world_size})"
    if not cfg.elastic and ev.world_size != cfg.world_size:
        return f"world_size {ev.world_size} differs from the coordinator's {cfg.world_size}"
    if cfg.elastic and not cfg.quorum <= ev.world_size <= cfg.world_size:
        return (
            f"world_size {ev.world_size} is outside the coordinator's elastic range "
            f"[{cfg.quorum}, {cfg.world_size}] (min_ranks, world_size)"
        )
    rec = st.ranks[ev.rank]
    if rec.phase is JOINING or rec.phase is ACTIVE:
        if rec.route != ev.route or rec.incarnation != ev.incarnation:
            return (
                f"rank {ev.rank} already admitted from another route or incarnation"
                f" (incarnation {rec.incarnation}, host {rec.host or '?'})"
            )
        return None  # a retransmit of the admitted hello
    if (rec.phase is DEAD or rec.phase is LEFT) and st.run.phase is not TRAINING:
        return f"rank {ev.rank} already left the run ({rec.phase!r}: {rec.reason}); a slot is refilled only while training"
    if (rec.phase is DEAD or rec.phase is LEFT) and rec.incarnation == ev.incarnation and rec.route == ev.route:
        return f"rank {ev.rank}: this process already left the run ({rec.phase!r}: {rec.reason}); a new process may rejoin"
    if cfg.model_signature and ev.model_sig != cfg.model_signature:
        return (
            f"model signature {_sig(ev.model_sig)} differs from the configured model_signature "
            f"{_sig(cfg.model_signature)} (another model or architecture)"
        )
    if cfg.total_samples > 0 and ev.dataset_len != cfg.total_samples:
        return f"dataset_len {ev.dataset_len} differs from total_samples {cfg.total_samples}"
    if ev.dataset_len < 1:
        return f"dataset_len {ev.dataset_len} < 1"
    return cohort_conflict(st, ev)


def cohort_conflict(st: CoordinatorState, ev: RankHello) -> Optional[str]:
    """Why this hello does not fit the cohort the admitted ranks set (model, dataset)."""
    if st.cohort_sig is not None and ev.model_sig != st.cohort_sig:
        return f"model signature differs from the cohort's ({_sig(ev.model_sig)} vs {_sig(st.cohort_sig)})"
    if st.cohort_len is not None and ev.dataset_len != st.cohort_len:
        return f"dataset_len {ev.dataset_len} differs from the cohort's {st.cohort_len}"
    return None


def _cohort_key(st: CoordinatorState, ev: RankHello) -> tuple:
    # What decides the cohort when nothing pins it: the model, and the dataset length
    # unless total_samples fixes that.
    return (ev.model_sig, ev.dataset_len if st.config.total_samples == 0 else 0)


def run_spec(st: CoordinatorState, dataset_len: int) -> pb.RunSpec:
    cfg = st.config
    return pb.RunSpec(
        world_size=cfg.world_size,
        total_samples=cfg.total_samples or st.cohort_len or dataset_len,
        batch_size=cfg.batch_size,
        num_epochs=cfg.num_epochs,
        seed=cfg.seed,
        policy=_POLICY[cfg.policy],
        plane=_PLANE[cfg.plane],
        gamma=cfg.gamma,
        easgd_alpha=cfg.easgd_alpha,
        bf16_wire=cfg.bf16_wire,
        heartbeat_interval_s=cfg.heartbeat_interval_s,
        liveness_timeout_s=cfg.liveness_timeout_s,
        batch_report_ms=cfg.report_interval_ms,
        report_batches=cfg.report_batches_cap,  # (0 unless stretched)
        report_floor_ms=cfg.batch_report_ms,
        batches_in_metrics=True,  # protocol 1.3: the shell reads a chunk's carried batches (``chunk_events``)
        start_epoch=0,
        global_step=st.rounds.global_step,  # the run's progress so far: LR schedules start there
        samples_committed=_coverage.committed_samples(st.coverage),
    )


def _free(st: CoordinatorState, rec: RankRecord) -> bool:
    """A slot a new process may take: VACANT, or (while training) DEAD or LEFT: a refill."""
    return rec.phase is VACANT or (st.run.phase is TRAINING and (rec.phase is DEAD or rec.phase is LEFT))


def unpinned_slot(st: CoordinatorState, ev: RankHello) -> Optional[int]:
    """The slot an unpinned hello takes (None: every slot is alive), first hit wins:

    1. the slot admitted on its route and incarnation (a retransmit gets the same slot),
       or the one this very process left (``refusal`` then refuses it by name);
    2. the slot its own deferred hello voted for, while it is still free;
    3. the slot its agent's same process slot (``agent``, ``local_rank``) took last, if
       free: a process restarted under ``--max-restarts`` keeps its slot;
    4. the lowest free slot; before the world forms, one no other route's deferred hello
       votes for, if there is one (two deferred unpinned hellos are two voters)."""
    for rec in st.ranks:
        if rec.route and rec.route == ev.route and rec.incarnation == ev.incarnation:
            return rec.rank
    for rank, (_, route) in st.run.cohort_votes.items():
        if route == ev.route and _free(st, st.ranks[rank]):
            return rank
    own = st.unpinned_slot_of(ev.agent, ev.local_rank)
    if own is not None and _free(st, st.ranks[own]):
        return own
    voted = {r for r, (_, route) in st.run.cohort_votes.items() if route != ev.route}
    free = [rec.rank for rec in st.ranks if _free(st, rec)]
    return next((r for r in free if r not in voted), free[0] if free else None)


def on_hello(st: CoordinatorState, ev: RankHello, out: list[Command]) -> None:
    """Admit, re-ack, defer or refuse. World formation is ``_run``'s move, not ours.
    An unpinned hello (``rank`` UNPINNED) is placed first (``unpinned_slot``)."""
    if ev.rank == UNPINNED:
        slot = unpinned_slot(st, ev)
        if slot is None:  # every slot is alive, or the run admits nobody
            admitting = st.run.phase is FORMING or st.run.phase is TRAINING
            why = f"no free slot: all {len(st.ranks)} ranks of the world are alive" if admitting else (
                f"run is not admitting ranks ({st.run.phase!r})")  # fmt: skip
            out.append(Reply(ev.route, pb.HelloAck(accepted=False, reason=why)))
            return
        ev = replace(ev, rank=slot)
    reason = refusal(st, ev)
    if reason is not None and _deferred(st, ev, reason, out):
        return
    if reason is not None:
        if st.run.phase is FORMING and 0 <= ev.rank < st.config.world_size:
            st.run.not_admitted[ev.rank] = f"refused: {reason}"
        out.append(Reply(ev.route, pb.HelloAck(accepted=False, reason=reason)))
        return
    rec = st.ranks[ev.rank]
    if rec.phase is VACANT or rec.phase is DEAD or rec.phase is LEFT:
        # A refill: the slot a DEAD or LEFT rank held -- or a refill's joiner that was lost
        # before its seed (JOINING --lost--> VACANT keeps ``rec.refill``): its next process
        # is the same restart, one try later.
        refill = rec.phase is not VACANT or rec.refill
        transition(rec, "admit")
        rec.route, rec.incarnation = ev.route, ev.incarnation
        rec.host, rec.pid, rec.reason = ev.host, ev.pid, ""
        rec.restart_count = ev.restart_count
        rec.last_seen = ev.now
        if ev.agent:  # an unpinned process: it leaves any slot it held before for this one
            for other in st.ranks:
                if other.agent == ev.agent and other.local_rank == ev.local_rank:
                    other.agent, other.local_rank = "", -1
        rec.agent, rec.local_rank = ev.agent, ev.local_rank
        if st.cohort_sig is None:
            st.cohort_sig, st.cohort_len = ev.model_sig, ev.dataset_len
        st.run.not_admitted.pop(ev.rank, None)
        st.run.cohort_votes.pop(ev.rank, None)
        _formation.on_admitted(st, ev.rank)
        if st.run.phase is TRAINING:
            rec.joined_at, rec.seeding, rec.refill = ev.now, False, refill
            out.append(Notice("rank_admitted_running", {"rank": ev.rank, "host": ev.host, "refill": refill}))
    else:
        st.count_ignored("hello retransmit")
        touch(st, ev.rank, ev.now)
    spec = run_spec(st, ev.dataset_len)
    spec.join_running = rec.joined_at is not None and rec.phase is JOINING
    out.append(Reply(ev.route, pb.HelloAck(accepted=True, run=spec, rank=ev.rank)))


# -- joining a running world ---------------------------------------------------------------


def seed_due(st: CoordinatorState) -> tuple[bool, str]:
    """A rank admitted into the running world waits for its seed: asked at an averaging
    boundary (no round open) once a consensus exists (a round finished), so it starts
    from the latest consensus, never from the initial parameters the others left."""
    if st.run.phase is not TRAINING or not st.index.phases[JOINING]:
        return False, ""  # asked on every step: only the (few) JOINING ranks are looked at
    waiting = _unseeded_joiners(st)
    if not waiting:
        return False, ""
    if st.rounds.phase is not IDLE:
        return False, f"joiner(s) {waiting}: seeded at the next averaging boundary (round {st.rounds.cycle} open)"
    if st.collective is not None:  # the seed is a member's parameters, not a consensus
        return True, f"seed joiner(s) {waiting} by a broadcast in a new collective generation"
    if st.rounds.version == 0:
        return False, f"joiner(s) {waiting}: seeded once the first consensus exists"
    return True, f"seed joiner(s) {waiting} with the consensus of round {st.rounds.cycle}"


def ask_seeds(st: CoordinatorState, out: list[Command]) -> list[int]:
    """Mark every joiner not asked yet ``seeding``; returns them. On the bus plane each
    gets ``SeedJoiner`` (the shell sends the consensus); on the collective plane the
    new generation's broadcast seeds them (``_collective.include``)."""
    asked = _unseeded_joiners(st)
    for rank in asked:
        st.ranks[rank].seeding = True
        if st.collective is None:
            out.append(SeedJoiner(rank))
    return asked


def _unseeded_joiners(st: CoordinatorState) -> list[int]:
    """Ranks admitted into the running world whose seed was not asked yet, ascending
    (only the JOINING ranks are looked at: ``seed_due`` asks on every step)."""
    joining = sorted(st.index.phases[JOINING])
    return [r for r in joining if st.ranks[r].joined_at is not None and not st.ranks[r].seeding]


def on_seeded(st: CoordinatorState, rank: int, cycle: int) -> bool:
    """The joiner holds the seed (``JoinerSeeded``): it is a member now. False (counted)
    when this rank is not a seeded joiner. Its step counters restart with the process."""
    rec = st.ranks[rank]
    if rec.phase is not JOINING or not rec.seeding:
        st.count_ignored("JoinerSeeded from a rank that was not asked")
        return False
    transition(rec, "join")
    st.run.joins.append(
        {"rank": rank, "host": rec.host, "admitted_at": rec.joined_at, "joined_at": st.now, "cycle": cycle,
         "refill": rec.refill, "restart_count": rec.restart_count}  # fmt: skip
    )
    rec.seeding, rec.joined_at = False, None
    rec.last_step = rec.folded_step = 0  # a new process counts its steps from 0
    return True


def reseed_after_restart(st: CoordinatorState) -> None:
    """The coordinator restarted: a seed in flight may have died with it; ask again.
    (Collective plane: the members hold the seed; the generation the restart re-forms
    includes the joiners and broadcasts it again.)"""
    if st.collective is not None:
        return
    for rec in st.ranks:
        if rec.phase is JOINING and rec.joined_at is not None:
            rec.seeding = False


def _world_mismatch(cfg: Any, ev: RankHello) -> bool:
    if cfg.elastic:
        return not cfg.quorum <= ev.world_size <= cfg.world_size
    return ev.world_size != cfg.world_size


def _deferred(st: CoordinatorState, ev: RankHello, reason: str, out: list[Command]) -> bool:
    """Squatting: before the world forms, a hello is not refused for what an earlier
    hello claimed -- a slot another process holds, or the cohort (model, dataset) the
    first admitted rank set -- or one early foreign hello would get every real rank
    refused for good. It is answered ``deferred`` (the rank keeps resending its hello)
    and counts as a vote for its own cohort; once the voters (distinct slots) outnumber
    the ranks holding the cohort, the holders are evicted, the cohort is released and
    this hello is admitted. A holder that goes silent loses its slot to liveness. A
    configured ``model_signature`` pins the cohort instead."""
    if st.run.phase is not FORMING or not 0 <= ev.rank < len(st.ranks) or _world_mismatch(st.config, ev):
        return False
    rec = st.ranks[ev.rank]
    slot_taken = rec.phase is JOINING and (rec.route != ev.route or rec.incarnation != ev.incarnation)
    conflict = cohort_conflict(st, ev)
    if not slot_taken and (conflict is None or conflict != reason):
        return False
    key = _cohort_key(st, ev)
    st.run.cohort_votes[ev.rank] = (key, ev.route)
    st.run.not_admitted[ev.rank] = f"hello deferred: {reason}"
    holders = [r.rank for r in st.ranks if r.phase is JOINING]
    voters = sum(1 for k, _ in st.run.cohort_votes.values() if k == key) if conflict else 0
    if conflict is None or voters <= len(holders):
        tally = f", {voters} vs {len(holders)} admitted" if conflict else ""
        why = f"{reason}; waiting for the world to form (deferred, not refused{tally})"
        out.append(Reply(ev.route, pb.HelloAck(accepted=False, deferred=True, reason=why)))
        out.append(Notice("hello_deferred", {"rank": ev.rank, "reason": reason, "voters": voters, "holders": len(holders)}))
        return True
    why = f"evicted before the world formed: {voters} rank(s) present another model/dataset ({conflict})"
    for r in holders:
        h = st.ranks[r]
        st.send_last_word(out, r, shutdown=pb.Control.Shutdown(reason=why))  # (its route is cleared next)
        transition(h, "lost")
        h.reason = why
        h.route, h.incarnation = (), 0
        out.append(ForgetRank(r, why))
        st.run.not_admitted[r] = why
        st.run.evicted.add(r)  # its process's exit report is no loss (``_formation``)
    out.append(Notice("cohort_evicted", {"ranks": holders, "voters": voters, "reason": conflict}))
    st.cohort_sig = st.cohort_len = None
    on_hello(st, ev, out)  # the cohort (and maybe this slot) is free now: admit this one
    return True


def refuse_deferred(st: CoordinatorState, reason: str, out: list[Command]) -> None:
    """The run ends before forming: the deferred hellos get their refusal at last."""
    for rank, (_, route) in sorted(st.run.cohort_votes.items()):
        out.append(Reply(route, pb.HelloAck(accepted=False, reason=reason)))
    st.run.cohort_votes.clear()


def on_slot_reopened(st: CoordinatorState, rank: int, reason: str) -> None:
    """A JOINING rank was lost or left before the world formed: note why, and release
    the cohort (model, dataset) once no admitted rank holds it -- a squatter that
    vanishes takes its claim with it."""
    st.run.not_admitted[rank] = f"admitted, then lost before the world formed: {reason}"
    if not st.index.addressable_count():
        st.cohort_sig = st.cohort_len = None


def touch(st: CoordinatorState, rank: int, now: float) -> None:
    rec = st.ranks[rank]
    if now > rec.last_seen:
        rec.last_seen = now


def stale_ranks(st: CoordinatorState, now: float) -> list[tuple[int, str]]:
    """Addressable ranks silent for strictly more than the liveness timeout.

    The rank index's ``seen_floor`` bounds every addressable rank's ``last_seen`` from
    below: while it is within the timeout nobody can be stale and no rank is looked at;
    a look rebuilds the bound (so a Tick walks the ranks about once per timeout)."""
    t, index = st.config.liveness_timeout_s, st.index
    if index.seen_floor is not None and now - index.seen_floor <= t:
        return []
    ranks = index.addressable()
    index.seen_floor = min((st.ranks[r].last_seen for r in ranks), default=None)
    return [(r, f"heartbeat stale (>{t:g}s)") for r in ranks if now - st.ranks[r].last_seen > t]


# A liveness timeout of at least this many heartbeat intervals lets the beacon skip the
# ranks that were sent a command since the last one (at most two intervals of silence).
BEACON_SKIP_LIVENESS = 3.0


def beacon(st: CoordinatorState, now: float, out: list[Command]) -> None:
    """``CoordHeartbeat`` to every addressable rank, at most once per interval.

    Once the run ends (SHUTTING_DOWN, STOPPING) every addressable rank was sent its
    Shutdown (a rank admitted then is told at once), and exits on it; its process (a
    generator's sockets, an agent's host) may be gone before its exit is stepped: a
    1,024-rank run whose end took 2-3 s reported 211-884 beacons ``send_host_unreachable``
    in ``dropped_frames`` (an alert in its status) and forgot those ranks as lost. So then
    only the ranks awaiting resync hear it: a restarted coordinator's Shutdowns may have
    died with the old process, and the beacon is what tells those ranks of the new
    incarnation (their resync report brings the Shutdown again)."""
    if st.last_beacon is not None and now - st.last_beacon < st.config.heartbeat_interval_s:
        return  # before listing the targets: a Tick that beacons nothing costs nothing
    ending, awaiting = st.run.phase is SHUTTING_DOWN or st.run.phase is STOPPING, st.resync.awaiting
    if ending and not awaiting:
        return
    targets = st.addressable_ranks()
    if ending:
        targets = [r for r in targets if r in awaiting]
    if not targets:
        return
    heard = st.sent_since_beacon
    if heard and st.config.liveness_timeout_s >= BEACON_SKIP_LIVENESS * st.config.heartbeat_interval_s:
        # Every frame is liveness to a rank: one sent a command since the last beacon
        # heard the coordinator within the interval, and goes without (a paced 1,024-rank
        # run: a seventh of the frames the coordinator sent, each second's in one burst).
        # It hears something within two intervals; a timeout that tight beacons everyone.
        targets = [r for r in targets if r not in heard or r in awaiting]
    st.last_beacon = now
    if targets:
        st.beats += 1
        st.send_built_each(out, targets, "coord_heartbeat", _beat, (st.beats,))  # built when sent
    st.sent_since_beacon = set()  # (the beacon itself is no other traffic)


def _beat(ctl: pb.Control, beat: int) -> None:
    ctl.coord_heartbeat.beat = beat


def stale_exit_report(st: CoordinatorState, rank: int, restart_count: int) -> bool:
    """An agent's exit report of an earlier process of the rank than the one admitted now
    (the report and the new process's hello travel on different sockets): ignored, counted."""
    if restart_count < st.ranks[rank].restart_count:
        st.count_ignored("exit report of an earlier process of the rank")
        return True
    return False


def exit_reason(st: CoordinatorState, rank: int, code: int) -> tuple[str, str]:
    """(trigger, reason) for an agent's exit report of an addressable rank."""
    if code < 0:
        return "lost", f"killed by signal {-code}"
    if code > 0:
        return "lost", f"exited with code {code}"
    if st.run.phase is SHUTTING_DOWN or st.run.phase is STOPPING:
        return "leave", "exited after Shutdown"
    return "lost", "exited without Shutdown (code 0)"


def elastic_summary(st: CoordinatorState) -> dict[str, Any]:
    """The run summary's ``elastic`` block: the range, who formed the world, who never came."""
    return {
        "min_ranks": st.config.quorum,
        "max_ranks": len(st.ranks),
        "formed_with": list(st.run.formed_with),
        "vacant": [rec.rank for rec in st.ranks if rec.phase is VACANT],
        "joins": [dict(j) for j in st.run.joins],
    }
