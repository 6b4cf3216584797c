"""The collective data plane, coordinator side: who forms which process group, when.

Theory of operation
-------------------
With ``plane = "collective"`` the ranks average by all-reducing among themselves
(``torch.distributed``; gloo on CPU, NCCL on GPU). The coordinator owns no tensor and
no torch: it only orchestrates. This module is the whole of that orchestration; the
averaging *rounds* (when to reduce, who must ack, what an ack commits) stay exactly
``_averaging``'s (and the policy's), unchanged from the bus plane.

A **generation** is one process group: a set of members (the ACTIVE global ranks),
each with a dense rank ``new_rank`` = its index among them, and one store host with
``new_rank`` 0: normally the lowest member, so the dense order is ascending (see below
for a store host that fails). The coordinator cannot host the
rendezvous store itself (it is torch-free), so a generation forms in two steps::

    bump:        generation += 1; members = the ACTIVE ranks
                 -> Rendezvous{generation, store_addr="", new_rank, new_world_size,
                               backend, timeout_s}            to every member
    store host:  starts (or reuses) a TCPStore, answers StoreReady{generation, addr}
    on it:       -> Rendezvous{generation, store_addr=addr, ...} to every member
    members:     build a new process group on PrefixStore("flodl/g<generation>", store)

The first step goes to *every* member, not only to the store host: it is how a member
learns that the generation changed, and the rank binds each ``RequestParams`` to the
latest generation announced before it (ZeroMQ keeps one peer's frames in order, and the
core never sends a ``RequestParams`` of generation g before announcing g). So all
members agree on which group a cycle's all-reduce belongs to without the cycle naming
it, and an all-reduce pending in an older generation is abandoned the moment a newer one
is announced -- no waiting for a timeout when a peer is known to be gone.

When the group is re-formed (``due``/``announce``: the ``reform_group`` rule of the step's fixed point, before the
averaging gate so the announcement precedes any ``RequestParams``), during TRAINING:

* the world formed (generation 0 -> 1);
* the ACTIVE set differs from the generation's members (a death or a clean leave);
* a member reported ``CollectiveFailed`` for the current generation (its group broke:
  a formation or all-reduce timeout, a peer's connection closed before the coordinator
  heard of that peer's death). The members stay the same; only the generation moves;
* the coordinator restarted on its journal (``on_restarted``, from ``_resync``): the
  open round was abandoned, and a member may still have an all-reduce pending in the old
  group for it -- or for a cycle whose ``RequestParams`` died with the old process and
  that its peers will never join. Reusing the group would pair that op with the peers'
  next one (gloo matches collectives by order, not by cycle: a silent mix of two
  rounds). So the alive ranks re-form as a new generation, from a known state: every
  member retires everything of the old one on the announcement (the rank's resync has
  already dropped its pending work). The event is journaled, so a replay re-forms too.

A ``StoreReady`` counts only for the current generation, from its store host, before the
address is known, while every member is still ACTIVE (else a re-formation is due and
``announce`` makes it); anything else is stale and ignored (counted). A
``CollectiveFailed`` of an older generation is stale too: that group is already gone.

A store host that dies before answering is just a death: the next generation has
another lowest member, which becomes the store host. A store host that does not answer
within ``collective_timeout_s``, or whose generation fails to *form* (a
``CollectiveFailed`` with cycle 0: the store would not start, or members could not reach
it), is *tried*: the next generation's store host is the first member not tried yet
(it takes ``new_rank`` 0; the others follow in ascending order), as the reference's
NCCL re-rendezvous does with its UID generator (§9.5). Every member tried without a
group forming is exhaustion: the run ends (``ShutdownWithSave``), loudly, rather than
training on without ever averaging. A re-formation for any other reason (a death, an
all-reduce failure) starts a fresh tried list.

Joining a running world (issue 12). A rank admitted while training (``_membership``)
waits, JOINING, for the next averaging boundary; there the step's ``seed_joiners`` rule
marks it ``seeding`` and ``include`` makes a re-formation due. The new generation's
members are the ACTIVE ranks *and* those joiners (``cs.joiners``); its store host is an
ACTIVE rank (``new_rank`` 0), and its ``Rendezvous`` names the joiners
(``seed_ranks``): once the group forms, its first collective is a broadcast from
``new_rank`` 0 of that rank's parameters and f32 buffers. A joiner loads it and answers
``Timing.seeded`` (``JoinerSeeded``): only then is it ACTIVE (``on_seeded``) and the
dispatcher gives it work. No round opens while the generation has a joiner left
(``seeding``): every member's next all-reduce would wait for a rank that is not in the
round. A joiner lost before it is seeded re-forms the group without it
(``on_joiner_gone``); a member lost during the broadcast re-forms it with the joiners
again (the ACTIVE set changed). A failed broadcast (``CollectiveFailed.seeding``) re-forms
the same members without blaming the store host; ``SEED_ATTEMPTS`` failures in a row
drop the joiners (``joiners_to_drop``: shut down, the reason naming the fix), so a
joiner that cannot be reached never stops the members averaging. After a coordinator
restart the joiners stay ``seeding``: the generation the restart re-forms seeds them.

What a failed or abandoned round means for coverage is the rank's business
(``flodl_worker.collective``): it keeps its parameters and credit and acks the cycle
with its last folded step, committing nothing new, so the round completes and the dead
rank's uncommitted samples go back to the survivors exactly as on the bus.
"""

from __future__ import annotations

from typing import Any

from flodl.wire import pb

from ._commands import Command, Notice
from ._config import CoreConfig
from ._events import CollectiveFailed, StoreReady
from ._phases import ACTIVE, JOINING, TRAINING
from ._state import CollectiveState, CoordinatorState  # CollectiveState re-exported (the records live in _state)

__all__ = [
    "CollectiveState",
    "STORE_PREFIX",
    "setup",
    "due",
    "announce",
    "on_store_ready",
    "on_failed",
    "on_restarted",
    "include",
    "on_seeded",
    "on_joiner_gone",
    "joiners_to_drop",
    "seeding",
    "SEED_ATTEMPTS",
    "summary",
]

# Members build their group on PrefixStore(f"{STORE_PREFIX}{generation}", store): every
# generation has its own key space on a store host that may serve several.
STORE_PREFIX = "flodl/g"

# Seed broadcasts that may fail in a row before the joiners are dropped (module doc).
SEED_ATTEMPTS = 2


def setup(st: CoordinatorState) -> None:
    """``initial_state``: the collective plane gets its state; the bus plane none."""
    st.collective = CollectiveState() if st.config.plane == "collective" else None


def _rendezvous(st: CoordinatorState, cs: CollectiveState, out: list[Command]) -> None:
    size = len(cs.members)
    for i, r in enumerate(cs.members):
        msg = pb.Control.Rendezvous(
            store_addr=cs.store_addr,
            generation=cs.generation,
            new_rank=i,
            new_world_size=size,
            backend=st.config.collective_backend,
            timeout_s=st.config.collective_timeout_s,
            seed_ranks=cs.joiners,
            seed_cycle=st.rounds.cycle if cs.joiners else 0,
        )
        st.send(out, r, rendezvous=msg)


def _due(st: CoordinatorState, cs: CollectiveState) -> tuple[str, bool]:
    """(why the group must be re-formed now, whether its store host is to blame);
    ("", False) when it need not be. The members are compared with the ACTIVE set only
    once that set changed since they were chosen (``members_version``): asked on every
    event, this must not walk the world."""
    if cs.generation == 0:
        return "world formed", False
    if cs.members_version != st.index.alive_version and set(st.index.alive()) | set(cs.joiners) != set(cs.members):
        gone = sorted(set(cs.members) - set(st.index.alive()) - set(cs.joiners))
        return (f"rank(s) {gone} gone" if gone else "membership changed"), False
    if cs.reform_reason:
        return cs.reform_reason, cs.host_failed
    if not cs.store_addr and st.now - cs.announced_at > st.config.collective_timeout_s:
        return f"store host rank {cs.store_host} did not answer within {st.config.collective_timeout_s:g}s", True
    return "", False


def due(st: CoordinatorState) -> tuple[bool, str]:
    """Whether a new generation is due now, and why (the step's ``reform_group`` rule)."""
    cs = st.collective
    if cs is None:
        return False, "bus plane"
    if st.run.phase is not TRAINING:
        return False, f"run is {st.run.phase!r}"
    if cs.exhausted:
        return False, "exhausted"
    if not st.alive_count():
        return False, "no active rank"  # the step's ``fail`` rule ends the run
    why, _ = _due(st, cs)
    return (True, why) if why else (False, f"generation {cs.generation} stands")


def announce(st: CoordinatorState, out: list[Command]) -> None:
    """Announce the generation that ``due`` says is due. With no member left to try as
    the store host, ``cs.exhausted`` says why instead (the step's ``fail`` rule ends the
    run, loudly, rather than training on without ever averaging)."""
    cs = st.collective
    assert cs is not None
    alive = tuple(st.alive_ranks())
    joiners = tuple(r for r in st.addressable_ranks() if st.ranks[r].phase is JOINING and st.ranks[r].seeding)
    why, blame_host = _due(st, cs)
    if blame_host:
        cs.tried += (cs.store_host,)  # type: ignore[operator]  # set once a generation was announced
    else:
        cs.tried = ()  # a new membership (or a group that had formed): every member may host
    cs.reform_reason, cs.host_failed = "", False
    candidates = [r for r in alive if r not in cs.tried]  # a joiner has no parameters to seed from
    if not candidates:
        cs.exhausted = f"collective rendezvous exhausted: no store host among {list(alive)} formed a group (last: {why})"
        out.append(Notice("collective_exhausted", {"generation": cs.generation, "tried": list(cs.tried)}))
        return
    host = candidates[0]
    if cs.generation > 0:
        cs.reforms += 1
    cs.generation += 1
    cs.members = (host,) + tuple(sorted(r for r in alive + joiners if r != host))
    cs.joiners = joiners
    cs.members_version = st.index.alive_version
    cs.store_host = host
    cs.store_addr = ""
    cs.announced_at = st.now
    cs.ready_at = None
    out.append(
        Notice(
            "collective_generation",
            {"generation": cs.generation, "members": list(cs.members), "store_host": host, "reason": why,
             "joiners": list(joiners)},  # fmt: skip
        )
    )
    _rendezvous(st, cs, out)


def _gone(st: CoordinatorState, cs: CollectiveState, rank: int) -> bool:
    """Is this member of the generation no longer in it (neither ACTIVE nor its joiner)?"""
    phase = st.ranks[rank].phase
    return phase is not ACTIVE and not (phase is JOINING and rank in cs.joiners)


def on_store_ready(st: CoordinatorState, ev: StoreReady, out: list[Command]) -> None:
    cs = st.collective
    if cs is None:
        st.count_ignored("StoreReady on the bus plane")
        return
    if ev.generation != cs.generation or ev.rank != cs.store_host:
        st.count_ignored("stale StoreReady")
        return
    if cs.store_addr:
        st.count_ignored("duplicate StoreReady")
        return
    if not ev.addr:
        st.count_ignored("StoreReady without an address")
        return
    if cs.reform_reason or st.run.phase is not TRAINING or any(_gone(st, cs, r) for r in cs.members):
        st.count_ignored("StoreReady for a generation being replaced")
        return
    cs.store_addr = ev.addr
    cs.ready_at = st.now
    cs.rendezvous_s += max(0.0, st.now - cs.announced_at)
    out.append(Notice("collective_rendezvous", {"generation": cs.generation, "store_addr": ev.addr}))
    _rendezvous(st, cs, out)


def on_failed(st: CoordinatorState, ev: CollectiveFailed, out: list[Command]) -> None:
    """A member's group of ``ev.generation`` broke: re-form (``announce``). A failure to
    form (cycle 0) blames the store host: the next generation tries another."""
    cs = st.collective
    if cs is None:
        st.count_ignored("CollectiveFailed on the bus plane")
        return
    if ev.generation != cs.generation or ev.rank not in cs.members:
        st.count_ignored("stale CollectiveFailed")
        return
    if cs.reform_reason:
        st.count_ignored("duplicate CollectiveFailed")
        return
    cs.failures += 1
    what = "the seed broadcast" if ev.seeding else f"cycle {ev.cycle}" if ev.cycle else "formation"
    cs.reform_reason = f"rank {ev.rank}: group failed in {what}: {ev.reason or 'no reason given'}"
    cs.host_failed = ev.cycle == 0 and not ev.seeding  # a broadcast ran: the group had formed
    if ev.seeding and cs.joiners:
        cs.seed_failures += 1
    out.append(
        Notice(
            "collective_failed",
            {"rank": ev.rank, "generation": ev.generation, "cycle": ev.cycle, "reason": ev.reason},
        )
    )


def on_restarted(st: CoordinatorState) -> None:
    """``CoordinatorRestarted``: the group of the current generation is re-formed (among
    the alive ranks, by the next ``announce``) -- see the module doc. Nothing to do before
    the world formed; a re-formation already due keeps its reason (and its blame)."""
    cs = st.collective
    if cs is None or cs.generation == 0 or cs.reform_reason:
        return
    cs.reform_reason = "coordinator restarted"
    cs.host_failed = False


def include(st: CoordinatorState, ranks: list[int]) -> None:
    """The ``seed_joiners`` rule marked ``ranks`` seeding: a generation that includes them is due."""
    cs = st.collective
    if cs is not None and ranks and not cs.reform_reason:
        cs.reform_reason = f"joiner(s) {ranks} admitted"


def on_seeded(st: CoordinatorState, rank: int) -> None:
    """A joiner loaded the seed broadcast and is ACTIVE now: one joiner fewer to wait for."""
    cs = st.collective
    if cs is not None and rank in cs.joiners:
        cs.joiners = tuple(r for r in cs.joiners if r != rank)
        cs.seeds += 1
        cs.seed_failures = 0


def on_joiner_gone(st: CoordinatorState, rank: int) -> None:
    """A joiner was lost before it was seeded: its generation is re-formed without it."""
    cs = st.collective
    if cs is not None and rank in cs.joiners:
        cs.joiners = tuple(r for r in cs.joiners if r != rank)
        cs.seed_failures = 0
        if not cs.reform_reason:
            cs.reform_reason = f"joiner {rank} gone before it was seeded"
            cs.host_failed = False


def joiners_to_drop(st: CoordinatorState) -> list[tuple[int, str]]:
    """``(rank, reason)`` for the joiners to refuse once ``SEED_ATTEMPTS`` seed
    broadcasts failed in a row (the members re-form without them and average again)."""
    cs = st.collective
    if cs is None or cs.seed_failures < SEED_ATTEMPTS:
        return []
    cs.seed_failures = 0
    why = (
        f"the seed broadcast of the collective group failed {SEED_ATTEMPTS} times ({cs.reform_reason}); "
        f"check that this host reaches the others (GLOO_SOCKET_IFNAME), then start it again"
    )
    return [(r, why) for r in cs.joiners]


def seeding(st: CoordinatorState) -> str:
    """Why no round may open now ("" when one may): the generation still seeds joiners."""
    cs = st.collective
    if cs is None or not cs.joiners:
        return ""
    return f"generation {cs.generation} is seeding joiner(s) {list(cs.joiners)}: rounds wait until they hold the parameters"


def summary(cs: CollectiveState, config: CoreConfig) -> dict[str, Any]:
    """``{backend, timeout_s, generation, members, store_host, reforms, failures,
    rendezvous_s, seeds}`` (``seeds``: joiners seeded by a broadcast)."""
    return {
        "backend": config.collective_backend,
        "timeout_s": config.collective_timeout_s,
        "generation": cs.generation,
        "members": list(cs.members),
        "store_host": cs.store_host,
        "reforms": cs.reforms,
        "failures": cs.failures,
        "rendezvous_s": cs.rendezvous_s,
        "seeds": cs.seeds,
    }
